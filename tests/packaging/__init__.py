"""Tests of the kaisa package as a whole: its layering and its dependencies."""
