"""Checkpoints that let ``--resume`` reproduce an uninterrupted run exactly.

A checkpoint holds only tensors and plain Python values, so it loads with
``torch.load(..., weights_only=True)``; the random-number-generator states are stored
as tensors. :func:`load` and :func:`check_matches` turn every way a file can be
unusable (truncated, empty, random bytes, another model, another configuration) into
one :class:`CheckpointError` line, before anything of the run is touched.
"""

from __future__ import annotations

import errno
import io
import os
import random
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisa.train.distributed import DistContext, raise_together
from kaisa.train.files import write_atomic

__all__ = [
    "CheckpointError",
    "check_matches",
    "load",
    "retain",
    "rng_state",
    "save",
    "save_agreed",
    "seed_rng",
    "set_rng_state",
    "verify",
]

#: Entries every kaisa-train checkpoint has.
REQUIRED = ("epoch", "steps", "train_time", "history", "model", "optimizer", "scheduler", "rng")


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from; the message is one line naming the file."""


def seed_rng(seed: int) -> None:
    """Seed every generator :func:`rng_state` captures: Python, NumPy, torch (and CUDA).

    So a checkpoint's states are a function of the seed and the steps taken (Python's
    and NumPy's would otherwise start from the operating system's entropy).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy, torch (and CUDA) random-number-generator states."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state`."""
    random.setstate(state["python"])
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["name"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a crash mid-write keeps the previous checkpoint.

    The bytes go to ``*.partial`` first, which is removed again if writing fails (disk
    full, file-size limit, Ctrl-C), so a failed save leaves nothing behind.
    """
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_atomic(path, buffer.getvalue())


def save_agreed(path: Path, payload: dict[str, Any], context: DistContext) -> None:
    """:func:`save` on rank 0, then every rank learns whether it worked (one all-reduce).

    So a failed write (disk full) stops every rank with the same error at the same step,
    instead of rank 0 alone while the others wait for it in the next step.

    Raises:
        OSError: On every rank if rank 0's write failed (rank 0's names the file).
    """
    failure: OSError | None = None
    if context.is_main:
        try:
            save(path, payload)
        except OSError as err:
            failure = err
    raise_together(failure, context, path)


def kept_name(path: Path, steps: int) -> Path:
    """Where ``--keep`` keeps the checkpoint ``path`` of step ``steps``.

    ``checkpoint.pt`` -> ``checkpoint.step000000120.pt`` (``.dcp`` likewise).
    """
    return path.with_name(f"{path.stem}.step{steps:09d}{path.suffix}")


def retain(path: Path, steps: int, keep: int) -> None:
    """Keep checkpoint ``path`` (of step ``steps``) as :func:`kept_name` too; prune to ``keep``.

    Kept ones beyond the newest ``keep`` are deleted (``keep`` 1: nothing is kept). The
    copy is a hard link (file by file for a DCP directory): no bytes are written.
    """
    if keep <= 1:
        return
    target = kept_name(path, steps)
    _remove(target)  # one written at the same step before (a time budget's end)
    try:
        if path.is_dir():
            shutil.copytree(path, target, copy_function=os.link)
        else:
            os.link(path, target)
    except OSError as err:
        _remove(target)
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP):
            raise
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, target)  # no hard links
    kept = sorted(path.parent.glob(f"{path.stem}.step*{path.suffix}"))
    for old in kept[: max(0, len(kept) - keep)]:
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def verify(path: Path) -> None:
    """Check every member of the checkpoint's zip archive against its stored CRC-32.

    ``torch.load`` does not check them, so a flipped byte inside a tensor would
    otherwise load as a silently altered tensor.

    Raises:
        CheckpointError: If the archive is unreadable or a member's CRC does not match.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot resume from {path}: corrupt or not a checkpoint ({reason[:120]})"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"cannot resume from {path}: corrupt (checksum mismatch in {bad}); the file was "
            "altered after it was written"
        )


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (``weights_only=True``).

    Raises:
        CheckpointError: If the file is empty, truncated, not a torch file, or not a
            kaisa-train checkpoint.
    """
    if path.stat().st_size == 0:
        raise CheckpointError(f"cannot resume from {path}: the file is empty")
    if zipfile.is_zipfile(path):
        verify(path)
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # every unreadable file is the same failure for the user
        text = str(err).strip()
        reason = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
        raise CheckpointError(
            f"cannot resume from {path}: corrupt or not a checkpoint ({reason[:120]})"
        ) from None
    if (
        not isinstance(payload, dict)
        or any(key not in payload for key in REQUIRED)
        or not isinstance(payload["model"], dict)
    ):
        raise CheckpointError(f"cannot resume from {path}: not a kaisa-train checkpoint")
    return payload


#: Settings that may change between a run and its resumption.
RESUMABLE = frozenset(
    {"epochs", "time_budget", "resume", "overwrite", "quiet", "log_every", "plot", "threads",
     "run_dir", "name", "compare", "target", "device", "replicate", "checkpoint_every",
     "keep", "stop_signals", "grace"}
)

#: Settings added since checkpoints first recorded them, with the value they had before: a
#: checkpoint without one is compared as if it held that value.
ADDED = {"fsdp": False, "replicate": 1}


def check_matches(
    state: Mapping[str, Any], path: Path, settings: Mapping[str, Any], model: torch.nn.Module
) -> None:
    """Checks that ``state`` was written by this configuration and this model.

    Raises:
        CheckpointError: Naming the file and the first difference.
    """
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
        raise CheckpointError(
            f"cannot resume from {path}: written for another model (first difference: "
            f"{diff[0]})"
        )
    saved = state.get("settings")
    if isinstance(saved, Mapping):
        there, now = saved.get("world_size"), settings.get("world_size")
        if there is not None and there != now:  # not recorded before: not compared
            raise CheckpointError(
                f"cannot resume from {path}: written by {there} processes, this run has "
                f"{now} (resume with torchrun --nproc_per_node={there})"
            )
        for key in sorted(set(saved) | set(settings)):
            if key in RESUMABLE or key == "world_size":
                continue
            if saved.get(key, ADDED.get(key)) != settings.get(key):
                raise CheckpointError(
                    f"cannot resume from {path}: written by another configuration "
                    f"({key}={saved.get(key)!r} there, {settings.get(key)!r} now)"
                )
