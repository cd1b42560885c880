"""Tests of kaisa.preconditioner."""
