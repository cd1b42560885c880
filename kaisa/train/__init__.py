"""The ``kaisa-train`` application: training, comparisons and benchmarks.

Run ``kaisa-train --help`` (or ``python -m kaisa.train --help``) for the flags;
:func:`kaisa.train.cli.main` runs it in-process. The application needs the ``train``
extra (numpy, scikit-learn, tqdm, matplotlib); the ``kaisa`` library itself needs only
torch.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["TRAIN_REQUIREMENTS", "main", "missing_requirements"]

#: Import name -> distribution of what the application needs beyond torch.
TRAIN_REQUIREMENTS = {
    "numpy": "numpy",
    "sklearn": "scikit-learn",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}


def missing_requirements() -> list[str]:
    """Distributions of the ``train`` extra that are not installed."""
    return [d for m, d in TRAIN_REQUIREMENTS.items() if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kaisa-train``: one clear line when the ``train`` extra is missing.

    Without ``argv`` (the command itself: ``kaisa-train``, ``python -m kaisa.train``), a
    torchrun worker that stopped or failed exits at once after reporting it.
    """
    missing = missing_requirements()
    if missing:
        print(
            f"kaisa-train: error: missing {', '.join(missing)}; install the application "
            "with: pip install --no-build-isolation '.[train]' (or 'kaisa[train]')",
            file=sys.stderr,
        )
        return 2
    from kaisa.train.cli import main as cli_main

    return cli_main(argv, exit_fast=argv is None)
