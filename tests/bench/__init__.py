"""Tests of bench/ (the benchmarks' smoke forms and the GPU script)."""
