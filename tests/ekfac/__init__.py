"""Tests of kaisa.ekfac."""
