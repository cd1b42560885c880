"""Checkpoints that let ``--resume`` reproduce an uninterrupted run exactly."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy, torch (and CUDA) random-number-generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a crash mid-write keeps the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (a trusted local file)."""
    payload: dict[str, Any] = torch.load(path, map_location=device, weights_only=False)
    return payload
