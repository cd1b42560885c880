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
from kaisa.core.grouped import BlockGroup, GroupedDirections
from kaisa.utils.finite import all_finite
from kaisa.utils.shards import is_sharded, rows_of

__all__ = ["grouped_parameter_directions", "guarded_directions", "parameter_directions",
           "write_directions", "write_preconditioned"]


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
    return _guarded(pairs, kl_clip, lr)


def _guarded(pairs: Sequence[Preconditioned], kl_clip: float | None, lr: float, *,
             in_place: bool = False) -> list[tuple[CurvatureBlock, torch.Tensor]]:
    """:func:`guarded_directions`; ``in_place``: in the ``P`` buffers where they may be."""
    if not pairs:
        return []
    checks = _checks(pairs, kl_clip)
    nu = None
    if kl_clip is not None:
        device = checks[0][1].device
        terms = [torch.where(ok, t, torch.zeros_like(t)).to(device)
                 for t, ok in checks if t is not None]
        nu = _nu(torch.stack(terms).to(torch.float64).sum(), kl_clip, lr)
    return _apply(pairs, checks, nu, in_place=in_place)


def _checks(pairs: Sequence[Preconditioned], kl_clip: float | None,
            ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Per entry: ``(<P, grad>, usable)``.

    The KL inner product is float64 (``None`` without a clip); usable means finite, and
    sent if it was received.
    """
    checks: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for entry in pairs:
        g, p, valid = entry.grad, entry.direction, entry.valid
        ok = all_finite(p) if entry.finite is None else entry.finite
        t = None
        if kl_clip is not None:
            t = (p * g).sum(dtype=torch.float64) if entry.inner is None else entry.inner
            ok = ok & torch.isfinite(t)
        checks.append((t, ok if valid is None else ok & valid))
    return checks


def _nu(total: torch.Tensor, kl_clip: float, lr: float) -> torch.Tensor:
    """The KL clip's scale ``min(1, sqrt(kl_clip / |lr^2 total|))``, 1 where ``total`` is 0.

    As ``rsqrt(|total| lr^2 / kl_clip)`` clamped at 1: ``rsqrt(0)`` is infinite, so the
    zero case needs no branch of its own (``kl_clip > 0``); four operator calls.
    """
    return (total.abs() * (lr * lr / kl_clip)).rsqrt().clamp(max=1.0)


def _apply(pairs: Sequence[Preconditioned],
           checks: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
           nu: torch.Tensor | None, *, in_place: bool = False,
           ) -> list[tuple[CurvatureBlock, torch.Tensor]]:
    """Each entry's final direction; ``in_place``: written over its ``P`` where it may be."""
    out = []
    for entry, (_, ok) in zip(pairs, checks, strict=True):
        p, g = entry.direction, entry.grad
        if in_place and _own_buffer(p, g):
            if nu is not None:
                p.mul_(nu.to(p.device, p.dtype))
            out.append((entry.block, torch.where(ok, p, g, out=p)))
            continue
        scaled = p if nu is None else p * nu.to(p.device, p.dtype)
        out.append((entry.block, torch.where(ok, scaled, g)))
    return out


def _own_buffer(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether ``P`` may be overwritten: a plain tensor that shares no storage with ``g``."""
    return (type(p) is torch.Tensor and p.is_contiguous()
            and p.untyped_storage().data_ptr() != g.untyped_storage().data_ptr())


def write_directions(directions: GroupedDirections, *, kl_clip: float | None,
                     lr: float) -> None:
    """:func:`write_preconditioned` of a grouped step (:mod:`kaisa.core.grouped`).

    The same directions as the per-block path (the KL sum's order aside): per block, ``P``
    KL-clipped where it is finite, else its gradient. A group's blocks are checked on its
    stacks (with a clip, ``<P, grad>`` is finite exactly when ``P`` and ``grad`` are, so that
    one check serves), the scaling is one multi-tensor call, and every grouped ``.grad`` is
    written by one more. ``directions`` is used up: the final directions are computed in
    the buffers of the preconditioned gradients (no copy of them is made), which are
    left holding them.
    """
    if not directions.groups:
        for block, direction in _guarded(directions.single, kl_clip, lr, in_place=True):
            block.write_grad(direction)
        return
    stacks, single = _grouped_final(directions, kl_clip, lr, in_place=True)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for group, direction in stacks:
        d, s = group.destinations(direction)
        dst += d
        src += s
    torch._foreach_copy_(dst, src)
    for block, direction in single:
        block.write_grad(direction)


def grouped_parameter_directions(
    directions: GroupedDirections, params: list[torch.Tensor], raw: list[torch.Tensor]
) -> list[torch.Tensor]:
    """:func:`parameter_directions` of a grouped step: the stacks' parts are views.

    Args:
        directions: The core's grouped preconditioning of ``raw``
            (:meth:`~kaisa.core.curvature.KFACCurvature.precondition_grouped` with them).
        params: The parameters.
        raw: Their gradients, in the same order (not modified).

    Returns:
        One direction per parameter, as :func:`parameter_directions` gives them.
    """
    if not directions.groups:
        return parameter_directions(directions.single, params, raw)
    stacks, single = _grouped_final(directions, None, 1.0)
    out = list(raw)
    index = {id(p): i for i, p in enumerate(params)}
    for group, direction in stacks:  # a grouped block covers every row of its parameters
        for p, part in zip(*group.destinations(direction, params=True), strict=True):
            if id(p) in index:
                out[index[id(p)]] = part
    return _place(single, index, out, raw)


def _grouped_final(directions: GroupedDirections, kl_clip: float | None, lr: float, *,
                   in_place: bool = False,
                   ) -> tuple[list[tuple[BlockGroup, torch.Tensor]],
                              list[tuple[CurvatureBlock, torch.Tensor]]]:
    """Every group's final direction stack and every other block's final direction.

    With ``in_place`` they are computed in the direction stacks and entries (where these
    share no storage with the gradients), which then hold them: the scaling, the choice
    and the KL products' buffers add no copy of the directions.
    """
    groups, single = directions.groups, directions.single
    checks = _checks(single, kl_clip)
    grads = [g for _, g, _ in groups]
    precond = [p for _, _, p in groups]
    own = in_place and all(_own_buffer(p, g) for p, g in zip(precond, grads, strict=True))
    if kl_clip is not None:
        products = torch._foreach_mul(precond, grads)
        inner = torch.cat([_per_block(x, group).sum(dim=(1, 2), keepdim=True,
                                                     dtype=torch.float64)
                           for x, (group, _, _) in zip(products, groups, strict=True)])
        del products  # a copy of every direction: gone before the final ones are computed
        ok_all = (inner * 0) == 0  # isfinite in two calls (inf * 0 and NaN * 0 are NaN)
        total = inner.nan_to_num(0.0, 0.0, 0.0).sum()  # the finite terms
        if checks:
            total = total + torch.stack([torch.where(ok, t, torch.zeros_like(t)).to(total.device)
                                         for t, ok in checks if t is not None]).sum()
        nu = _nu(total, kl_clip, lr)
        oks = (list(torch.split(ok_all, [len(g.blocks) for g, _, _ in groups]))
               if len(groups) > 1 else [ok_all])
        scales: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for p in precond:  # nu once per device and dtype (one of each, almost always)
            if (p.device, p.dtype) not in scales:
                scales[p.device, p.dtype] = nu.to(p.device, p.dtype)
        if len(scales) == 1 and own:
            torch._foreach_mul_(precond, next(iter(scales.values())))
        elif len(scales) == 1:
            precond = list(torch._foreach_mul(precond, next(iter(scales.values()))))
        else:
            precond = [p.mul_(scales[p.device, p.dtype]) if own else p * scales[p.device, p.dtype]
                       for p in precond]
    else:
        nu = None
        oks = [torch.isfinite(_per_block(p, group)).all(dim=(1, 2), keepdim=True)
               for p, (group, _, _) in zip(precond, groups, strict=True)]
    stacks = []
    for (group, g, _), p, ok in zip(groups, precond, oks, strict=True):
        n = group.blocks[0].groups
        mask = ok if n == 1 else ok.repeat_interleave(n, 0)
        stacks.append((group, torch.where(mask, p, g, out=p) if own else torch.where(mask, p, g)))
    return stacks, _apply(single, checks, nu, in_place=in_place)


def _per_block(x: torch.Tensor, group: BlockGroup) -> torch.Tensor:
    """A group's ``(blocks * groups, m, n)`` stack as ``(blocks, groups * m, n)``."""
    n = group.blocks[0].groups
    return x if n == 1 else x.view(len(group.blocks), -1, x.shape[-1])


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
    index = {id(p): i for i, p in enumerate(params)}
    return _place(guarded_directions(pairs, kl_clip=None, lr=1.0), index, list(raw), raw)


def _place(finals: Sequence[tuple[CurvatureBlock, torch.Tensor]], index: dict[int, int],
           directions: list[torch.Tensor], raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """Puts each block's final direction into ``directions`` (by parameter ``index``)."""
    for block, matrix in finals:
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
