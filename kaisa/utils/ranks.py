"""This process's rank and the world size, with or without ``torch.distributed``."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank", "world_size"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without an initialised ``torch.distributed``)."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The default group's size (1 without an initialised ``torch.distributed``)."""
    return dist.get_world_size() if _initialized() else 1
