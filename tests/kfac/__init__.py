"""Tests of kaisa.kfac."""
