"""The test helper that launches ``kaisa-train`` under torchrun: which failures it retries."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

import tests.support.torchrun as helper
from tests.support.torchrun import _gloo_connect_abort

_ABORT = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at gloo/transport/tcp/address.cc:107] rv != -1. -1 vs -1. "
    "getpeername: Transport endpoint is not connected\n"
)
_PEER_LOST = (
    "[rank0]: Traceback (most recent call last):\n"
    "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:37270.\n"
)
_TORCHRUN = (
    "Traceback (most recent call last):\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "  exitcode  : -6 (pid: 8374)  (SIGABRT)\n"
)


def test_a_gloo_connect_abort_alone_is_retried() -> None:
    assert _gloo_connect_abort(_ABORT + _PEER_LOST + _TORCHRUN)
    assert _gloo_connect_abort(_ABORT + _TORCHRUN)


def test_any_other_failure_is_not() -> None:
    kaisa_error = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad\n"
    assert not _gloo_connect_abort(_PEER_LOST + _TORCHRUN)  # what aborted rank 1 is unknown
    assert not _gloo_connect_abort(_ABORT + kaisa_error + _PEER_LOST + _TORCHRUN)
    assert not _gloo_connect_abort("Segmentation fault\n" + _TORCHRUN)


def _fake_runs(outcomes: list[tuple[int, str]], run_dir: Path, seen: list[set[str]]) -> Any:
    """A ``subprocess.run`` that records the run folder it starts from, writes a run file
    (as a launch that got going would) and returns the next of ``outcomes``."""

    def run(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        seen.append({p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")})
        (run_dir / "q").mkdir(exist_ok=True)
        (run_dir / "q" / "metrics.jsonl").write_text("{}\n")
        code, stderr = outcomes.pop(0)
        return subprocess.CompletedProcess(command, code, "", stderr)

    return run


def test_a_relaunch_starts_from_the_run_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "checkpoint.pt").write_bytes(b"x")
    seen: list[set[str]] = []
    outcomes = [(1, _ABORT + _PEER_LOST + _TORCHRUN), (0, "")]
    monkeypatch.setattr(helper.subprocess, "run", _fake_runs(outcomes, tmp_path, seen))
    with pytest.warns(UserWarning, match="gloo aborted a rank while connecting"):
        result = helper.torchrun(2, ["--run-dir", str(tmp_path)], log_dir=tmp_path / "stderr")
    assert result.returncode == 0 and not outcomes
    assert seen[0] - {"stderr"} == seen[1] - {"stderr", "stderr/torchrun-0.stderr"}
    assert seen[0] - {"stderr"} == {"old", "old/checkpoint.pt"}
    assert (tmp_path / "stderr" / "torchrun-0.stderr").read_text() == (
        _ABORT + _PEER_LOST + _TORCHRUN)


def test_another_failure_fails_at_once_with_every_error_line_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[set[str]] = []
    stderr = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad\n" + (
        "noise\n" * 100) + _TORCHRUN
    monkeypatch.setattr(helper.subprocess, "run", _fake_runs([(1, stderr)], tmp_path, seen))
    with pytest.raises(AssertionError) as failure:
        helper.torchrun(2, ["--run-dir", str(tmp_path)], log_dir=tmp_path / "stderr")
    message = str(failure.value)
    assert len(seen) == 1 and message.index("ValueError: bad") < message.index("noise")
    assert (tmp_path / "stderr" / "torchrun-0.stderr").read_text() == stderr
