"""Tests of kaisa.train (the kaisa-train application) and its models."""
