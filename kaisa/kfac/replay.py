"""Replaying a training forward pass without changing the model.

:class:`kaisa.KFAC` linearises the model with forward-mode AD (``torch.func.jvp``) over a
second forward pass of the closure. :func:`replayed` makes that pass compute the same
function as the training forward and leave no trace:

* the random number generators are set to their state before the training forward
  (same dropout masks), and restored afterwards (the training stream goes on untouched);
* module buffers (BatchNorm running statistics and counts) are restored afterwards;
* attention runs on PyTorch's math kernel of ``F.scaled_dot_product_attention``, the one
  with forward-mode derivatives (the fused CPU/CUDA kernels have none);
* a model FSDP2 shards is resharded afterwards (:func:`kaisa.distributed.fsdp_tangents.reshard`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kaisa.distributed.fsdp_tangents import reshard

__all__ = ["RandomState", "replayed"]


@dataclass(frozen=True)
class RandomState:
    """The CPU generator's state and, when CUDA is initialised, every device's."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RandomState:
        """The current state."""
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if initialized else None
        return cls(torch.get_rng_state(), cuda)


@contextmanager
def replayed(model: nn.Module, state: RandomState) -> Iterator[None]:
    """A forward pass of ``model`` in the block replays the one started at ``state``.

    Args:
        model: The model (its buffers are restored on exit).
        state: The generators' state before the forward pass to replay.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = list(range(len(state.cuda))) if state.cuda is not None else []
    with torch.random.fork_rng(devices=devices), sdpa_kernel(SDPBackend.MATH):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state_all(state.cuda)
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            reshard(model)  # FSDP2 leaves the root unsharded after a no-grad forward
