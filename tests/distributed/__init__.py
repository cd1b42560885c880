"""Tests of kaisa.distributed."""
