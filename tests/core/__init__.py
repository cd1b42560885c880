"""Tests of kaisa.core."""
