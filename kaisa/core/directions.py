"""The direction phase of the curvature core: preconditioning and product rules per block.

:class:`DirectionPhases` is a part of :class:`~kaisa.core.curvature.KFACCurvature`: the
gradients of the registered blocks through the second-order method
(:meth:`~DirectionPhases.precondition`, stacked by shape with
:meth:`~DirectionPhases.precondition_grouped`) or through a product's own rule
(:meth:`~DirectionPhases.transform`, :meth:`~DirectionPhases.transform_grouped`: EKFAC's
Adam step, KFACMuon's orthogonalised step), each block on its gradient workers and sent
where it has receivers. Nothing here writes a gradient or a parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.core.grouped import BlockGroup, GroupedDirections, GroupRule, run_groups
from kaisa.distributed import DistributedEngine
from kaisa.distributed.engine import BlockRule
from kaisa.distributed.fsdp import rounds
from kaisa.methods import SecondOrderMethod
from kaisa.utils.profiling import timed

__all__ = ["DirectionPhases"]


class DirectionPhases:
    """Preconditioning and product rules of :class:`~kaisa.core.curvature.KFACCurvature`."""

    _blocks: dict[str, CurvatureBlock]
    _engine: DistributedEngine
    _method: SecondOrderMethod
    _groups: dict[tuple[object, ...], list[BlockGroup]]
    _timings: dict[str, float]

    def precondition(
        self, damping: float, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> list[Preconditioned]:
        """Every block's preconditioned gradient matrix; writes nothing.

        Args:
            damping: The damping of the method's precondition step.
            grads: ``parameter -> gradient`` to precondition; by default the
                parameters' ``.grad`` (a block whose weight has none is left out).

        Returns:
            One entry per block with a gradient and a result, in model order.
        """
        with timed(self._timings, "preconditioning"):
            return self._precondition(damping, grads)

    def precondition_grouped(
        self, damping: float, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> GroupedDirections:
        """:meth:`precondition`, blocks of one shape stacked.

        The blocks :mod:`kaisa.core.grouped` can stack (this rank preconditions them and
        sends them to no one; plain layouts, dense factors) come back as stacks, one
        method call per group; the others as :meth:`precondition` gives them. Write them
        with :func:`kaisa.core.clipping.write_directions`, or read them per parameter with
        :func:`kaisa.core.clipping.grouped_parameter_directions`. Writes nothing.

        Args:
            damping: The damping of the method's precondition step.
            grads: As for :meth:`precondition` (by default the parameters' ``.grad``).
        """
        method = self._method
        with timed(self._timings, "preconditioning"):
            groups, done = run_groups(
                self._blocks, self._engine, method, self._groups,
                lambda group, grad: method.precondition(group.stacked, grad, damping),
                grads=grads)
            return GroupedDirections(groups, self._precondition(damping, grads, skip=done))

    def transform_grouped(
        self, rule: BlockRule, group_rule: GroupRule,
        uniform: Callable[[BlockGroup], bool] | None = None,
    ) -> GroupedDirections:
        """:meth:`transform` of the parameters' ``.grad``, blocks of one shape stacked.

        Args:
            rule: The per-block computation (as for :meth:`transform`).
            group_rule: The same on a group's stacks: ``group_rule(group, gradient stack)``
                with the stacked entries in ``group.stacked`` (those it creates are handed
                to the blocks).
            uniform: Whether a group's blocks may share one call this step; a group that
                may not takes ``rule`` block by block.
        """
        with timed(self._timings, "preconditioning"):
            groups, done = run_groups(self._blocks, self._engine, self._method, self._groups,
                                      group_rule, uniform)
            return GroupedDirections(groups, self._transform(rule, None, skip=done))

    def _precondition(
        self, damping: float, grads: Mapping[torch.Tensor, torch.Tensor] | None,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> list[Preconditioned]:
        out: list[Preconditioned] = []
        rule = self._engine.preconditioning(damping)
        for names in rounds(self._blocks):  # all at once, or one block at a time (FSDP2)
            matrices, local = {}, {}
            names = [name for name in names if name not in skip]
            for name in names:
                block = self._blocks[name]
                if block.sharded():  # its workers precondition it, each rank gets its rows
                    out += self._engine.sharded(block, rule if not block.diagonal else (
                        lambda b, m: b.precondition_diagonal(m, damping)), grads)
                    continue
                matrix = block.gradient_matrix(_own(block, grads))
                if matrix is None:
                    continue
                if not block.diagonal:
                    matrices[name] = matrix
                elif (direction := block.precondition_diagonal(matrix, damping)) is not None:
                    local[name] = Preconditioned(block, matrix, direction)
            kron = {e.block.name: e for e in self._engine.transform(matrices, rule)}
            out += [kron.get(name) or local[name] for name in names
                    if name in kron or name in local]
        return out

    def transform(
        self, rule: BlockRule, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> list[Preconditioned]:
        """Every Kronecker block's gradient matrix through a product's ``rule``; writes nothing.

        The block's gradient workers run ``rule(block, matrix)``, which may keep state in
        ``block.decomposition`` (kept, checkpointed and gathered with the decompositions);
        the other ranks receive the result
        (:meth:`~kaisa.distributed.DistributedEngine.transform`). Diagonal blocks are left out.

        Args:
            rule: The per-block computation.
            grads: As for :meth:`precondition`.

        Returns:
            One entry per Kronecker block with a gradient and a result, in model order.
        """
        with timed(self._timings, "preconditioning"):
            return self._transform(rule, grads)

    def _transform(
        self, rule: BlockRule, grads: Mapping[torch.Tensor, torch.Tensor] | None,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> list[Preconditioned]:
        out: list[Preconditioned] = []
        for names in rounds(self._blocks):
            matrices = {}
            for name in names:
                block = self._blocks[name]
                if block.diagonal or name in skip:
                    continue
                if block.sharded():
                    out += self._engine.sharded(block, rule, grads)
                elif (matrix := block.gradient_matrix(_own(block, grads))) is not None:
                    matrices[name] = matrix
            out += self._engine.transform(matrices, rule)
        return out


def _own(block: CurvatureBlock, grads: Mapping[torch.Tensor, torch.Tensor] | None,
         ) -> list[torch.Tensor | None] | None:
    """The block's gradients from ``grads``, or ``None`` for its parameters' ``.grad``."""
    return None if grads is None else [grads.get(p) for p in block.parameters()]
