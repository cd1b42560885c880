"""Timed regions of a step, and an opt-in profile of exclusive seconds by phase.

Every timed region in kaisa goes through :class:`timed`: it adds the region's host
seconds to its owner's ``timings`` dict (``KFAC.timings``, ``curvature.timings``: always
on, one ``perf_counter`` pair) and, only while a :class:`PhaseProfile` is active, also
reports the region to it as a phase. :func:`phase` marks a region only a profile sees
(the products' forward and backward passes, a benchmark's own regions); while no profile
is active it returns one shared no-op context, so it costs a call and nothing else.

A profile keeps *exclusive* seconds by phase path (``("step", "backward", "factors")``:
the factor statistics the hooks compute during the backward pass): a phase's time minus
its nested phases', so the seconds of all paths add up to the outermost phases' time.
With ``ranges=True`` each phase is also a ``torch.profiler.record_function`` range (for
a trace). Host seconds: on CUDA a phase's time is its launches unless something in it
synchronises. One profile at a time, on the thread that runs the step (autograd's
backward on CPU runs hooks on the calling thread).

    with kaisa.utils.profiling.PhaseProfile() as profile:
        optimizer.step(closure)
    profile.seconds  # {("forward",): ..., ("backward", "factors"): ..., ...}
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType

import torch

__all__ = ["PhaseProfile", "phase", "timed"]

_NULL: AbstractContextManager[None] = nullcontext()
_active: PhaseProfile | None = None


class PhaseProfile:
    """Collects exclusive host seconds by phase path while active (a context manager).

    Args:
        ranges: Also open a ``torch.profiler.record_function`` range per phase.

    Raises:
        RuntimeError: On entering while another profile is active.
    """

    def __init__(self, *, ranges: bool = False) -> None:
        self.ranges = ranges
        #: Exclusive seconds by phase path (outermost first).
        self.seconds: dict[tuple[str, ...], float] = {}
        #: Entries by phase path.
        self.calls: dict[tuple[str, ...], int] = {}
        self._stack: list[_Phase] = []

    def __enter__(self) -> PhaseProfile:
        global _active
        if _active is not None:
            raise RuntimeError("a PhaseProfile is already active (profiles do not nest)")
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
        self._stack.clear()

    def reset(self) -> None:
        """Forgets the seconds and counts collected so far."""
        self.seconds.clear()
        self.calls.clear()

    def by_phase(self) -> dict[str, float]:
        """Exclusive seconds by innermost phase name (paths merged)."""
        out: dict[str, float] = {}
        for path, seconds in self.seconds.items():
            out[path[-1]] = out.get(path[-1], 0.0) + seconds
        return out


class _Phase:
    """One entry of a phase while a profile is active."""

    __slots__ = ("_children", "_name", "_path", "_profile", "_range", "_start")

    def __init__(self, profile: PhaseProfile, name: str) -> None:
        self._profile, self._name = profile, name
        self._children = 0.0
        self._start = 0.0
        self._path: tuple[str, ...] = ()
        self._range: torch.profiler.record_function | None = None

    def __enter__(self) -> None:
        profile = self._profile
        stack = profile._stack
        self._path = (*stack[-1]._path, self._name) if stack else (self._name,)
        stack.append(self)
        if profile.ranges:
            self._range = torch.profiler.record_function(self._name)
            self._range.__enter__()  # type: ignore[no-untyped-call]
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._start
        profile = self._profile
        if self._range is not None:
            self._range.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        stack = profile._stack
        if stack and stack[-1] is self:
            stack.pop()
        if stack:
            stack[-1]._children += elapsed
        path = self._path
        profile.seconds[path] = profile.seconds.get(path, 0.0) + elapsed - self._children
        profile.calls[path] = profile.calls.get(path, 0) + 1


def phase(name: str) -> AbstractContextManager[None]:
    """A region named ``name`` for the active profile; a shared no-op while none is."""
    profile = _active
    if profile is None:
        return _NULL
    return _Phase(profile, name)


class timed:  # noqa: N801 - used as a context manager, like a function
    """Adds the block's host seconds to ``timings[key]``; a phase ``key`` when profiled.

    Args:
        timings: The owner's seconds by phase (a missing key starts at 0).
        key: The phase.
    """

    __slots__ = ("_key", "_phase", "_start", "_timings")

    def __init__(self, timings: MutableMapping[str, float], key: str) -> None:
        self._timings, self._key = timings, key
        self._phase: AbstractContextManager[None] = _NULL
        self._start = 0.0

    def __enter__(self) -> None:
        self._phase = phase(self._key)
        self._phase.__enter__()
        self._start = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self._start
        self._timings[self._key] = self._timings.get(self._key, 0.0) + elapsed
        self._phase.__exit__(kind, value, traceback)
