"""Where tests/ops/test_cuda_ops.py runs the CUDA kernels: a GPU, or the SIMT emulator.

``'cuda'``: ``torch.ops.kaisa.*`` of the installed ``kaisa._C`` on a real device.
``'simt'``: ``torch.ops.kaisa_simt.*``, the same ``csrc/cuda/*.cu`` compiled as host
C++ by ``tools/simt`` and executed on the CPU (device memory is host memory; see
``docs/cuda-kernels.md``). A machine with a CUDA device uses the GPU, any other the
emulator (which needs torch's CPU build: it emulates the CUDA device inside it).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

SCHEDULES = (0, 1)
"""The emulator's thread orders: ascending and descending (tools/simt/src/fiber.cpp)."""


def backend_params() -> list[Any]:
    """The ``backend`` fixture's parameters on this machine."""
    if torch.cuda.is_available():
        return [pytest.param("cuda", marks=pytest.mark.gpu)]
    cpu_torch = torch.version.cuda is None
    return [
        pytest.param(
            "simt",
            marks=[
                pytest.mark.emulator,
                pytest.mark.skipif(
                    not cpu_torch, reason="the emulator emulates a CUDA device in torch's CPU build"
                ),
            ],
        )
    ]


@dataclass(frozen=True)
class Backend:
    """One way to run the CUDA kernels."""

    name: str

    @property
    def emulated(self) -> bool:
        """Whether the kernels run under the SIMT emulator."""
        return self.name == "simt"

    def ops(self) -> Any:
        """The op namespace: ``torch.ops.kaisa`` or ``torch.ops.kaisa_simt``."""
        return torch.ops.kaisa_simt if self.emulated else torch.ops.kaisa

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of the host tensor ``t``."""
        if self.emulated:
            return torch.ops.simt.to_device(t)  # type: ignore[no-any-return]
        return t.to("cuda")

    def poison(self) -> None:
        """Makes memory a kernel forgets to write show up as NaN.

        On a GPU the caching allocator's free blocks are filled with NaN; the
        emulator fills every fresh allocation with NaN (0xFF bytes) anyway.
        """
        if self.emulated:
            return
        keep = [torch.full((n,), math.nan, device="cuda") for n in (1 << 8, 1 << 12, 1 << 16)]
        keep += [torch.full((1 << 22,), math.nan, device="cuda") for _ in range(4)]
        del keep
        torch.cuda.synchronize()

    def synchronize(self) -> None:
        """Waits for all queued device work."""
        if self.emulated:
            torch.ops.simt.synchronize()
        else:
            torch.cuda.synchronize()

    def runs(self, call: Callable[[], Any]) -> list[Any]:
        """Runs ``call`` once per schedule (emulator) or twice (GPU); host copies of the results.

        Every tensor in the result (a tensor or a tuple of tensors) is copied
        to the host. The emulator clears its launch log before each run.
        """
        results = []
        for schedule in SCHEDULES:
            with self.schedule(schedule):
                if self.emulated:
                    torch.ops.simt.clear_launch_log()
                self.poison()
                out = call()
                if isinstance(out, tuple):
                    results.append(tuple(t.cpu() for t in out))
                else:
                    results.append(out.cpu())
        return results

    @contextlib.contextmanager
    def _emulator_setting(self, setter: Callable[[Any], Any], value: Any) -> Iterator[None]:
        """Runs the block with an emulator setting (``setter`` returns the old value, which
        is restored afterwards); a no-op on a GPU."""
        if not self.emulated:
            yield
            return
        before = setter(value)
        try:
            yield
        finally:
            setter(before)

    def solver_nan_garbage(self, garbage: bool) -> contextlib.AbstractContextManager[None]:
        """Under the emulator: the solvers' results for a non-finite matrix are NaN, or
        finite and wrong with info 0 (``garbage``: a solver that does not report it;
        on an H100, syevjBatched's status did not flag a NaN matrix).
        A no-op on a GPU (the real solver's behaviour is the one case there)."""
        return self._emulator_setting(  # the op exists only where the emulator is built
            lambda on: torch.ops.simt.set_nonfinite_garbage(on), garbage)

    def schedule(self, schedule: int) -> contextlib.AbstractContextManager[None]:
        """Runs the block under the emulator's ``schedule`` (a no-op on a GPU)."""
        return self._emulator_setting(lambda s: torch.ops.simt.set_schedule(s), schedule)

    def launches(self, kernel: str) -> list[tuple[int, int, int]]:
        """Grids of the launches of ``kernel`` since the last run (emulator only)."""
        assert self.emulated
        grids = []
        for entry in torch.ops.simt.launch_log():
            name, grid = entry.split()[:2]
            if name == kernel:
                x, y, z = grid.removeprefix("grid=(").removesuffix(")").split(",")
                grids.append((int(x), int(y), int(z)))
        return grids

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Makes a side stream current (joined back to the previous one on exit)."""
        if self.emulated:
            previous = torch.ops.simt.set_stream(1)
            try:
                yield
            finally:
                torch.ops.simt.synchronize()
                torch.ops.simt.set_stream(previous)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)


def load(name: str) -> Backend:
    """The backend ``name``, with the emulator built and loaded when it is ``'simt'``."""
    if name == "simt":
        from tools.simt import build

        build.load(sanitize=os.environ.get("KAISA_SIMT_SANITIZE", "") == "1")
    return Backend(name)
