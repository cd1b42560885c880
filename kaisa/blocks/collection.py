"""What a model's blocks hold together: their checkpoint check, memory and skip counts.

Functions over ``{name: block}`` (model order) that the curvature core
(:class:`kaisa.core.curvature.KFACCurvature`) reports through its own methods.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kaisa.blocks.base import CurvatureBlock

__all__ = ["check_blocks_state", "memory_usage", "skipped_factor_updates"]


def check_blocks_state(blocks: Mapping[str, CurvatureBlock], state: object) -> None:
    """Raises ``ValueError`` unless ``state`` holds a valid state of every block.

    It must name exactly ``blocks``, each checked by
    :meth:`~kaisa.blocks.CurvatureBlock.check_state_dict` (shapes, finiteness).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict layers is a {type(state).__name__}, not a dict")
    missing = set(blocks) - set(state)
    extra = set(state) - set(blocks)
    if missing or extra:
        raise ValueError(
            "state_dict layers do not match the registered layers: "
            f"missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    for name, block in blocks.items():
        block.check_state_dict(state[name])


def memory_usage(blocks: Mapping[str, CurvatureBlock]) -> dict[str, int]:
    """Bytes of K-FAC state the blocks hold on this rank by kind, plus ``'total'``."""
    usage = {"factors": 0, "decompositions": 0, "buffers": 0}
    for block in blocks.values():
        for key, value in block.memory_usage().items():
            usage[key] += value
    usage["total"] = sum(usage.values())
    return usage


def skipped_factor_updates(blocks: Mapping[str, CurvatureBlock]) -> int:
    """Per-batch factors not folded in because they were non-finite (syncs once)."""
    counts = [
        t
        for b in blocks.values()
        for t in (b.factors.skipped_a, b.factors.skipped_g)
        if t is not None
    ]
    if not counts:
        return 0
    total = torch.stack([c.to("cpu", non_blocking=False) for c in counts]).sum()
    return int(total.item())
