"""The largest bytes a call holds on top of what lived when it started, op by op.

:class:`StepPeak` is a ``TorchDispatchMode``: entered around ``pre.step()``, it samples
after operator calls the bytes of every live CPU tensor storage (the tensors that
``gc.get_objects()`` finds; a ``DTensor``'s storage is its local shard's, found as its own
tensor) that was not live when the mode was entered, less the bytes of the storages held
at the start (``held``, e.g. the preconditioner's batch factors) that are gone by then.
The storages of the model's parameters and gradients are not counted (``exclude``, asked at
every sample: a gradient may be replaced). The mode keeps a reference to every storage live
at the start, so no new storage can take the address of one freed during the call.

Sampling: the counted bytes rise only when an operator call returns a storage none of its
inputs had (views, in-place calls and copies into existing tensors allocate nothing), so
the largest value over all calls is attained right after such a call, and the mode walks
the heap only then; and only once the new outputs since the last walk reach ``slack``
bytes (or the call is the last), which bounds what the sampling can miss by ``slack``.
Storages that only C++ holds (a collective's work object, autograd's saved tensors) are
not seen by the walk.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StepPeak", "live_storages", "model_storages", "unwrap"]


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s own storage holder: ``None`` for a ``DTensor`` (its local shard is its own
    tensor), a meta tensor or a tensor subclass without a storage."""
    if type(t).__name__ == "DTensor" or t.device.type == "meta":
        return None
    return t


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every CPU tensor storage a live tensor uses: ``data pointer -> storage``."""
    out: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        t = _local(obj)
        if t is None or t.device.type != "cpu":
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
            continue
        if storage.nbytes():
            out[storage.data_ptr()] = storage
    return out


def model_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the parameters' and their gradients' storages (local shards)."""
    out: set[int] = set()
    for p in params:
        for t in (p, p.grad):
            if t is None:
                continue
            out.add(unwrap(t).untyped_storage().data_ptr())
    return out


class StepPeak(TorchDispatchMode):
    """The largest net bytes of new tensor storage during the calls inside the mode.

    Attributes:
        peak: Bytes at the largest sample: new storages less the ``held`` ones freed.
        new_at_peak: Of which new storages.
        freed_at_peak: Held storages gone at that sample.
        where: The operator after which the peak was sampled.
        shapes: With ``breakdown``: at the peak, ``(shape, dtype) -> (count, bytes)`` of the
            new storages' tensors (a storage counted once, by its largest tensor).
        calls: Operator calls seen; ``walks``: heap walks done.
        phase: The label the caller gives the calls now (e.g. ``step()``'s phase).
        phases: ``label -> (peak, new, freed)`` bytes, the largest sample of each label.
    """

    def __init__(self, held: dict[int, int], exclude: Callable[[], set[int]], *,
                 slack: int = 1 << 16, breakdown: bool = False) -> None:
        """Starts counting from the storages live now.

        Args:
            held: ``data pointer -> bytes`` of the storages the measured object held at the
                start (their release lowers the count).
            exclude: The data pointers not to count (asked at every walk).
            slack: Bytes of new outputs after which a walk is due.
            breakdown: Record the shapes live at the peak.
        """
        super().__init__()  # type: ignore[no-untyped-call]
        self._base = live_storages()  # kept: a freed address is not reused meanwhile
        self._held = held
        self._exclude = exclude
        self._slack = slack
        self._breakdown = breakdown
        self._pending = 0
        self.peak = self.new_at_peak = self.freed_at_peak = 0
        self.where = ""
        self.shapes: dict[str, tuple[int, int]] = {}
        self.calls = self.walks = 0
        self.phase = ""
        self.phases: dict[str, tuple[int, int, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        """Runs the call; walks the heap where it may have raised the count."""
        result = func(*args, **(kwargs or {}))
        self.calls += 1
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and (p := _ptr(t)) not in inputs and p is not None:
                self._pending += _nbytes(t)
        if self._pending >= self._slack:
            self.sample(str(func))
        return result

    def __exit__(self, *exc: object) -> None:
        """Leaves the mode after one last walk (what came after the last due one)."""
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if self._pending:
            self.sample("exit")

    def sample(self, where: str) -> None:
        """One heap walk: updates the peak."""
        self._pending = 0
        self.walks += 1
        live = live_storages()
        skip = self._exclude()
        new = {p: s for p, s in live.items() if p not in self._base and p not in skip}
        added = sum(s.nbytes() for s in new.values())
        freed = sum(n for p, n in self._held.items() if p not in live)
        best = self.phases.get(self.phase)
        if best is None or added - freed > best[0]:
            self.phases[self.phase] = (added - freed, added, freed)
        if added - freed <= self.peak:
            return
        self.peak, self.new_at_peak, self.freed_at_peak = added - freed, added, freed
        self.where = where
        if self._breakdown:
            self.shapes = _shapes(set(new))

    def summary(self) -> dict[str, Any]:
        """The peak and its context, JSON-ready (bytes in MB)."""
        mb = 2.0**20
        out: dict[str, Any] = {
            "extra_mb": self.peak / mb, "new_mb": self.new_at_peak / mb,
            "freed_mb": self.freed_at_peak / mb, "where": self.where,
            "calls": self.calls, "walks": self.walks,
            "phases": {k: {"extra_mb": v[0] / mb, "new_mb": v[1] / mb, "freed_mb": v[2] / mb}
                       for k, v in self.phases.items()}}
        if self._breakdown:
            top = sorted(self.shapes.items(), key=lambda kv: -kv[1][1])[:12]
            out["shapes"] = [{"shape": k, "count": c, "mb": b / mb} for k, (c, b) in top]
        return out


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (no operator call), else ``t``."""
    local = getattr(t, "_local_tensor", None) if type(t).__name__ == "DTensor" else None
    return local if isinstance(local, torch.Tensor) else t


def _ptr(t: torch.Tensor) -> int | None:
    local = unwrap(t)
    if local.device.type != "cpu":
        return None
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _nbytes(t: torch.Tensor) -> int:
    return int(unwrap(t).untyped_storage().nbytes())


def _shapes(ptrs: set[int]) -> dict[str, tuple[int, int]]:
    """``(shape, dtype) -> (count, bytes)`` of the storages ``ptrs`` by their largest tensor."""
    largest: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and (t := _local(obj)) is not None:
            p = _ptr(t)
            if p in ptrs and (p not in largest or t.numel() > largest[p].numel()):
                largest[p] = t
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for t in largest.values():
        key = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        counts[key] += 1
        sizes[key] += t.untyped_storage().nbytes()
    return {k: (counts[k], sizes[k]) for k in counts}
