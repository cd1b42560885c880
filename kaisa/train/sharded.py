"""``kaisa-train --fsdp``: the GPT sharded by FSDP2, and its checkpoints through DCP.

Under ``--fsdp`` each transformer block and the root are wrapped with ``fully_shard``
(parameters become ``DTensor`` objects sharded on dim 0), on a 1-D mesh of every rank
or, with ``--replicate R``, on an HSDP mesh ``(R, world / R)``: ``R`` replicas of a
model sharded over ``world / R`` ranks. A checkpoint is a directory (``checkpoint.dcp``):

* the model, the optimizer and the K-FAC state through :mod:`kaisa.checkpoint` (DCP: every
  rank writes its shards and what the placement makes it the owner of; without K-FAC, the
  model and optimizer parts alone, in the same layout);
* ``trainer.pt`` (rank 0, ``weights_only``): the epoch, steps, history, the schedule and
  the random-number-generator states, the settings, as :mod:`kaisa.train.checkpoint`
  keeps them for the DDP path.

A save writes ``checkpoint.dcp.partial`` and then swaps it in for the previous checkpoint,
so a run stopped while saving (killed, or a full disk: every rank then stops with the
error) resumes from the previous one. A checkpoint loads at another
world size (and another ``--replicate``): DCP reshards the model and optimizer state and
the K-FAC placement is recomputed.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import kaisa.checkpoint
from kaisa.train import checkpoint
from kaisa.train.distributed import DistContext, raise_together

__all__ = ["TRAINER_FILE", "check_config", "check_options", "load", "read", "recover", "save",
           "shard"]

#: The file of a checkpoint directory that holds the trainer's own state.
TRAINER_FILE = "trainer.pt"

#: What ``trainer.pt`` holds.
REQUIRED = ("epoch", "steps", "train_time", "history", "scheduler", "rng", "settings")


def check_options(options: argparse.Namespace, world_size: int, launched: bool) -> str | None:
    """Why ``--fsdp``/``--replicate`` cannot run as given (``None``: they can).

    Args:
        options: The parsed options (task defaults filled in).
        world_size: The number of processes.
        launched: Whether torchrun started this process.
    """
    if not options.fsdp:
        return "--replicate needs --fsdp" if options.replicate != 1 else None
    if options.task != "lm":
        return "--fsdp shards the GPT of --task lm (per transformer block and the root)"
    if not launched:
        return ("--fsdp needs torchrun (FSDP2 needs a process group), e.g. torchrun "
                "--standalone --nproc_per_node=2 -m kaisa.train --task lm --fsdp ...")
    if world_size % options.replicate:
        return (f"--replicate {options.replicate} must divide the number of processes "
                f"({world_size})")
    return None


def check_config(config: argparse.Namespace) -> str | None:
    """Why configuration ``config`` (one of ``--compare``) cannot run under ``--fsdp``."""
    if config.fsdp and config.optimizer == "kfac" and config.kfac_jvp == "double_backward":
        return ("kaisa.KFAC on the model FSDP2 shards needs --kfac-jvp forward (the default): "
                "'double_backward' differentiates the parameters, which FSDP2 replaces by "
                "their all-gathered copies during the forward pass")
    if config.fsdp and config.optimizer == "kfac-muon":
        return ("kaisa.KFACMuon does not run under --fsdp (the app's sharded checkpoints do "
                "not hold its state); run it without --fsdp (DDP under torchrun)")
    return None


def shard(model: nn.Module, context: DistContext, replicate: int) -> nn.Module:
    """Wraps each of ``model.blocks`` and ``model`` with ``fully_shard`` (in place).

    Args:
        model: The GPT (on ``context.device``).
        context: This process's place; every rank calls this.
        replicate: ``1``: shard over every rank; ``R``: HSDP, ``R`` replicas of a model
            sharded over ``world / R`` ranks.

    Returns:
        ``model`` itself, now an ``FSDPModule``.
    """
    kind, world = context.device.type, context.world_size
    mesh = (init_device_mesh(kind, (world,)) if replicate == 1 else init_device_mesh(
        kind, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _has_curvature(optimizer: Any, preconditioner: Any) -> bool:
    return preconditioner is not None or isinstance(optimizer, kaisa.EKFAC | kaisa.KFAC)


def save(path: Path, state: dict[str, Any], model: nn.Module, optimizer: Any,
         preconditioner: Any, context: DistContext) -> None:
    """Writes the checkpoint directory ``path`` (every rank calls it).

    Args:
        path: The checkpoint directory.
        state: The trainer's state (``REQUIRED``), written by rank 0 as ``trainer.pt``.
        model: The sharded model.
        optimizer: Its optimizer (:class:`kaisa.EKFAC` and :class:`kaisa.KFAC` keep their
            curvature).
        preconditioner: The :class:`kaisa.KFACPreconditioner`, or ``None``.
        context: This process's place.
    """
    partial = path.with_name(path.name + ".partial")
    if context.is_main:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    failure: OSError | None = None
    try:
        if _has_curvature(optimizer, preconditioner):
            kaisa.checkpoint.save(partial, model, optimizer, preconditioner)
        else:
            dcp_save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=partial)
    except CheckpointException as err:  # every rank raises it: a rank's write failed
        failure = _os_error(err, partial)
    if failure is None and context.is_main:
        try:
            checkpoint.save(partial / TRAINER_FILE, state)
            _swap_in(partial, path)
        except OSError as err:
            failure = err
    if failure is not None and context.is_main:
        shutil.rmtree(partial, ignore_errors=True)
    raise_together(failure, context, path)  # every rank stops with the error, or none does


def _swap_in(partial: Path, path: Path) -> None:
    """Replace the checkpoint ``path`` by the whole one ``partial`` (two renames).

    Stopped between the two, ``path.old`` is the previous checkpoint and ``path`` is
    missing: :func:`recover` puts it back.
    """
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def recover(path: Path) -> bool:
    """Puts back the previous checkpoint ``path.old`` of a save stopped inside its swap.

    Returns:
        Whether it did (``path`` was missing and ``path.old`` there).
    """
    old = path.with_name(path.name + ".old")
    if path.exists() or not old.is_dir():
        return False
    old.rename(path)
    return True


def _os_error(err: CheckpointException, partial: Path) -> OSError:
    """The first ``OSError`` of a failed DCP save (disk full, read-only), naming its file.

    Anything else is re-raised.
    """
    for failed, _ in err.failures.values():
        if isinstance(failed, OSError):
            return OSError(failed.errno, failed.strerror or str(failed),
                           failed.filename or str(partial))
    for failed, _ in err.failures.values():
        # torch.save's zip writer reports a short write as "unexpected pos" instead
        if isinstance(failed, RuntimeError) and "inline_container" in str(failed):
            full = shutil.disk_usage(partial.parent).free < 1 << 20
            code = errno.ENOSPC if full else errno.EIO
            return OSError(code, os.strerror(code), str(partial))
    raise err


def read(path: Path, device: torch.device) -> dict[str, Any]:
    """The trainer's state of checkpoint directory ``path``.

    With ``'model'``: the saved model's tensors as meta tensors of their full shapes (for
    :func:`kaisa.train.checkpoint.check_matches`).

    Raises:
        CheckpointError: If ``path`` is not a whole checkpoint directory of ``--fsdp``.
    """
    if not path.is_dir():
        raise checkpoint.CheckpointError(
            f"cannot resume from {path}: not a directory (an --fsdp checkpoint is a DCP "
            "directory; was the run started without --fsdp?)")
    trainer_file = path / TRAINER_FILE
    if not trainer_file.is_file() or not (path / ".metadata").is_file():
        raise checkpoint.CheckpointError(
            f"cannot resume from {path}: incomplete (no {TRAINER_FILE} or DCP .metadata)")
    if trainer_file.stat().st_size == 0:
        raise checkpoint.CheckpointError(f"cannot resume from {trainer_file}: the file is empty")
    checkpoint.verify(trainer_file)
    try:
        state = torch.load(trainer_file, map_location=device, weights_only=True)
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # every unreadable file is the same failure for the user
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise checkpoint.CheckpointError(
            f"cannot resume from {path}: corrupt or not a checkpoint ({reason[:120]})"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise checkpoint.CheckpointError(f"cannot resume from {path}: not a kaisa-train checkpoint")
    state["model"] = {
        fqn[len("model."):]: torch.empty(md.size, device="meta")
        for fqn, md in saved.items()
        if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    return state


def settings_for_check(state: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """``now`` as :func:`kaisa.train.checkpoint.check_matches` should compare it.

    Any world size resumes an ``--fsdp`` checkpoint (DCP reshards it).
    """
    saved = state.get("settings")
    there = saved.get("world_size") if isinstance(saved, Mapping) else None
    return {**now, "world_size": there}


def load(path: Path, model: nn.Module, optimizer: Any, preconditioner: Any) -> None:
    """Loads the model, optimizer and K-FAC state of ``path`` (every rank calls it).

    Raises:
        CheckpointError: If :mod:`kaisa.checkpoint` refuses the K-FAC part (nothing loaded).
    """
    if _has_curvature(optimizer, preconditioner):
        try:
            kaisa.checkpoint.load(path, model, optimizer, preconditioner)
        except ValueError as err:
            raise checkpoint.CheckpointError(f"cannot resume from {path}: {err}") from None
        return
    weights, optim = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    dcp_load({"model": weights, "optim": optim}, checkpoint_id=path)
    set_model_state_dict(model, weights)
    set_optimizer_state_dict(model, optimizer, optim)
