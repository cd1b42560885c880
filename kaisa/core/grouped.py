"""Blocks of one shape preconditioned as one batch, in a few operator calls per step.

A step that preconditions every block on its own dispatches a few dozen operator calls a
block (its gradient matrix, the rotations, finite checks, the KL-clip inner product, the
write-back); on a GPU each is a kernel launch, and a step is launch-bound. Here the blocks
whose gradient matrices have one shape, dtype and device and whose stored decompositions
have one layout form a *group* (:class:`BlockGroup`):

* their gradients are stacked in one call, and the method preconditions the stack in one
  call (:attr:`~kaisa.methods.SecondOrderMethod.batched`: its ``precondition`` treats the
  leading dimension as independent blocks);
* their decompositions live in one stacked tensor per entry, and each block's
  ``decomposition`` holds a view of its rows (adopted once after every decomposition
  round: the memory stays one copy, and stacking costs nothing on a step that does not
  decompose);
* the non-finite guard, the KL clip and the write-back
  (:func:`kaisa.core.clipping.write_directions`) run on the stacks, with multi-tensor
  (``torch._foreach_*``) calls across groups.

The results equal the per-block path's, but for the order of floating-point sums (the KL
clip's inner products). A block is grouped only where nothing else needs it alone: a plain
gradient layout (every parameter has a ``.grad``, all its rows; a weight stored
transposed, ``(in, out)``, is stacked as its transpose's view), dense factors, a method
that batches, and a rank that preconditions it and sends it to no one; the rest take the
per-block path (:meth:`kaisa.core.curvature.KFACCurvature.precondition`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.distributed import DistributedEngine
from kaisa.methods import SecondOrderMethod

__all__ = ["BlockGroup", "GroupRule", "GroupedDirections", "eligible", "group_blocks", "run_groups"]

#: What makes blocks stackable: the weight's shape and layout (transposed or not), bias or
#: not, the groups, the grads' dtype and device, and each stored entry's (key, shape, dtype).
_Signature = tuple[object, ...]


@dataclass
class BlockGroup:
    """Blocks of one gradient shape and decomposition layout, in model order.

    Attributes:
        blocks: The blocks (at least one).
        keys: The decomposition entries the method reads, stacked in :attr:`stacked`.
        stacked: ``key -> (blocks * groups, ...)`` tensor whose rows the blocks' entries view.
    """

    blocks: list[CurvatureBlock]
    keys: tuple[str, ...]
    stacked: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def bias(self) -> bool:
        """Whether the blocks have a bias (its gradient is the matrix's last column)."""
        return self.blocks[0].bias is not None

    def adopt(self) -> None:
        """Makes every block's entry a view of :attr:`stacked` (restacks what changed).

        A decomposition round installs new tensors in the blocks' dicts; the first step
        after it copies them into one stacked tensor per entry (one call each) and hands
        the blocks views of it, so the old tensors are freed. Identity checks only, on a
        step where nothing changed.
        """
        groups = self.blocks[0].groups
        for key in self.keys:
            stack = self.stacked.get(key)
            if stack is not None and all(
                b.decomposition[key] is v
                for b, v in zip(self.blocks, self._views(key), strict=True)
            ):
                continue
            parts = [b.decomposition[key] for b in self.blocks]
            stack = parts[0] if len(parts) == 1 else torch.cat(parts)
            self.stacked[key] = stack
            views = [stack] if len(parts) == 1 else list(torch.split(stack, groups))
            for block, view in zip(self.blocks, views, strict=True):
                block.decomposition[key] = view
            self._held[key] = views

    def release(self) -> None:
        """Hands the blocks views of entries a computation created in :attr:`stacked`.

        A product's rule may create state on its first step (EKFAC's moments): it lands in
        the stacked dict, and each block gets its rows, as :meth:`adopt` would give them.
        """
        groups = self.blocks[0].groups
        for key in [k for k in self.stacked if k not in self.keys]:
            stack = self.stacked[key]
            views = [stack] if len(self.blocks) == 1 else list(torch.split(stack, groups))
            for block, view in zip(self.blocks, views, strict=True):
                block.decomposition[key] = view
            self._held[key] = views
            self.keys = (*self.keys, key)

    def _views(self, key: str) -> Sequence[torch.Tensor]:
        return self._held.get(key, ())

    def __post_init__(self) -> None:
        self._held: dict[str, list[torch.Tensor]] = {}

    def gradients(self, grads: Mapping[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """The blocks' gradient matrices stacked: ``(blocks * groups, out / groups, n)``.

        Written for few operator calls: no reshape where the stack has the shape already.

        Args:
            grads: ``parameter -> gradient`` to stack; by default the parameters' ``.grad``.
        """
        first, k = self.blocks[0], len(self.blocks)
        transposed = first.transposed
        out, groups = first.weight.shape[1 if transposed else 0], first.groups
        weights = _grads((b.weight for b in self.blocks), grads)
        if not self.bias:
            w = torch.stack(weights) if k > 1 else weights[0]
            if transposed:  # (in, out) weights: a view of the transpose
                w = w.transpose(-2, -1)
            shape = (k * groups, out // groups, w.numel() // (k * out))
            return w if w.shape == shape else w.reshape(shape)
        biases = _grads((b.parameters()[1] for b in self.blocks), grads)
        if k == 1:  # reshape: a view where the layout allows (channels-last grads do not)
            w = weights[0].t() if transposed else weights[0]
            parts = [w.reshape(1, out, -1), biases[0].reshape(1, out, 1)]
        else:
            w = torch.stack(weights)
            w = w.transpose(1, 2) if transposed else w.reshape(k, out, -1)
            parts = [w, torch.stack(biases).unsqueeze(2)]
        matrix = torch.cat(parts, dim=2)
        return matrix if groups == 1 else matrix.view(k * groups, out // groups, -1)

    def destinations(self, direction: torch.Tensor, *, params: bool = False,
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(targets, parts)``: where each part of a stack of gradient matrices goes.

        The targets are the ``.grad`` tensors (the parameters with ``params``); the parts
        are views of ``direction`` in their shapes.
        """
        blocks, first = self.blocks, self.blocks[0]
        k, shape = len(blocks), first.weight.shape
        dst = [b.weight for b in blocks] if params else _grads(b.weight for b in blocks)
        if first.transposed:  # (in, out) weights: views of the transposed matrices
            matrix = direction.reshape(k, shape[1], -1)
            weights = (matrix[:, :, :-1] if self.bias else matrix).transpose(1, 2)
            if not self.bias:
                return dst, list(weights.unbind())
            biases = [b.parameters()[1] for b in blocks]
            dst += biases if params else _grads(biases)
            return dst, [*weights.unbind(), *matrix[:, :, -1].unbind()]
        if not self.bias:
            if k == 1:
                src = [direction.view(shape)]
            else:
                full = (k, *shape)
                src = list((direction if direction.shape == full else direction.view(full))
                           .unbind())
            return dst, src
        matrix = direction if first.groups == 1 else direction.view(k, shape[0], -1)
        weights = matrix[:, :, :-1]
        if len(shape) > 2:
            weights = weights.view(k, *shape)
        biases = [b.parameters()[1] for b in blocks]
        dst += biases if params else _grads(biases)
        return dst, [*weights.unbind(), *matrix[:, :, -1].unbind()]


@dataclass(frozen=True)
class GroupedDirections:
    """One step's preconditioned gradients: stacked per group, and the rest per block.

    Attributes:
        groups: ``(group, gradient stack, direction stack)`` per group.
        single: The per-block entries, in model order.
    """

    groups: list[tuple[BlockGroup, torch.Tensor, torch.Tensor]]
    single: list[Preconditioned]


#: A group's computation: ``(group, gradient stack) -> result stack`` (reads and may update
#: ``group.stacked``).
GroupRule = Callable[[BlockGroup, torch.Tensor], torch.Tensor | None]


def run_groups(
    blocks: Mapping[str, CurvatureBlock], engine: DistributedEngine, method: SecondOrderMethod,
    cache: dict[tuple[object, ...], list[BlockGroup]], rule: GroupRule,
    uniform: Callable[[BlockGroup], bool] | None = None,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[tuple[BlockGroup, torch.Tensor, torch.Tensor]], set[str]]:
    """``rule`` on the stacks of every group of the blocks this rank may stack.

    Args:
        blocks: The core's blocks by name.
        engine: The engine (which blocks this rank preconditions and sends to no one).
        method: The second-order method.
        cache: The core's groups by layout (:func:`group_blocks`).
        rule: The computation of a group.
        uniform: Whether a group's blocks may share one call of ``rule`` this step (e.g.
            their Adam scalars agree); a group that may not takes the per-block path.
        grads: ``parameter -> gradient`` to stack instead of the ``.grad`` (a block with a
            parameter not in it takes the per-block path).

    Returns:
        ``(group, gradient stack, result)`` per group, and the names of their blocks (the
        caller runs the per-block path for the others).
    """
    if not method.batched or any(b.sharded() for b in blocks.values()):
        return [], set()  # FSDP2 preconditions block by block
    shared = _shared_parameters(blocks.values())
    local = [b for name, b in blocks.items()
             if engine.local_worker(name) and eligible(b, method)
             and not shared.intersection(map(id, b.parameters()))
             and (grads is None or all(p in grads for p in b.parameters()))]
    out: list[tuple[BlockGroup, torch.Tensor, torch.Tensor]] = []
    done: set[str] = set()
    for group in group_blocks(local, method, cache):
        if uniform is not None and not uniform(group):
            continue
        group.adopt()
        grad = group.gradients(grads)
        result = rule(group, grad)
        if result is None:  # the rule had nothing for the group: the per-block path
            continue
        group.release()
        out.append((group, grad, result))
        done.update(b.name for b in group.blocks)
    return out, done


def _shared_parameters(blocks: Iterable[CurvatureBlock]) -> set[int]:
    """Ids of the parameters more than one block covers (their writes must stay ordered)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for block in blocks:
        for p in block.parameters():
            (shared if id(p) in seen else seen).add(id(p))
    return shared


def group_blocks(
    blocks: Sequence[CurvatureBlock], method: SecondOrderMethod,
    cache: dict[tuple[object, ...], list[BlockGroup]],
) -> list[BlockGroup]:
    """The groups of ``blocks`` (all eligible, see the module docstring), in model order.

    Args:
        blocks: Blocks ready to precondition, with every gradient present.
        method: The method (its stored entries are stacked).
        cache: Groups by layout, kept by the caller: the same blocks with the same layout
            get the same :class:`BlockGroup` objects (and their stacked entries) back.

    Returns:
        The groups, ordered by their first block.
    """
    signatures = [_signature(b, method) for b in blocks]
    key = tuple(zip((id(b) for b in blocks), signatures, strict=True))
    cached = cache.get(key)
    if cached is not None:
        return cached
    by_sig: dict[_Signature, list[CurvatureBlock]] = {}
    for block, sig in zip(blocks, signatures, strict=True):
        by_sig.setdefault(sig, []).append(block)
    groups = [BlockGroup(members, _keys(members[0], method)) for members in by_sig.values()]
    cache.clear()  # one layout at a time: a changed layout drops the old stacks
    cache[key] = groups
    return groups


def _grads(params: Iterable[torch.Tensor],
           given: Mapping[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
    grads = [p.grad if given is None else given[p] for p in params]
    assert all(g is not None for g in grads)  # eligible blocks have every gradient
    return grads  # type: ignore[return-value]


def _keys(block: CurvatureBlock, method: SecondOrderMethod) -> tuple[str, ...]:
    return tuple(k for k in method.state_keys if k in block.decomposition)


def _signature(block: CurvatureBlock, method: SecondOrderMethod) -> _Signature:
    grad = block.weight.grad
    assert grad is not None
    state = block.decomposition
    entries = tuple((k, tuple(state[k].shape[1:]), state[k].dtype, state[k].device)
                    for k in _keys(block, method))
    return (tuple(block.weight.shape), block.transposed, block.bias is not None, block.groups,
            grad.dtype, grad.device, entries)


def eligible(block: CurvatureBlock, method: SecondOrderMethod) -> bool:
    """Whether ``block`` can be grouped (the rank's part is checked by the caller)."""
    kind = type(block)
    plain = block.transposed or (kind.gradient_matrix is CurvatureBlock.gradient_matrix
                                 and kind.split is CurvatureBlock.split)
    if (block.diagonal or block.diagonal_sides or block.rows is not None or block.sharded()
            or not plain or kind.write_grad is not CurvatureBlock.write_grad):
        return False
    params = block.parameters()
    if any(p.grad is None or p.grad.is_sparse or p.grad.dtype != params[0].grad.dtype  # type: ignore[union-attr]
           for p in params):
        return False
    return method.batched and method.ready(block.decomposition)
