"""A product as a DCP ``Stateful``, for a user's own ``dcp.save``/``dcp.load`` dict.

``torch.distributed.checkpoint`` (DCP) calls ``state_dict()`` on every ``Stateful`` value
of the dict it saves, and on loading calls ``state_dict()`` for the buffers to read into,
then ``load_state_dict()`` with what it read. Two of its rules shape a K-FAC state:

* DCP writes a key once: a plain tensor that several ranks give under the same key is
  taken to be replicated and saved from one of them. A product's state is not: each rank
  holds its own decompositions (MEM-OPT, HYBRID-OPT) and :class:`~kaisa.EKFAC`'s row
  generator is seeded per rank. So each rank's state is kept under its own key,
  ``<entry>.rank<r>``.
* The buffers must exist before anything is read, and a fresh product has no factors
  yet. So a rank's state is one serialised value (bytes, which DCP reads whole), not a
  tensor per entry.

:class:`KFACStateful` wraps any product (each one's ``state_dict()``/``load_state_dict()``
pair, the product's own checks included): a resume is bit for bit at the same world size.
To change the world size, or under FSDP2, use :func:`kaisa.checkpoint.save` and
:func:`kaisa.checkpoint.load`, which key every tensor by what it is.

Usage (a :class:`~kaisa.KFACPreconditioner` with a torch optimizer)::

    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, sgd),
             "kfac": kaisa.checkpoint.KFACStateful(product=pre)}
    dcp.save(state, checkpoint_id=path)

:class:`~kaisa.EKFAC` and :class:`~kaisa.KFAC` are the optimizer: their
``KFACStateful`` holds their torch state too, and takes the ``'optim'`` entry's place.
"""

from __future__ import annotations

import io
import json
from typing import Any, Protocol

import torch

from kaisa.utils.ranks import rank, world_size

__all__ = ["KFACStateful", "StateDictProduct"]


class StateDictProduct(Protocol):
    """A product's own checkpoint pair (each of the three has it)."""

    def state_dict(self) -> dict[str, Any]:
        """The product's state on this rank."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output, checked whole first."""
        ...


class KFACStateful:
    """A product as a DCP ``Stateful``: one serialised state per rank, and a shared header.

    Args:
        product: A :class:`~kaisa.KFACPreconditioner`, :class:`~kaisa.EKFAC` or
            :class:`~kaisa.KFAC`.
    """

    def __init__(self, *, product: StateDictProduct) -> None:
        self.product = product

    def state_dict(self) -> dict[str, Any]:
        """The header (``'meta'``, the same on every rank) and this rank's serialised state.

        Returns:
            ``{'meta': JSON, 'rank<r>': bytes}`` (``r``: this rank; the tensors copied).
        """
        buffer = io.BytesIO()
        torch.save(self.product.state_dict(), buffer)
        return {"meta": self._meta(), f"rank{rank()}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores this rank's state with the product's ``load_state_dict``.

        Raises:
            ValueError: If the checkpoint is of another product or world size, or holds
                no state for this rank, or the product refuses it; nothing is loaded then.
        """
        meta, mine = state_dict.get("meta"), self._meta()
        if meta != mine:
            raise ValueError(f"the checkpoint's K-FAC state was saved by {meta!r}, this is "
                             f"{mine!r} (to change the world size use kaisa.checkpoint.save "
                             "and load)")
        blob = state_dict.get(f"rank{rank()}")
        if not isinstance(blob, bytes) or not blob:
            raise ValueError(f"the checkpoint holds no K-FAC state of rank {rank()}")
        try:
            saved = torch.load(io.BytesIO(blob), weights_only=True)
        except (RuntimeError, ValueError, EOFError) as err:
            raise ValueError(f"the checkpoint's K-FAC state of rank {rank()} does not "
                             f"load ({err})") from None
        if not isinstance(saved, dict):
            raise ValueError(f"the checkpoint's K-FAC state of rank {rank()} is a "
                             f"{type(saved).__name__}, not a state dict")
        self.product.load_state_dict(saved)

    def _meta(self) -> str:
        return json.dumps({"product": type(self.product).__name__, "world_size": world_size()})
