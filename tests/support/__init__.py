"""Test support: explicit K-FAC math, shared cases, spawned gloo ranks, fakes.

Importable as ``tests.support`` (``tests`` is a package; pytest puts the repository root
on ``sys.path``), also from spawned distributed workers.
"""
