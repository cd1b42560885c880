"""The memory model's step term: what ``step()`` holds at its peak besides the factors.

A factor step's largest memory is inside ``KFACPreconditioner.step()``, not after its
backward pass: the preconditioned gradients of every block exist at once before they are
written back. :func:`step_buffer_numel` counts them per rank from the path each layer takes
(read from the code, checked by ``bench/distributed/factor_memory.py``, which measures the
peak inside ``step()``); the constants are the gradient-sized tensors each path keeps alive
at its peak, so a change of the write-back (:mod:`kaisa.core.clipping`) is one number here.

* ``grouped`` (:mod:`kaisa.core.grouped`: the rank preconditions the layer and sends it to
  no one, dense blocks, a batched method): while ``kaisa.core.clipping._grouped_final``
  sums the KL products, every group's gradient stack, preconditioned stack and KL
  products live (:data:`GROUPED_COPIES`; the scaling and the choice are then computed in
  the preconditioned stacks, so without a KL clip two, :data:`GROUPED_COPIES_UNCLIPPED`).
* ``local`` and ``broadcast`` (the per-block path, ``DistributedEngine.transform``): the
  preconditioned gradient, or the broadcast buffer a worker copies it into and a receiver
  receives into (one element more, the validity flag), and the ``where`` output of
  ``guarded_directions`` (computed in the buffer when ``step()`` writes it back); while the
  broadcasts are in flight the buffer's packed bucket copy (:data:`PER_BLOCK_COPIES`).
* ``sharded`` (FSDP2, ``ShardedBlocks.transform``, one block at a time): the rank's rows of
  the gradient and of the direction (the ``where`` is computed in the direction;
  :data:`SHARDED_COPIES` times the rank's share).

On top, one block's transient (its preconditioned gradient before the copy into the
broadcast buffer, or its scaled direction): the largest per-block or sharded layer.

No batch factor is folded in ``step()`` (under FSDP2 the ranks that hold a block fold its
averaged batch factors as they arrive, in the backward pass), except a tied weight's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["GROUPED_COPIES", "GROUPED_COPIES_UNCLIPPED", "PER_BLOCK_COPIES", "SHARDED_COPIES",
           "StepLayer", "step_buffer_numel"]

#: Gradient-sized tensors per grouped layer at the peak of ``step()``, with a KL clip:
#: gradient stack, preconditioned stack, KL products.
GROUPED_COPIES = 3
#: The same without a KL clip: gradient stack, preconditioned stack.
GROUPED_COPIES_UNCLIPPED = 2
#: Per-block path: the preconditioned gradient (or broadcast buffer) and one more.
PER_BLOCK_COPIES = 2
#: FSDP2: the rank's rows of gradient and direction.
SHARDED_COPIES = 2

#: How ``step()`` preconditions a layer on a rank (see the module docstring).
StepPath = Literal["grouped", "local", "broadcast", "sharded"]


@dataclass(frozen=True)
class StepLayer:
    """One layer as one rank's ``step()`` handles it.

    Attributes:
        numel: Elements of the layer's gradient matrix (all its Kronecker blocks).
        path: How the rank preconditions it.
    """

    numel: int
    path: StepPath


def step_buffer_numel(layers: Sequence[StepLayer], *, world: int,
                      kl_clip: bool = True) -> int:
    """Elements one rank's ``step()`` holds at its peak for the preconditioned gradients.

    Args:
        layers: The layers the rank takes part in, in model order.
        world: Ranks (the FSDP2 share of a sharded layer is ``1/world`` of its rows).
        kl_clip: Whether a KL clip is set (the grouped path keeps the KL products too).

    Returns:
        Number of elements (of the gradients' dtype).
    """
    grouped = sum(la.numel for la in layers if la.path == "grouped")
    per_block = [la for la in layers if la.path in ("local", "broadcast")]
    sharded = [la for la in layers if la.path == "sharded"]
    flags = sum(2 for la in per_block if la.path == "broadcast")  # buffer and bucket copy
    copies = GROUPED_COPIES if kl_clip else GROUPED_COPIES_UNCLIPPED
    transient = max((la.numel for la in (*per_block, *sharded)), default=0)
    return (copies * grouped + PER_BLOCK_COPIES * sum(la.numel for la in per_block) + flags
            + SHARDED_COPIES * sum(-(-la.numel // world) for la in sharded) + transient)
