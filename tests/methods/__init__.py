"""Tests of kaisa.methods."""
