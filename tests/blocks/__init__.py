"""Tests of kaisa.blocks."""
