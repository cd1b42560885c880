"""Tests of kaisa.checkpoint."""
