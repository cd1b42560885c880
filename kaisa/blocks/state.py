"""The state of a curvature block apart from its kind: statistics and running factors.

* :class:`BatchStatistics` (``block.stats``): what the hooks record during a step — the
  per-micro-batch factor sums, or the raw inputs / output gradients (with their call
  sites) when factors are computed in ``step()``;
* :class:`RunningFactors` (``block.factors``): the running averages ``A`` and ``G``
  (``(groups, n, n)``, starting from the identity; a diagonal side is kept as its diagonal
  ``(groups, n)``, starting from ones) and the count of non-finite batch factors skipped;
* :class:`BlockOptions`: what registration gives every kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kaisa import ops
from kaisa.utils.enums import KFACApprox, Side
from kaisa.utils.finite import all_finite, finite_each
from kaisa.utils.packing import pack_symmetric, unpack_symmetric

__all__ = [
    "LARGE_FACTOR_DIM", "BatchStatistics", "BlockOptions", "RunningFactors", "tensor_bytes",
]

#: Dense factors larger than this (per side) are reported at registration: their
#: decomposition dominates a step (8193 x 8193 is ~5 TFLOP per eigendecomposition).
#: A diagonal factor of any size is not.
LARGE_FACTOR_DIM = 8192


@dataclass
class BatchStatistics:
    """What the hooks recorded in the current step (cleared when taken)."""

    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    a_count: int = 0
    g_count: int = 0
    #: Inputs with the index of the call site each was observed at.
    saved_inputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: Output gradients with the divisor each is unscaled by and its call site.
    saved_grads: list[tuple[torch.Tensor, float | torch.Tensor, int]] = field(
        default_factory=list)
    #: Row subsets drawn by forward calls whose backward has not used them yet, per call
    #: site, last drawn last (``None``: the call used every row). ``factor_rows`` only.
    row_draws: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    #: Whether the core folds this block's micro-batch statistics into its running factors
    #: where they are computed (``docs/conventions.md``, "Folding statistics where they
    #: are computed"); then an input is kept in :attr:`saved_inputs` until its micro-batch
    #: is folded, and its A factor computed there.
    folding: bool = False
    #: Whether the step's batch factors, averaged to the ranks that hold the running
    #: factors (under FSDP2), are folded there as soon as the average arrives, in the
    #: backward pass (not kept until ``step()``).
    fold_average: bool = False
    #: The sides folded into the running factors in this step (their running factors, not
    #: batch factors, are averaged over ranks).
    folded: set[Side] = field(default_factory=set)

    def add_a(self, a_batch: torch.Tensor) -> None:
        """Adds one micro-batch A factor."""
        self.a_sum = a_batch if self.a_sum is None else self.a_sum.add_(a_batch)
        self.a_count += 1

    def add_g(self, g_batch: torch.Tensor) -> None:
        """Adds one micro-batch G factor."""
        self.g_sum = g_batch if self.g_sum is None else self.g_sum.add_(g_batch)
        self.g_count += 1

    @property
    def has_factors(self) -> bool:
        """Whether any batch factor was recorded."""
        return self.a_sum is not None or self.g_sum is not None

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Mean batch factors over the recorded micro-batches; clears them."""
        a = _mean(self.a_sum, self.a_count)
        g = _mean(self.g_sum, self.g_count)
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        return a, g

    def nbytes(self) -> int:
        """Bytes held."""
        return tensor_bytes(self.a_sum, self.g_sum, *(x for x, _ in self.saved_inputs),
                     *(d for d, _, _ in self.saved_grads))

    def clear(self) -> None:
        """Forgets everything recorded."""
        self.take()
        self.saved_inputs.clear()
        self.saved_grads.clear()
        self.row_draws.clear()
        self.folded.clear()


@dataclass(frozen=True)
class BlockOptions:
    """What registration gives every kind's :meth:`CurvatureBlock.build`.

    Attributes:
        factor_dtype: Factor dtype, ``None`` to follow the activations (>= fp32).
        kfac_approx: Expand or reduce over shared dimensions.
        cross_attention: Whether this module is cross-attention (attention kinds).
        factor_rows: Rows each call of a Linear, attention or embedding block's statistics
            keeps (a random subset, ``docs/conventions.md``), ``None`` for every row.
        row_generator: The CPU generator the row subsets are drawn from (with
            ``factor_rows``).
        max_dense_dim: A Linear or attention block keeps each side larger than this as
            its diagonal (``docs/conventions.md``, "One-sided bases"); ``None``: dense.
    """

    factor_dtype: torch.dtype | None = None
    kfac_approx: KFACApprox = KFACApprox.EXPAND
    cross_attention: bool = False
    factor_rows: int | None = None
    row_generator: torch.Generator | None = None
    max_dense_dim: int | None = None


@dataclass
class RunningFactors:
    """Running factors ``F <- rho F + (1 - rho) F_batch`` and the skipped-batch counts."""

    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    skipped_a: torch.Tensor | None = None  # 0-d counts: no host synchronisation
    skipped_g: torch.Tensor | None = None
    #: Sides kept as diagonals (start from ones, not the identity).
    diagonal_sides: frozenset[Side] = frozenset()
    #: 0-d counts of the fold round in which each side was last scaled by ``rho``
    #: (:meth:`fold_micro`; not part of a checkpoint).
    stamp_a: torch.Tensor | None = None
    stamp_g: torch.Tensor | None = None
    #: Dense sides kept as their upper triangles ``(groups, n(n+1)/2)``
    #: (``factor_storage='packed'``); :meth:`dense` unpacks them.
    packed: bool = False

    def is_packed(self, side: Side) -> bool:
        """Whether ``side`` is kept as upper triangles."""
        return self.packed and side not in self.diagonal_sides

    def stored(self, side: Side, factor: torch.Tensor) -> torch.Tensor:
        """``factor`` (``(groups, n, n)``, or a diagonal) in the layout ``side`` is kept in."""
        return pack_symmetric(factor) if self.is_packed(side) else factor

    def dense(self, side: Side) -> torch.Tensor | None:
        """The running factor of ``side`` as ``(groups, n, n)`` (unpacked: a new tensor).

        A diagonal side is its ``(groups, n)`` diagonal.
        """
        t = self.a if side is Side.A else self.g
        if t is None or not self.is_packed(side):
            return t
        n = (math.isqrt(8 * t.shape[-1] + 1) - 1) // 2
        return unpack_symmetric(t, n)

    def fold(self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None, rho: float,
             *, zero_start: bool = False) -> None:
        """Folds batch factors in; a non-finite batch is skipped (and counted).

        A factor that does not exist yet starts from the identity (ones when diagonal),
        or from zero with ``zero_start``.
        """
        diagonal = self.diagonal_sides
        if a_batch is not None:
            start = self.a if self.a is not None else self.stored(
                Side.A, _initial(a_batch, Side.A in diagonal, zero_start))
            self.a, self.skipped_a = _fold(start, self.stored(Side.A, a_batch), rho,
                                           self.skipped_a)
        if g_batch is not None:
            start = self.g if self.g is not None else self.stored(
                Side.G, _initial(g_batch, Side.G in diagonal, zero_start))
            self.g, self.skipped_g = _fold(start, self.stored(Side.G, g_batch), rho,
                                           self.skipped_g)

    def fold_micro(self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None, *,
                   rho: float, weight: float, round_: int, zero_start: bool = False) -> None:
        """Folds one micro-batch's factors: ``F <- s F + weight * F_mb``, or skips them.

        ``s`` is ``rho`` at the first finite micro-batch factor of fold round ``round_``
        (one factor-update step) and 1 after it, so the step's folds give
        ``rho F + weight * sum(F_mb)``; a non-finite factor leaves its ``F`` as it was and
        is counted, each side on its own (``docs/conventions.md``, "Folding statistics
        where they are computed"). A factor that does not exist yet (or changed shape,
        dtype or device) starts as :meth:`fold` starts it. Both sides (``None``: no
        batch) in one :func:`kaisa.ops.fold_many` call (one per dtype and device, should
        they differ), no host synchronisation.
        """
        sides = [(side, batch) for side, batch in ((Side.A, a_batch), (Side.G, g_batch))
                 if batch is not None]
        args = [self._fold_args(side, batch, zero_start) for side, batch in sides]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (_, batch, _, _) in enumerate(args):
            groups.setdefault((batch.device, batch.dtype), []).append(i)
        for members in groups.values():
            running, stamp, skipped = ops.fold_many(
                *([args[i][k] for i in members] for k in range(4)),
                round_=round_, decay=rho, weight=weight)
            for i, r, st, sk in zip(members, running, stamp, skipped, strict=True):
                if sides[i][0] is Side.A:
                    self.a, self.stamp_a, self.skipped_a = r, st, sk
                else:
                    self.g, self.stamp_g, self.skipped_g = r, st, sk

    def _fold_args(self, side: Side, dense: torch.Tensor, zero_start: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(running, batch, stamp, skipped)`` of ``side`` for :meth:`fold_micro`."""
        running = self.a if side is Side.A else self.g
        skipped = self.skipped_a if side is Side.A else self.skipped_g
        stamp = self.stamp_a if side is Side.A else self.stamp_g
        batch = self.stored(side, dense)
        if (running is None or running.shape != batch.shape or running.dtype != batch.dtype
                or running.device != batch.device):
            running = self.stored(side, _initial(dense, side in self.diagonal_sides, zero_start))
        if skipped is None:
            skipped = torch.zeros((), dtype=torch.int64, device=batch.device)
        if stamp is None or stamp.device != batch.device:
            stamp = torch.full((), -1, dtype=torch.int64, device=batch.device)
        return running, batch, stamp, skipped

    @property
    def skipped(self) -> int:
        """Non-finite batch factors not folded in (synchronises the device)."""
        return sum(int(t.item()) for t in (self.skipped_a, self.skipped_g) if t is not None)


#: A factor :func:`fold_all` updates: its block's running factors, the side, the running
#: factor and the batch factor.
_Slot = tuple["RunningFactors", Side, torch.Tensor, torch.Tensor]
#: Bytes of running factors :func:`fold_all` updates per batch of multi-tensor calls: its
#: temporaries (the scaled factors) stay within about twice this, plus the largest factor.
FOLD_CHUNK_BYTES = 64 * 2**20


def fold_all(
    items: Sequence[tuple[RunningFactors, torch.Tensor | None, torch.Tensor | None]],
    rho: float, *, zero_start: bool = False,
) -> None:
    """:meth:`RunningFactors.fold` of many blocks' batch factors, in a few calls.

    The same arithmetic and skipping (the running factors come out bit for bit the same),
    grouped: the finiteness of every batch factor is :func:`kaisa.utils.finite.finite_each`
    (one multi-tensor L1 norm accumulated in float64 for 32-bit factors), and
    ``rho F`` and ``(1 - rho) F_batch`` are multi-tensor calls over factors of one dtype and
    device, in chunks of :data:`FOLD_CHUNK_BYTES`; the choice between the new and the old
    factor stays one ``where`` per factor (on the CPU, where the flags are read from memory
    without a wait, only when some batch factor is not finite). A factor folded for the
    first time (or whose shape, dtype or device changed) takes :meth:`RunningFactors.fold`.

    Args:
        items: ``(running factors, A batch, G batch)`` per block (``None``: no batch).
        rho: The running-average decay.
        zero_start: A first factor starts from zero, not the identity.
    """
    slots: dict[tuple[torch.device, torch.dtype], list[_Slot]] = {}
    for factors, a_batch, g_batch in items:
        for side, dense in ((Side.A, a_batch), (Side.G, g_batch)):
            if dense is None:
                continue
            batch = factors.stored(side, dense)
            running = factors.a if side is Side.A else factors.g
            skipped = factors.skipped_a if side is Side.A else factors.skipped_g
            if (running is None or skipped is None or running.shape != batch.shape
                    or running.dtype != batch.dtype or running.device != batch.device):
                a, g = (dense, None) if side is Side.A else (None, dense)
                factors.fold(a, g, rho, zero_start=zero_start)
                continue
            slots.setdefault((batch.device, batch.dtype), []).append((factors, side, running,
                                                                       batch))
    for same in slots.values():
        for chunk in _chunks(same):
            _fold_chunk(chunk, rho)


def _chunks(slots: list[_Slot]) -> list[list[_Slot]]:
    out: list[list[_Slot]] = [[]]
    size = 0
    for slot in slots:
        nbytes = slot[2].numel() * slot[2].element_size()
        if out[-1] and size + nbytes > FOLD_CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(slot)
        size += nbytes
    return out


def _fold_chunk(chunk: list[_Slot], rho: float) -> None:
    running = [r for _, _, r, _ in chunk]
    batches = [b for _, _, _, b in chunk]
    finite = finite_each(batches)
    updated = torch._foreach_mul(running, rho)
    torch._foreach_add_(updated, torch._foreach_mul(batches, 1.0 - rho))
    if finite.device.type == "cpu" and not torch.compiler.is_compiling() and all(
            finite.tolist()):  # read from memory (no device to wait for): no choice to make
        for (factors, side, _, _), new in zip(chunk, updated, strict=True):
            if side is Side.A:
                factors.a = new
            else:
                factors.g = new
        return
    skipped = [f.skipped_a if side is Side.A else f.skipped_g for f, side, _, _ in chunk]
    counts = torch._foreach_add(skipped, list((~finite).to(torch.int64).unbind()))  # type: ignore[arg-type]
    for (factors, side, old, _), new, ok, count in zip(chunk, updated, finite.unbind(), counts,
                                                       strict=True):
        if side is Side.A:
            factors.a, factors.skipped_a = torch.where(ok, new, old), count
        else:
            factors.g, factors.skipped_g = torch.where(ok, new, old), count


def _mean(total: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """``total / count``; one recorded factor is returned as it is (``x / 1`` is ``x``)."""
    if total is None or count == 1:
        return total
    return total / count


def tensor_bytes(*ts: torch.Tensor | None) -> int:
    """Bytes held by the tensors given (``None`` counts nothing)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _initial(batch: torch.Tensor, diagonal: bool, zero_start: bool) -> torch.Tensor:
    """A running factor that does not exist yet: zero, ones (diagonal) or the identity."""
    if zero_start:
        return torch.zeros_like(batch)
    if diagonal:
        return torch.ones_like(batch)
    eye = torch.eye(batch.shape[-1], dtype=batch.dtype, device=batch.device)
    return eye.expand_as(batch).clone()


def _fold(
    running: torch.Tensor, batch: torch.Tensor, rho: float, skipped: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if skipped is None:
        skipped = torch.zeros((), dtype=torch.int64, device=batch.device)
    finite = all_finite(batch)
    updated = running * rho + batch * (1.0 - rho)
    running = torch.where(finite, updated, running)
    skipped = skipped + (~finite).to(skipped.dtype)
    return running, skipped
