"""Writing preconditioned gradients back, with KL clipping and the non-finite guard.

Per layer, the preconditioned gradient ``P`` replaces ``grad`` unless it is non-finite
(then the layer keeps its gradient and is left out of the KL sum). With ``kl_clip``,
every ``P`` is scaled by ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <P_l, grad_l>|))``
(``docs/conventions.md``). No host synchronisation: the checks stay device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa.distributed.engine import PreconditionedGradient
from kaisa.finite import all_finite

__all__ = ["write_preconditioned"]


def write_preconditioned(
    pairs: Sequence[PreconditionedGradient], *, kl_clip: float | None, lr: float
) -> None:
    """Scales (KL clip) and writes every finite preconditioned gradient to ``.grad``.

    Args:
        pairs: ``(layer, grad, P, valid)`` per layer; ``valid`` is a 0-d bool tensor for
            received gradients (``None`` for local ones).
        kl_clip: The KL-clip threshold, ``None`` for no clipping.
        lr: The learning rate of the KL clip.
    """
    if not pairs:
        return
    checks: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for _, g, p, valid in pairs:
        ok = all_finite(p)
        t = None
        if kl_clip is not None:
            t = (p * g).sum(dtype=torch.float64)
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
    for (layer, g, p, _), (_, ok) in zip(pairs, checks, strict=True):
        scaled = p if nu is None else p * nu.to(p.device, p.dtype)
        layer.write_grad(torch.where(ok, scaled, g))
