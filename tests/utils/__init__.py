"""Tests of kaisa.utils."""
