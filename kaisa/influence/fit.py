"""One block's EK-FAC fit: its sums, bases and ``Λ``, and the rotations into its bases.

Every tensor has the block's groups first: sums and bases ``(groups, n, n)``, ``Λ`` the
gradient matrix's ``(groups, rows, columns)``. A side without a basis (a diagonal side,
both sides of a diagonal kind) keeps ``None``: the identity (``docs/conventions.md``,
"Influence").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.influence.ranks import Ranks
from kaisa.influence.rows import Part, Rows, basis
from kaisa.utils.enums import Side

__all__ = ["BlockFit", "combines", "decompose", "dense_sides", "matrix_shape", "seeded",
           "summed_sides"]


def dense_sides(block: CurvatureBlock) -> tuple[bool, bool]:
    """Whether the block's A and G sides have a basis to fit (dense Kronecker factors)."""
    if block.diagonal:
        return False, False
    return not block.is_diagonal(Side.A), not block.is_diagonal(Side.G)


def summed_sides(block: CurvatureBlock) -> tuple[bool, bool]:
    """The sides whose sums the fit keeps: the dense ones, or both for combined uses.

    A tied weight's combination needs its diagonal side too.
    """
    if combines(block):
        return True, True
    return dense_sides(block)


def matrix_shape(block: CurvatureBlock) -> tuple[int, ...]:
    """The shape of the block's gradient matrix ``(groups, rows, columns)``."""
    zeros = [torch.zeros(p.shape, device="meta") for p in block.parameters()]
    matrix = block.gradient_matrix(zeros)
    assert matrix is not None
    return tuple(matrix.shape)


def _times(rows: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """``rows @ basis`` per group (``(N, groups, R, n)``); one GEMM for one group."""
    if basis is None:
        return rows
    if rows.shape[1] == 1:
        return (rows.reshape(-1, rows.shape[-1]) @ basis[0]).reshape(rows.shape)
    return rows @ basis


@dataclass
class BlockFit:
    """One block's sums and counts, then its bases and ``Λ``."""

    a_sum: torch.Tensor | None = None
    s_sum: torch.Tensor | None = None
    rows: int = 0
    lam_sum: torch.Tensor | None = None
    examples: int = 0
    qa: torch.Tensor | None = None
    qs: torch.Tensor | None = None
    based: bool = False

    def lam(self) -> torch.Tensor:
        """``Λ``: the mean of the examples' squared rotated gradients."""
        assert self.lam_sum is not None and self.examples > 0
        return self.lam_sum / self.examples

    def rotate(self, grads: torch.Tensor) -> torch.Tensor:
        """``QS^T G QA`` of matrices ``G`` (``(..., groups, rows, columns)``)."""
        if self.qs is not None:
            grads = self.qs.mT @ grads
        return grads if self.qa is None else grads @ self.qa

    def rotate_back(self, rotated: torch.Tensor) -> torch.Tensor:
        """``QS R QA^T``: the inverse of :meth:`rotate`."""
        if self.qs is not None:
            rotated = self.qs @ rotated
        return rotated if self.qa is None else rotated @ self.qa.mT

    def rotated(self, parts: Sequence[Part]) -> torch.Tensor:
        """``QS^T G_n QA`` of the examples' matrices made of ``parts`` (one per call).

        Kronecker rows are rotated before their products when that is cheaper (fewer
        rows per example than the matrix's dimensions make worth it), else the matrices.
        """
        total: torch.Tensor | None = None
        for part in parts:
            if isinstance(part, Rows) and self._rows_first(part):
                rotated = Rows(a=_times(part.a, self.qa), g=_times(part.g, self.qs)).matrices()
            else:
                rotated = self.rotate(part.matrices())
            total = rotated if total is None else total + rotated
        assert total is not None
        return total

    def _rows_first(self, part: Rows) -> bool:
        rows, out, cols = part.a.shape[-2], part.g.shape[-1], part.a.shape[-1]
        by_rows = rows * ((out * out if self.qs is not None else 0)
                          + (cols * cols if self.qa is not None else 0))
        by_matrix = out * cols * ((out if self.qs is not None else 0)
                                  + (cols if self.qa is not None else 0))
        return by_rows < by_matrix

    def add(self, block: CurvatureBlock, a: torch.Tensor | None, s: torch.Tensor | None,
            rows: int, dtype: torch.dtype) -> None:
        """Adds one batch's sums of ``block`` (the sides :func:`summed_sides` keeps)."""
        keep_a, keep_s = summed_sides(block)
        if keep_a and a is not None:
            self.a_sum = a.to(dtype) if self.a_sum is None else self.a_sum.add_(a)
        if keep_s and s is not None:
            self.s_sum = s.to(dtype) if self.s_sum is None else self.s_sum.add_(s)
        self.rows += rows

    def entry(self) -> dict[str, Any]:
        """What a saved fit keeps of the block (bases only where they are not identity)."""
        entry: dict[str, Any] = {"lam_sum": self.lam_sum, "examples": self.examples,
                                 "rows": self.rows}
        entry.update({key: t for key, t in (("qa", self.qa), ("qs", self.qs)) if t is not None})
        return entry

    @classmethod
    def loaded(cls, block: CurvatureBlock, entry: object, dtype: torch.dtype,
               device: torch.device) -> BlockFit:
        """The fit of ``block`` from a saved :meth:`entry` (checked: shapes, presence).

        Raises:
            ValueError: ``entry`` is not a fit of this block.
        """
        want: dict[str, tuple[int, ...] | None] = {"lam_sum": matrix_shape(block)}
        for key, dense, n in zip(("qa", "qs"), dense_sides(block), block.dims, strict=True):
            want[key] = (block.groups, n, n) if dense else None
        fields = entry if isinstance(entry, dict) else {}
        for key, shape in want.items():
            t = fields.get(key)
            if shape is None and t is None:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"the fit's {key} of layer {block.name!r} is not "
                                 f"{shape or 'absent'} (a fit of another model?)")
        qa, qs = (None if fields.get(k) is None else fields[k].to(device, dtype, copy=True)
                  for k in ("qa", "qs"))
        return cls(qa=qa, qs=qs, lam_sum=fields["lam_sum"].to(device, dtype, copy=True),
                   examples=int(fields["examples"]), rows=int(fields["rows"]), based=True)


def combines(block: CurvatureBlock) -> bool:
    """Whether the block's batch factors are its uses', combined (a tied weight)."""
    return type(block).combine is not CurvatureBlock.combine


def seeded(blocks: Mapping[str, CurvatureBlock],
           factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
           ) -> dict[str, BlockFit]:
    """The fits whose bases are a training run's running factors' (checked first).

    Raises:
        ValueError: A block's factors are missing or of another shape.
    """
    out = {}
    for name, block in blocks.items():
        dense, dims = dense_sides(block), block.dims
        pair = factors.get(name)
        if not any(dense):
            out[name] = BlockFit(based=True)
            continue
        want = [(block.groups, n, n) for n in dims]
        if pair is None or any(
                d and tuple(t.reshape(-1, *t.shape[-2:]).shape if t.dim() >= 2 else
                            t.shape) != w for d, t, w in zip(dense, pair, want, strict=True)):
            raise ValueError(f"the running factors of layer {name!r} are not "
                             f"{dims[0]}x{dims[0]} and {dims[1]}x{dims[1]} (another "
                             "model, or blocks without a bias column?)")
        qa, qs = (basis(t.reshape(w)).to(dtype) if d else None
                  for d, t, w in zip(dense, pair, want, strict=True))
        out[name] = BlockFit(qa=qa, qs=qs, based=True)
    return out


def decompose(fits: Mapping[str, BlockFit], blocks: Mapping[str, CurvatureBlock],
              ranks: Ranks, dtype: torch.dtype, device: torch.device) -> None:
    """The fits' sums over the ranks, then their bases, each computed on its placed rank.

    Raises:
        ValueError: A block saw no data in the factor pass.
    """
    sums: list[torch.Tensor] = []
    counts: list[int] = []
    for name, f in fits.items():
        block = blocks[name]
        for keep, side, attr in zip(summed_sides(block), (Side.A, Side.G), ("a_sum", "s_sum"),
                                    strict=True):
            if not keep:
                continue
            if getattr(f, attr) is None:  # no data on this rank: zeros to sum
                n = block.dims[0 if side is Side.A else 1]
                stack = len(block.call_sites()) if combines(block) else block.groups
                shape = (stack, n) if block.is_diagonal(side) else (stack, n, n)
                setattr(f, attr, torch.zeros(shape, dtype=dtype, device=device))
            sums.append(getattr(f, attr))
            counts.append(f.rows)
    totals = iter(ranks.summed(sums, counts))
    for name, f in fits.items():
        keep_a, keep_s = summed_sides(blocks[name])
        if keep_a:
            f.a_sum, f.rows = next(totals)
        if keep_s:
            f.s_sum, f.rows = next(totals)
        if (keep_a or keep_s) and f.rows == 0:
            raise ValueError(f"layer {name!r} saw no data in the factor pass (is it "
                             "used by the model's forward?)")
    wanted: dict[tuple[str, Side], Callable[[], torch.Tensor]] = {}
    shapes: dict[tuple[str, Side], tuple[int, ...]] = {}
    for name, f in fits.items():
        block = blocks[name]
        a, s = (None if t is None else t / f.rows for t in (f.a_sum, f.s_sum))
        if combines(block):  # a tied weight's uses, combined once over everything
            a, s = block.combine(a, s)
        dense = dense_sides(block)
        for side, mean, n, has in ((Side.A, a, block.dims[0], dense[0]),
                                   (Side.G, s, block.dims[1], dense[1])):
            if mean is not None and has:  # a diagonal side's basis is the identity
                wanted[name, side] = partial(basis, mean)
                shapes[name, side] = (block.groups, n, n)
    bases = ranks.bases(wanted, shapes, dtype, device)
    for name, f in fits.items():
        f.qa, f.qs, f.based = bases.get((name, Side.A)), bases.get((name, Side.G)), True
