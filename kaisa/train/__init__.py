"""The ``kaisa-train`` application: training, comparisons and benchmarks.

Run ``kaisa-train --help`` (or ``python -m kaisa.train --help``) for the flags;
:func:`kaisa.train.cli.main` runs it in-process.
"""
