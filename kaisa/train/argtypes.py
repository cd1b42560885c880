"""Argument types of ``kaisa-train``'s parser: each error is one line that says why."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from kaisa.train.optim import parse_kl_clip

__all__ = ["finite", "int_from", "kl_clip"]


def int_from(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low`` (the error says so in one line)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def finite(*, low: float | None = None, positive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float, optionally ``>= low`` or ``> 0``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if positive and value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text!r}")
        return value

    return parse


def kl_clip(text: str) -> str:
    """An argparse type: a KL-clip value (a number or ``off``), lower-cased."""
    parse_kl_clip(text)
    return text.lower()
