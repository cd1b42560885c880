"""Tests of kaisa.ops, csrc/ and its CUDA kernels (on a GPU or under tools/simt)."""
