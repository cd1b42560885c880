"""Fits and scores on disk: a directory a later process (or another machine) reads back.

A directory holds ``fit.pt`` (:meth:`kaisa.influence.EKFACInfluence.save`) and any number of
score sets, each ``<name>.pt`` (a tensor, or per-block tensors) beside ``<name>.json``
(its shape, the blocks, the settings that made it, the time). Everything is read with
``torch.load(weights_only=True)``; a file that is not what it should be is refused in
one line (``ValueError``), nothing is loaded.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["FIT_FILE", "fit_file", "load_scores", "read", "save_scores"]

#: The fit's file name inside a results directory.
FIT_FILE = "fit.pt"

Scores = torch.Tensor | dict[str, torch.Tensor]


def fit_file(path: str | Path) -> Path:
    """The fit's file: ``path``, or ``path/fit.pt`` for a directory (or no suffix)."""
    p = Path(path)
    return p / FIT_FILE if p.is_dir() or not p.suffix else p


def read(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU; refused in one line.

    The caller moves what it keeps to its device.
    """
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # missing, truncated or foreign
        raise ValueError(f"{path}: not {what} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from error


def save_scores(directory: str | Path, name: str, scores: Scores,
                settings: dict[str, Any] | None = None) -> Path:
    """Writes ``scores`` as ``directory/<name>.pt`` with ``<name>.json``; returns the file.

    Raises:
        ValueError: ``name`` is not a plain file name (letters, digits, ``_ . -``).
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise ValueError(f"score set name {name!r}: use letters, digits, '_', '.', '-'")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{name}.pt"
    torch.save(scores, file)
    parts = scores if isinstance(scores, dict) else {"all": scores}
    meta = {"name": name, "shape": {k: list(t.shape) for k, t in parts.items()},
            "per_block": isinstance(scores, dict), "settings": settings or {},
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return file


def load_scores(directory: str | Path, name: str) -> Scores:
    """The score set ``name`` of ``directory`` (:func:`save_scores`).

    Raises:
        ValueError: The file is missing, unreadable, or not a score set.
    """
    file = Path(directory) / f"{name}.pt"
    scores = read(file, "an influence score set")
    if isinstance(scores, torch.Tensor) or (isinstance(scores, dict) and scores and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in scores.items())):
        return scores  # type: ignore[no-any-return]
    raise ValueError(f"{file}: not an influence score set (a {type(scores).__name__})")
