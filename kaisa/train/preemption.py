"""Stopping cleanly when the cluster takes the machine, and checkpoints every N steps or minutes.

A scheduler announces a preemption with a signal some seconds before it kills the job:
SLURM sends ``SIGTERM`` (or the signal of ``--signal``, often ``SIGUSR1``), Kubernetes
``SIGTERM`` 30 s before ``SIGKILL``. :class:`StopSignals` turns such a signal into a
request: the trainer finishes the current optimizer step, every rank agrees on that step
(the request travels with the per-step all-reduce the trainer already makes), writes a
checkpoint there and exits with :data:`EXIT_STOPPED`.

If the checkpoint is not written within the grace time (default 25 s, inside Kubernetes'
30 s), or a second signal comes, the process stops at once with status ``128 + signal``,
and the previous checkpoint is kept: checkpoints are swapped in whole, never written in
place. A repeat of the same signal within :data:`REPEAT_S` of the first counts as the same
request, because a launcher that forwards the cluster's signal (``torchrun`` does) makes
its workers receive it twice.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kaisa.train.argtypes import finite, int_from

__all__ = [
    "EXIT_STOPPED",
    "Every",
    "Preempted",
    "REPEAT_S",
    "StopSignals",
    "add_arguments",
    "parse_every",
    "parse_signals",
]

#: Exit status after a signal: the checkpoint at the step boundary is written (``EX_TEMPFAIL``:
#: "try again later"; a scheduler or ``torchrun --max-restarts`` runs ``--resume`` again).
EXIT_STOPPED = 75

#: Seconds within which a repeat of the first signal counts as the same request.
REPEAT_S = 2.0

#: The default stop signals.
DEFAULT_SIGNALS = "TERM,USR1"


class Preempted(Exception):  # noqa: N818 - a stop, not an error
    """Training stopped at a step boundary on a signal; the checkpoint there is written."""

    def __init__(self, *, label: str, signal_name: str, epoch: int, step: int, path: str) -> None:
        super().__init__(
            f"stopped by {signal_name} at step {step} (epoch {epoch}) of configuration "
            f"{label!r}; checkpoint {path} written (continue with --resume)"
        )
        self.step = step


@dataclass(frozen=True)
class Every:
    """When to write a checkpoint besides each epoch's end.

    Every ``steps`` optimizer steps, or every ``seconds`` of wall-clock time (at the next
    step boundary); neither: only at each epoch's end.
    """

    steps: int | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        """As the settings record it: ``'epoch'``, ``'500 steps'`` or ``'1800 s'``."""
        if self.steps is not None:
            return f"{self.steps} steps"
        return "epoch" if self.seconds is None else f"{self.seconds:g} s"


_EVERY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(|steps?|s|sec|m|min|h)\s*$")
_SECONDS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_every(text: str) -> Every:
    """``--checkpoint-every``: ``N`` steps, or a time (``Xs``, ``Xm``/``Xmin``, ``Xh``).

    Raises:
        argparse.ArgumentTypeError: In one line, for anything else or a value <= 0.
    """
    match = _EVERY.match(text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected N (steps) or a time such as 30m, 90s, 2h; got {text!r}")
    number, unit = match.groups()
    if unit in ("", "step", "steps"):
        if "." in number or int(number) < 1:
            raise argparse.ArgumentTypeError(f"steps must be an integer >= 1, got {text!r}")
        return Every(steps=int(number))
    seconds = float(number) * _SECONDS[unit]
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"the time must be > 0, got {text!r}")
    return Every(seconds=seconds)


def parse_signals(text: str) -> tuple[str, ...]:
    """``--stop-signals``: comma-separated names (``TERM``, ``SIGUSR1``, ...) or ``none``.

    Raises:
        argparse.ArgumentTypeError: In one line, naming an unknown signal.
    """
    if text.strip().lower() == "none":
        return ()
    names: list[str] = []
    for item in (part.strip().upper() for part in text.split(",") if part.strip()):
        name = item if item.startswith("SIG") else f"SIG{item}"
        if name in ("SIGKILL", "SIGSTOP") or not isinstance(
                getattr(signal.Signals, name, None), signal.Signals):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a signal kaisa-train can handle (e.g. TERM, USR1, USR2, HUP)")
        names.append(name)
    return tuple(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and preemption flags of ``kaisa-train``."""
    group = parser.add_argument_group("checkpoints and preemption")
    add = group.add_argument
    add(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue each configuration from runs/NAME/checkpoint*.pt, mid-epoch if it was "
        "written there (checked first: a corrupt file or one from another model or "
        "configuration exits with status 3 and touches nothing); a configuration without "
        "a checkpoint starts from scratch, with a note (none with 'auto', for restart "
        "loops such as torchrun --max-restarts)",
    )
    add("--checkpoint-every", type=parse_every, default=Every(), metavar="N|TIME",
        help="also checkpoint every N optimizer steps, or every TIME (30m, 90s, 2h) at the "
             "next step boundary; --resume continues mid-epoch bit for bit (default: at "
             "each epoch's end only)")
    add("--keep", type=int_from(1), default=1, metavar="K",
        help="keep the last K checkpoints (K > 1: also as checkpoint.stepN.pt, or .dcp "
             "under --fsdp); the newest is always checkpoint.pt (default: %(default)s)")
    add("--stop-signals", type=parse_signals, default=parse_signals(DEFAULT_SIGNALS),
        metavar="LIST",
        help="signals that stop the run at the next step boundary with a checkpoint there "
             f"and exit status {EXIT_STOPPED}; 'none' leaves their default action (default: "
             f"{DEFAULT_SIGNALS})")
    add("--grace", type=finite(positive=True), default=25.0, metavar="SECONDS",
        help="after a stop signal, stop at once (status 128+signal, the previous checkpoint "
             "kept) if the checkpoint is not written within SECONDS (default: %(default)s)")


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"expected 'auto' or nothing, got {text!r}")
    return text


class StopSignals:
    """Handlers that turn the stop signals into a request to stop at a step boundary.

    Used as a context manager around training (main thread only; elsewhere, or with no
    signals, it installs nothing). :attr:`requested` is the first signal's name; the
    trainer polls it. A second signal, or the grace time running out before :meth:`done`,
    ends the process at once with status ``128 + signal``.
    """

    def __init__(self, names: tuple[str, ...], *, grace: float, is_main: bool,
                 hold_on_error: bool = False) -> None:
        """Handlers for ``names``, installed on ``__enter__``.

        Args:
            names: Signal names (``SIGTERM``, ...).
            grace: Seconds from the first signal to :meth:`done` before stopping at once.
            is_main: Whether this process prints (rank 0).
            hold_on_error: Leaving the block on an exception, keep the handlers and ignore
                the signals (a torchrun worker: when another rank exits first with the same
                error, torchrun sends this one SIGTERM, which must not replace its status).
        """
        self.names, self.grace, self.is_main = names, grace, is_main
        self.hold_on_error = hold_on_error
        self.requested: str | None = None
        self._first = 0.0
        self._timer: threading.Timer | None = None
        self._stopped = False
        self._exit_status: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                number = signal.Signals[name]
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Cancels the grace timer; restores the previous handlers unless a stop came.

        After a stop (or, with ``hold_on_error``, an error) the process is ending: a
        launcher's repeat of the signal to a rank that already stopped must not kill it
        before it exits with its status.
        """
        self.done()
        if kind is not None and self.hold_on_error:
            self._stopped = True
        if not self._stopped:
            for number, previous in self._previous.items():
                signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self._exit_status is not None:  # told to go while on its way out: go now
            os._exit(self._exit_status)
        if self._stopped:  # the checkpoint is written: the process is on its way out
            return
        name = signal.Signals(number).name
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first = name, now
            self._timer = threading.Timer(self.grace, self._stop_now, (number, "grace"))
            self._timer.daemon = True
            self._timer.start()
        elif name != self.requested or now - self._first > REPEAT_S:
            self._stop_now(number, "second")

    def _stop_now(self, number: int, why: str) -> None:
        name = signal.Signals(number).name
        if self.is_main:
            reason = (f"a second signal ({name})" if why == "second" else
                      f"{name}: the checkpoint was not written within --grace {self.grace:g} s")
            print(f"kaisa-train: stopped at once on {reason}; the last complete checkpoint "
                  "is kept (continue with --resume)", file=sys.stderr, flush=True)
        os._exit(128 + number)

    def exiting(self, status: int) -> None:
        """The process is about to exit with ``status``: a stop signal now ends it at once.

        With that status: a launcher that saw another rank exit first sends one, and the
        error is already reported.
        """
        self._exit_status = status

    def done(self) -> None:
        """The checkpoint at the stop is written (or training ended): no grace stop."""
        self._stopped = self.requested is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
