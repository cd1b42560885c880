"""What a configuration's training produced: its records, its totals, how it stopped."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["NonFiniteLossError", "Record", "RunResult", "fingerprint", "kfac_summary"]

Record = dict[str, Any]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""

    def __init__(
        self, *, label: str, epoch: int, step: int, value: float, history: list[Record]
    ) -> None:
        super().__init__(
            f"non-finite loss ({value}) in configuration {label!r} at epoch {epoch}, step {step}"
        )
        self.epoch = epoch
        self.step = step
        self.history = history


@dataclass
class RunResult:
    """Outcome of :func:`train`: per-epoch records and totals."""

    label: str
    history: list[Record] = field(default_factory=list)
    steps: int = 0
    train_time: float = 0.0
    init_checksum: str = ""
    diverged: str | None = None


def kfac_summary(label: str, curvature: Any, largest: int = 3) -> str:
    """One line: registered layers, modelled K-FAC memory per rank, the largest factors."""
    estimate = curvature.memory_estimates()[curvature.engine.grid.fraction]
    top = ", ".join(
        f"{f.layer}.{f.side.value} {f'diag {f.dim}' if f.diagonal else f'{f.dim}x{f.dim}'}"
        f"{f' x{f.blocks}' if f.blocks > 1 else ''} "
        f"({f.nbytes / 2**20:.1f} MB, {f.gflop:.2g} GFLOP)"
        for f in curvature.factor_sizes()[:largest]
    )
    return (
        f"[{label}] K-FAC: {len(curvature.blocks)} layers, modelled memory per rank "
        f"{estimate.max_total_mb:.1f} MB; largest factors: {top}"
    )


def fingerprint(model: nn.Module) -> str:
    """Short SHA-256 of all parameters (equal for identically initialised models)."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]
