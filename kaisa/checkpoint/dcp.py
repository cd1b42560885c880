"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds three parts, keyed by names that do not depend on the world size:

* ``'model'``: :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`
  (under FSDP2 each rank writes its shards of the ``DTensor`` parameters);
* ``'optim'``: the optimizer's state keyed by parameter name, as
  :func:`~torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gives it
  (for :class:`kaisa.EKFAC`, its AdamW state, and for :class:`kaisa.KFAC`, its
  per-parameter ``velocity``, converted the same way by :mod:`kaisa.checkpoint.optim`;
  KFAC's first-order optimizer's state, for the parameters no block covers, under
  ``'optim.first_order'`` in the same layout);
* ``'kfac'``: the K-FAC state. ``'kfac.meta'`` (every rank the same, written once) holds
  the product, its blocks (name, kind, dims), the step counters and the schedules'
  numbers (and :class:`kaisa.KFAC`'s damping); ``'kfac.generator'`` KFAC's Monte-Carlo
  sampler's state (the same on every rank, written by rank 0);
  ``'kfac.generators.<rank>'`` :class:`kaisa.EKFAC`'s row generator of each rank (seeded
  ``seed + rank``; a rank with none saved, at another world size, keeps its own);
  ``'kfac.layers.<block>.<entry>'`` the tensors. Each rank contributes only
  what the placement makes it the owner of: a block's ``A`` factor (and its skip count)
  by the rank that decomposes it, ``G`` likewise, the decompositions (eigenbases,
  eigenvalues or inverses, and :class:`~kaisa.EKFAC`'s moments) by the block's first
  gradient worker, so DCP writes every key once and no rank gathers anything.

Loading reads the checkpoint's metadata, checks the K-FAC part against the model's blocks
(a checkpoint of another model raises ``ValueError`` before anything is changed), and has
each rank read only what it needs under the *current* placement: the running factors it
keeps (under FSDP2 those of the blocks it decomposes, with DDP every one) and the
decompositions of the blocks it is a gradient worker of. The placement is recomputed at
the current world size, so a checkpoint loads at any world size.

Derived state is saved, not recomputed: the decompositions were computed from the factors
of the last decomposition step, which the running factors have since moved on from, so
recomputing them would change the next steps. Saving them makes resume bit-exact at the
same world size (and at another one the run continues as it would have at that world size,
up to the order of float sums).

Usage::

    kaisa.checkpoint.save("ckpt/step100", model, optimizer, preconditioner)
    ...
    kaisa.checkpoint.load("ckpt/step100", model, optimizer, preconditioner)

Every rank calls both (collectives). With :class:`kaisa.EKFAC` or :class:`kaisa.KFAC`
pass it as the optimizer and no preconditioner. A :class:`kaisa.KFAC` checkpoint is checked
whole (:meth:`kaisa.KFAC.load_state_dict`) before the model is read, so a refused one
changes nothing either. ``docs/distributed.md``, "Checkpoints (DCP)".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from kaisa.checkpoint import optim as checkpoint_optim
from kaisa.core.checkpoint import KFACCheckpointable, KFACState, check_generator_state
from kaisa.core.curvature import KFACCurvature
from kaisa.utils.finite import all_finite

__all__ = ["FORMAT", "get_state_dict", "kfac_state_dict", "load", "save"]

#: Version of the ``'kfac'`` part's layout.
FORMAT = 1

#: What drives the curvature: a preconditioner, or EKFAC or KFAC (optimizers).
Owner: TypeAlias = KFACCheckpointable

_PathLike: TypeAlias = str | os.PathLike[str]

if TYPE_CHECKING:  # each product implements both protocols (mypy checks it here)
    from kaisa.checkpoint.stateful import StateDictProduct
    from kaisa.ekfac.optimizer import EKFAC
    from kaisa.kfac.optimizer import KFAC
    from kaisa.preconditioner.preconditioner import KFACPreconditioner

    def _conforms(a: KFACPreconditioner, b: EKFAC, c: KFAC
                  ) -> tuple[Owner, Owner, Owner, StateDictProduct, StateDictProduct,
                             StateDictProduct]:
        return a, b, c, a, b, c

#: A block's factor entries and the side whose decomposing rank owns them.
_FACTOR_SIDE = {"A": "a", "skipped_a": "a", "G": "g", "skipped_g": "g"}


# ---------------------------------------------------------------------- the K-FAC part
def _owner(optimizer: torch.optim.Optimizer, preconditioner: object | None) -> Owner:
    """The object whose K-FAC state is checkpointed: ``preconditioner``, else ``optimizer``.

    Either must implement :class:`~kaisa.core.checkpoint.KFACCheckpointable`; a product
    that is itself the optimizer takes no preconditioner.
    """
    owner: object = optimizer if preconditioner is None else preconditioner
    if not all(callable(getattr(owner, m, None)) for m in _PROTOCOL) or (
        preconditioner is not None and callable(getattr(optimizer, "kfac_state_dict", None))
    ):
        raise ValueError(
            "kaisa.checkpoint needs a kaisa.KFACPreconditioner (with a torch optimizer), "
            "or a kaisa.EKFAC or a kaisa.KFAC optimizer (which keep their own curvature: "
            f"then no preconditioner), got preconditioner={type(preconditioner).__name__} "
            f"and optimizer={type(optimizer).__name__}"
        )
    return owner  # type: ignore[return-value]


#: The methods of the protocol.
_PROTOCOL = ("kfac_state_dict", "kfac_optimizers", "load_kfac_state_dict")


def _is_optimizer(owner: object, optimizer: object) -> bool:
    """Whether the product is the optimizer itself (EKFAC, KFAC), not a preconditioner."""
    return owner is optimizer


def _layer_list(core: KFACCurvature) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, str(b.kind), tuple(int(d) for d in b.dims)) for name, b in core.blocks.items()]


def _owners(core: KFACCurvature, index: int, name: str) -> dict[str, int]:
    """Which rank writes each of block ``name``'s entries: ``'a'``, ``'g'``, ``'decomposition'``.

    A Kronecker block's factors go with the ranks that decompose them, its decompositions
    with its first gradient worker; a diagonal block (every rank holds it) goes round-robin.
    """
    engine = core.engine
    placed = engine.placement.layers.get(name)
    if placed is None:
        rank = index % engine.world_size
        return {"a": rank, "g": rank, "decomposition": rank}
    return {"a": placed.a_rank, "g": placed.g_rank, "decomposition": placed.grad_workers[0]}


def kfac_state_dict(owner: Owner) -> dict[str, Any]:
    """The K-FAC part of a DCP checkpoint on this rank: what this rank owns (no collective).

    Args:
        owner: A :class:`~kaisa.KFACPreconditioner`, a :class:`~kaisa.EKFAC` or a
            :class:`~kaisa.KFAC` (any :class:`~kaisa.core.checkpoint.KFACCheckpointable`).

    Returns:
        ``{'meta': JSON, 'layers': {block: {entry: tensor}}}`` (``'meta'``: the product,
        its blocks, counters and schedules, a string so that DCP keeps it one entry);
        ``'layers'`` holds only the
        entries this rank owns (see the module docstring), the tensors themselves (not
        copies: save them before the next step). A product with a generator the same on
        every rank (:class:`~kaisa.KFAC`'s sampler) has rank 0 add ``'generator'``; one
        with a generator per rank (:class:`~kaisa.EKFAC`'s rows) has each rank add
        ``'generators': {rank: state}``.
    """
    core = owner.curvature
    rank = core.engine.rank
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for index, (name, block) in enumerate(core.blocks.items()):
        owners = _owners(core, index, name)
        layers[name] = {
            key: t for key, t in block.state_dict().items()
            if isinstance(t, torch.Tensor)
            and owners[_FACTOR_SIDE.get(key, "decomposition")] == rank
        }
    state = owner.kfac_state_dict()
    meta = {"format": FORMAT, "product": type(owner).__name__, "layers": _layer_list(core),
            "state": state.counters}
    out: dict[str, Any] = {"meta": json.dumps(meta), "layers": layers}
    if state.generator is not None and state.generator_per_rank:
        out["generators"] = {str(rank): state.generator}
    elif state.generator is not None and rank == 0:  # the same on every rank: one copy
        out["generator"] = state.generator
    return out


def _check_meta(owner: Owner, meta: object) -> dict[str, Any]:
    """The saved counters, once ``meta`` (JSON) is known to describe ``owner``'s blocks."""
    try:
        meta = json.loads(meta) if isinstance(meta, str) else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise ValueError(f"the checkpoint's kfac.meta is not a kaisa checkpoint of format {FORMAT}")
    product = type(owner).__name__
    if meta.get("product") != product:
        raise ValueError(f"the checkpoint holds the state of a kaisa.{meta.get('product')}, "
                         f"not of a kaisa.{product}")
    mine = {n: (k, d) for n, k, d in _layer_list(owner.curvature)}
    try:
        theirs = {str(n): (str(k), tuple(int(d) for d in dims)) for n, k, dims in meta["layers"]}
    except (KeyError, TypeError, ValueError):
        raise ValueError("the checkpoint's kfac.meta has no valid 'layers'") from None
    if theirs != mine:
        changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise ValueError(
            "the checkpoint's K-FAC blocks do not match this model's (a checkpoint of another "
            f"model?): missing {sorted(set(mine) - set(theirs))}, unexpected "
            f"{sorted(set(theirs) - set(mine))}, of another kind or size "
            f"{[(n, mine[n], theirs[n]) for n in changed]} (here, saved)"
        )
    state = meta.get("state")
    if not isinstance(state, Mapping):
        raise ValueError("the checkpoint's kfac.meta has no 'state'")
    return dict(state)


def _layers_template(core: KFACCurvature, saved: Mapping[str, STORAGE_TYPES]
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """Buffers for what this rank reads: the factors it keeps, its gradient-worker blocks' rest."""
    out = {}
    for name, block in core.blocks.items():
        worker, keeps = core.is_grad_worker(name), core.engine.holds_factors(name)
        out[name] = {
            key: torch.empty(md.size, dtype=md.properties.dtype, device=block.weight.device)
            for key, md in checkpoint_optim.entries(saved, f"kfac.layers.{name}.").items()
            if (keeps if key in _FACTOR_SIDE else worker)
        }
    return out


def _generator_template(owner: Owner, saved: Mapping[str, STORAGE_TYPES]) -> dict[str, Any]:
    """The generator entry this rank reads, if the checkpoint holds one for it."""
    key = (f"generators.{owner.curvature.engine.rank}"
           if owner.kfac_state_dict().generator_per_rank else "generator")
    md = saved.get(f"kfac.{key}")
    if not isinstance(md, TensorStorageMetadata):  # none (per rank: another world size): kept
        return {}
    buffer = torch.empty(md.size, dtype=md.properties.dtype)
    head, _, rank = key.partition(".")
    return {head: {rank: buffer}} if rank else {head: buffer}


# ---------------------------------------------------------------------- the optimizer part
def _optim(model: nn.Module, optimizer: torch.optim.Optimizer, owner: Owner) -> dict[str, Any]:
    """The ``'optim'`` part: the optimizer's state keyed by parameter name."""
    if not _is_optimizer(owner, optimizer):
        return get_optimizer_state_dict(model, optimizer)
    optim = checkpoint_optim.named(model, optimizer)
    for name, inner in owner.kfac_optimizers().items():
        if inner is not None:
            optim[name] = checkpoint_optim.named(model, inner)
    return optim


def _optimizers(checkpoint_id: _PathLike | None, storage_reader: StorageReader,
                model: nn.Module, optimizer: torch.optim.Optimizer, owner: Owner,
                saved: Mapping[str, STORAGE_TYPES]) -> dict[str, dict[str, Any]]:
    """Reads the ``'optim'`` part of a product that is the optimizer, checked finite.

    Returns ``{'self': its torch state, name: each driven optimizer's}``, indexed as
    ``load_state_dict`` takes them (a driven optimizer saved but absent here gets an
    empty state, which the product refuses).
    """
    optim = checkpoint_optim.template(model, optimizer, saved, "optim.")
    inner = owner.kfac_optimizers()
    present = {name for name in inner if any(k.startswith(f"optim.{name}.") for k in saved)}
    for name in present:
        if (rule := inner[name]) is not None:
            optim[name] = checkpoint_optim.template(model, rule, saved, f"optim.{name}.")
    dcp_load({"optim": optim}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    out = {"self": checkpoint_optim.indexed(model, optimizer, optim)}
    for name in present:
        rule = inner[name]
        out[name] = ({"state": {}, "param_groups": []} if rule is None
                     else checkpoint_optim.indexed(model, rule, optim[name]))
    # The one check that a rank makes on its shards alone, agreed before anything loads.
    floats = [(key, t) for v in optim["state"].values() for key, t in v.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
    local = not all(bool(all_finite(t)) for _, t in floats)
    if owner.curvature.any_rank(local):
        raise ValueError(f"the checkpoint's {type(owner).__name__} optimizer state "
                         f"({', '.join(sorted({key for key, _ in floats}))}) is not finite")
    return out


# ---------------------------------------------------------------------- public API
def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACCheckpointable | None = None,
) -> dict[str, Any]:
    """This rank's part of a checkpoint, ready for ``torch.distributed.checkpoint.save``.

    Args:
        model: The model (sharded by FSDP2, wrapped in DDP or plain).
        optimizer: The optimizer: a torch optimizer stepped after ``preconditioner``, a
            :class:`~kaisa.EKFAC` or a :class:`~kaisa.KFAC`.
        preconditioner: The :class:`~kaisa.KFACPreconditioner` (``None`` with EKFAC or
            KFAC).

    Returns:
        ``{'model': ..., 'optim': ..., 'kfac': ...}`` (the module docstring says what each
        holds). Every rank must call it (the model and optimizer parts are collectives
        under FSDP2).
    """
    owner = _owner(optimizer, preconditioner)
    return {"model": get_model_state_dict(model), "optim": _optim(model, optimizer, owner),
            "kfac": kfac_state_dict(owner)}


def save(
    checkpoint_id: _PathLike | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACCheckpointable | None = None, *,
    storage_writer: StorageWriter | None = None,
) -> None:
    """Saves :func:`get_state_dict` with ``torch.distributed.checkpoint.save`` (every rank).

    Args:
        checkpoint_id: The checkpoint's directory (or what ``storage_writer`` takes).
        model: As for :func:`get_state_dict`.
        optimizer: As for :func:`get_state_dict`.
        preconditioner: As for :func:`get_state_dict`.
        storage_writer: DCP's storage writer (default: a file system one).
    """
    dcp_save(get_state_dict(model, optimizer, preconditioner), checkpoint_id=checkpoint_id,
             storage_writer=storage_writer)


def load(
    checkpoint_id: _PathLike | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACCheckpointable | None = None, *,
    storage_reader: StorageReader | None = None,
) -> None:
    """Loads a :func:`save` checkpoint into freshly built objects, at any world size.

    Every rank calls it, after building the model (and ``fully_shard``), the optimizer and
    the preconditioner as for training. Each rank reads its shards of the model and the
    optimizer state, the running factors it keeps (under FSDP2: of the blocks it
    decomposes), and the decompositions of the blocks the current
    placement makes it a gradient worker of.

    Args:
        checkpoint_id: The checkpoint's directory (or what ``storage_reader`` takes).
        model: As for :func:`get_state_dict`.
        optimizer: As for :func:`get_state_dict`.
        preconditioner: As for :func:`get_state_dict`.
        storage_reader: DCP's storage reader (default: a file system one).

    Raises:
        ValueError: If the checkpoint has no K-FAC part, or one of another product or
            another set of blocks, or a malformed one; nothing is loaded then.
    """
    owner = _owner(optimizer, preconditioner)
    core = owner.curvature
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("give a checkpoint_id or a storage_reader")
        storage_reader = FileSystemReader(checkpoint_id)
    saved = storage_reader.read_metadata().state_dict_metadata
    if "kfac.meta" not in saved:
        raise ValueError(f"{checkpoint_id} has no kfac.meta entry: not a kaisa.checkpoint")
    # The K-FAC part first, into new buffers: checked before anything else is touched.
    kfac: dict[str, Any] = {"meta": None, "layers": _layers_template(core, saved),
                            **_generator_template(owner, saved)}
    dcp_load({"kfac": kfac}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    generator = kfac.get("generator", kfac.get("generators", {}).get(str(core.engine.rank)))
    try:
        counters, error = _check_meta(owner, kfac["meta"]), None
        core.check_state_dict(kfac["layers"])
        if generator is not None:
            check_generator_state(generator)
    except ValueError as err:
        error = str(err)
    # A rank may read entries another does not (its gradient-worker blocks): all or none.
    if core.any_rank(error is not None):
        raise ValueError(error or "kaisa.checkpoint: another rank refused the checkpoint's "
                         "K-FAC state (see its error); nothing was loaded")
    mine = owner.kfac_state_dict()
    state = KFACState(counters=counters, generator=generator,
                      generator_per_rank=mine.generator_per_rank, layers=kfac["layers"])
    weights = get_model_state_dict(model)
    if _is_optimizer(owner, optimizer):
        # Checked whole by the product before the model is read (reading writes into it).
        optimizers = _optimizers(checkpoint_id, storage_reader, model, optimizer, owner, saved)
        owner.load_kfac_state_dict(dataclasses.replace(state, optimizers=optimizers))
        dcp_load({"model": weights}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
        set_model_state_dict(model, weights)
        return
    rest: dict[str, Any] = {"model": weights,
                            "optim": get_optimizer_state_dict(model, optimizer)}
    dcp_load(rest, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    set_model_state_dict(model, rest["model"])
    set_optimizer_state_dict(model, optimizer, rest["optim"])
    owner.load_kfac_state_dict(state)
