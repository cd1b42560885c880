"""What one rank decomposes, and what each decomposition broadcast carries.

The pieces of :meth:`~kaisa.distributed.DistributedEngine.update_decompositions` that
read the placement and the method but move nothing: the factors the placement assigns
to this rank, decomposed in one batched call (:func:`decompose_assigned`); the tensors a
broadcast sends from its source or receives elsewhere (:func:`payload`); and exactly
what receivers rebuild from a payload (:func:`as_received`), so that every gradient
worker preconditions bit for bit alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.distributed.config import EngineConfig
from kaisa.distributed.placement import Placement
from kaisa.methods import Damping, Payload, SecondOrderMethod
from kaisa.utils.enums import Side
from kaisa.utils.packing import pack_symmetric, unpack_symmetric

__all__ = ["FactorKey", "as_received", "decompose_assigned", "has_factors", "payload"]

#: One factor: (block name, side).
FactorKey: TypeAlias = tuple[str, Side]


def has_factors(layer: CurvatureBlock, method: SecondOrderMethod) -> bool:
    """Whether ``layer`` holds the running factors of every side ``method`` decomposes."""
    return all((layer.factors.a if side is Side.A else layer.factors.g) is not None
               for side in method.sides)


def decompose_assigned(
    layers: Sequence[CurvatureBlock],
    damping: float,
    *,
    placement: Placement,
    rank: int,
    method: SecondOrderMethod,
    config: EngineConfig,
    warm_start: bool = False,
) -> dict[FactorKey, Payload | None]:
    """Decomposes the factors ``placement`` assigns to ``rank``, in one batch.

    Args:
        layers: The blocks with the running factors of the method's sides.
        damping: The current damping.
        placement: The placement.
        rank: This rank.
        method: The second-order method.
        config: The distributed configuration (``inv_dtype``, ``symmetry_aware``).
        warm_start: Give the method each factor's stored payload to start from.

    Returns:
        ``(name, side) -> payload`` as receivers rebuild it (``None``: it failed).
    """
    mine: list[tuple[CurvatureBlock, Side, Damping, torch.Tensor]] = []
    for la in layers:
        lp = placement[la.name]
        if rank not in (lp.a_rank, lp.g_rank) or not has_factors(la, method):
            continue
        a = la.a  # read once: packed factors are unpacked on each read
        assert a is not None
        if Side.G not in method.sides:  # one-sided: A alone, with the damping as given
            if lp.a_rank == rank:
                mine.append((la, Side.A, damping, a))
            continue
        g = la.g
        assert g is not None
        damping_a, damping_g = method.factor_damping(a, g, damping, diagonal=la.diagonal_sides)
        if lp.a_rank == rank:
            mine.append((la, Side.A, damping_a, a))
        if lp.g_rank == rank:
            mine.append((la, Side.G, damping_g, g))
    if not mine:
        return {}
    results = method.decompose(
        [factor for _, _, _, factor in mine],
        damping=[d for _, _, d, _ in mine],
        inv_dtype=config.inv_dtype,
        names=[f"{la.name}.{side.value}" for la, side, _, _ in mine],
        diagonal=[la.is_diagonal(side) for la, side, _, _ in mine],
        previous=[method.stored(la.decomposition, side, diagonal=la.diagonal_sides)
                  for la, side, _, _ in mine] if warm_start else None,
    )
    return {
        (la.name, side): None if res is None else as_received(
            res, method, symmetric=config.symmetry_aware, diagonal=la.is_diagonal(side))
        for (la, side, _, _), res in zip(mine, results, strict=True)
    }


def as_received(
    result: Payload, method: SecondOrderMethod, *, symmetric: bool, diagonal: bool
) -> Payload:
    """Exactly what receivers rebuild from ``result`` (same values, contiguous).

    Every gradient worker then preconditions bit for bit alike (matmul rounding
    depends on strides).

    Args:
        result: The method's payload.
        method: The method (which tensors are symmetric).
        symmetric: Whether symmetric tensors travel as packed triangles.
        diagonal: Whether the factor is kept as its diagonal.
    """
    out = []
    flags = method.payload_symmetric(diagonal=diagonal)
    for t, flag in zip(result, flags, strict=True):
        if symmetric and flag:
            t = unpack_symmetric(pack_symmetric(t), t.shape[-1])
        out.append(t.contiguous())
    return out


def payload(
    layer: CurvatureBlock,
    side: Side,
    *,
    src: int,
    rank: int,
    method: SecondOrderMethod,
    inv_dtype: torch.dtype,
    computed: Mapping[FactorKey, Payload | None],
) -> Payload:
    """Tensors broadcast for one factor: the data on ``src``, buffers elsewhere.

    The source sends what it computed, else its previous result, else NaNs (which
    receivers treat as "no result"; also what a source without running factors sends).
    Receivers may hold no running factor (under FSDP2 only the source does).
    """
    shape = layer.factor_shape(side)
    diagonal = layer.is_diagonal(side)
    shapes = method.payload_shapes(shape[0], shape[-1], diagonal=diagonal)
    device = layer.weight.device
    if src != rank:
        return [torch.empty(s, dtype=inv_dtype, device=device) for s in shapes]
    result = computed.get((layer.name, side)) or method.stored(
        layer.decomposition, side, diagonal=layer.diagonal_sides)
    if result is not None:
        return result
    return [torch.full(s, float("nan"), dtype=inv_dtype, device=device) for s in shapes]
