"""Writing preconditioned gradients back, with KL clipping and the non-finite guard.

Per layer, the preconditioned gradient ``P`` replaces ``grad`` unless it is non-finite
(then the layer keeps its gradient and is left out of the KL sum). With ``kl_clip``,
every ``P`` is scaled by ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <P_l, grad_l>|))``
(``docs/conventions.md``). No host synchronisation: the checks stay device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.utils.finite import all_finite
from kaisa.utils.shards import is_sharded, rows_of

__all__ = ["guarded_directions", "parameter_directions", "write_preconditioned"]


def guarded_directions(
    pairs: Sequence[Preconditioned], *, kl_clip: float | None, lr: float
) -> list[tuple[CurvatureBlock, torch.Tensor]]:
    """Each block's final direction: ``P`` KL-clipped, or its gradient where ``P`` is not finite.

    Args:
        pairs: The core's preconditioned gradients.
        kl_clip: The KL-clip threshold, ``None`` for no clipping.
        lr: The learning rate of the KL clip.

    Returns:
        ``(block, direction matrix)`` per entry.
    """
    if not pairs:
        return []
    checks: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for entry in pairs:
        g, p, valid = entry.grad, entry.direction, entry.valid
        ok = all_finite(p) if entry.finite is None else entry.finite
        t = None
        if kl_clip is not None:
            t = (p * g).sum(dtype=torch.float64) if entry.inner is None else entry.inner
            ok = ok & torch.isfinite(t)
        checks.append((t, ok if valid is None else ok & valid))
    nu: torch.Tensor | None = None
    if kl_clip is not None:
        device = checks[0][1].device
        terms = [
            torch.where(ok, t, torch.zeros_like(t)).to(device)
            for t, ok in checks
            if t is not None
        ]
        vg = torch.stack(terms).to(torch.float64).sum() * (lr * lr)
        ratio = torch.sqrt(kl_clip / vg.abs())
        nu = torch.where(vg == 0, torch.ones_like(vg), ratio.clamp(max=1.0))
    out = []
    for entry, (_, ok) in zip(pairs, checks, strict=True):
        p = entry.direction
        scaled = p if nu is None else p * nu.to(p.device, p.dtype)
        out.append((entry.block, torch.where(ok, scaled, entry.grad)))
    return out


def write_preconditioned(
    pairs: Sequence[Preconditioned], *, kl_clip: float | None, lr: float
) -> None:
    """Writes :func:`guarded_directions` into the parameters' ``.grad``."""
    for block, direction in guarded_directions(pairs, kl_clip=kl_clip, lr=lr):
        block.write_grad(direction)


def parameter_directions(
    pairs: Sequence[Preconditioned], params: list[torch.Tensor], raw: list[torch.Tensor]
) -> list[torch.Tensor]:
    """:func:`guarded_directions` (unclipped) per parameter: ``raw[i]`` where no block covers it.

    Args:
        pairs: The core's preconditioned gradients.
        params: The parameters (a block's frozen parameter is skipped).
        raw: Their gradients, in the same order (not modified).

    Returns:
        One direction per parameter; a parameter several blocks share gets each block's
        rows (the other rows keep ``raw``'s). Under FSDP2 (``DTensor`` parameters and
        gradients, the entries carrying the rows this rank holds) each direction is a
        ``DTensor`` like its gradient, with this rank's rows written.
    """
    directions = list(raw)
    index = {id(p): i for i, p in enumerate(params)}
    for block, matrix in guarded_directions(pairs, kl_clip=None, lr=1.0):
        for p, part, rows in zip(block.parameters(), block.parts(matrix),
                                 block.row_slices(), strict=True):
            if id(p) not in index:  # a frozen parameter
                continue
            i = index[id(p)]
            if rows is None and not is_sharded(p):
                directions[i] = part
            else:  # some rows: a parameter several blocks share, or a rank's shard's rows
                if directions[i] is raw[i]:
                    directions[i] = raw[i].clone()
                rows_of(directions[i], p, rows).copy_(part)
    return directions
