"""kaisa-train under faults (issue #23, round 2): one line, a documented exit status, and
whole files on disk: concurrent runs, corrupt checkpoints, full disks, file-size limits,
read-only run directories, Ctrl-C, bad flags, another world size."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kaisa.train.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--run-dir", str(tmp_path), "--quiet", "--batch-size", "256", "--epochs", "1",
            "--no-plot", *extra]


def _lines(path: Path) -> list[dict[str, object]]:
    """Every line of metrics.jsonl parsed (fails on a torn line)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def _epochs(path: Path) -> list[object]:
    return [r["epoch"] for r in _lines(path) if r.get("type") != "settings"]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file()}


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kaisa-train: "), err
    return lines[0]


def _spawn(tmp_path: Path, *extra: str, preexec: Callable[[], None] | None = None,
           ) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "kaisa.train", *_args(tmp_path, *extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        preexec_fn=preexec,
    )


def _wait_for_records(path: Path, count: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.is_file() and len(_epochs(path)) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError("the run wrote no metrics")


# --- item 4: two runs of one name -----------------------------------------------------------


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_second_run_of_the_same_name_is_refused_while_the_first_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _spawn(tmp_path, "--name", "a", "--epochs", "100000")
    try:
        _wait_for_records(tmp_path / "a" / "metrics.jsonl", 3, first)
        for flag in ("--overwrite", "--resume"):
            with pytest.raises(SystemExit) as exit_info:
                main(_args(tmp_path, "--name", "a", "--epochs", "2", flag))
            assert exit_info.value.code == 2
            line = _one_error_line(capsys.readouterr().err)
            assert "is in use by another kaisa-train process" in line and "a" in line
        assert first.poll() is None  # the first run goes on, undisturbed
    finally:
        first.kill()
        first.communicate()
    epochs = _epochs(tmp_path / "a" / "metrics.jsonl")  # whole lines only, in order
    assert epochs == list(range(len(epochs))) and len(epochs) >= 3


# --- item 7: silent corruption ---------------------------------------------------------------


@pytest.mark.parametrize("where", [0.3, 0.5, 0.7])
def test_a_64_byte_flip_inside_a_checkpoint_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: float
) -> None:
    args = _args(tmp_path, "--name", "flip")
    assert main(args) == 0
    path = tmp_path / "flip" / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    start = int(len(data) * where)
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])
    path.write_bytes(bytes(data))
    before = _snapshot(tmp_path / "flip")
    capsys.readouterr()
    assert main([*args, "--epochs", "2", "--resume"]) == 3
    line = _one_error_line(capsys.readouterr().err)
    assert "checkpoint.pt" in line and "corrupt" in line and "checksum" in line, line
    assert _snapshot(tmp_path / "flip") == before


# --- item 12: disk full, ulimit -f, read-only, Ctrl-C, a directory in the way -------------


def _failing_write(trigger: Callable[[bytes], bool]) -> Callable[[int, object], int]:
    """os.write that writes half of a matching buffer, then fails like a full disk."""
    real = os.write

    def write(fd: int, data: object) -> int:
        raw = bytes(data)  # type: ignore[call-overload]
        if trigger(raw):
            real(fd, raw[: len(raw) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, raw)

    return write


@pytest.mark.parametrize("what", ["checkpoint", "metrics line"])
def test_disk_full_is_one_line_and_leaves_whole_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    what: str,
) -> None:
    args = _args(tmp_path, "--name", "full")
    assert main(args) == 0
    run = tmp_path / "full"
    checkpoint = (run / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    if what == "checkpoint":
        trigger: Callable[[bytes], bool] = lambda raw: len(raw) > 100_000  # noqa: E731
    else:
        trigger = lambda raw: b'"epoch": 2' in raw  # noqa: E731
    monkeypatch.setattr(os, "write", _failing_write(trigger))
    assert main([*args, "--epochs", "3", "--resume"]) == 4
    monkeypatch.undo()
    line = _one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line and "kept" in line, line
    assert ("checkpoint.pt" if what == "checkpoint" else "metrics.jsonl") in line
    assert not list(run.glob("*.partial"))
    assert _epochs(run / "metrics.jsonl") == [0, 1]  # every line whole
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    if what == "checkpoint":
        assert (run / "checkpoint.pt").read_bytes() == checkpoint
    else:
        assert saved["epoch"] == 2  # written before its metrics line; --resume rewrites it
    assert main([*args, "--epochs", "3", "--resume"]) == 0
    assert _epochs(run / "metrics.jsonl") == [0, 1, 2, 3]


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_file_size_limit_is_one_line_and_leaves_no_partial_file(tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    run = _spawn(tmp_path, "--name", "small", "--epochs", "2", preexec=limit)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 4, err
    line = _one_error_line(err)
    assert "File too large" in line and "checkpoint.pt" in line, line
    files = {p.name for p in (tmp_path / "small").iterdir()}
    assert files == {"metrics.jsonl"}  # no checkpoint.pt.partial
    assert _epochs(tmp_path / "small" / "metrics.jsonl") == [0]


def _without_root_file_override() -> None:
    """In the child, before exec: make file modes bind root too.

    Dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set means the
    exec'd process runs without them, so a 0o555 directory is read-only even for root.
    """
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_read_only_run_directory_is_one_line_and_touches_nothing() -> None:
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        assert main(_args(base, "--name", "ro")) == 0
        run = base / "ro"
        for path in [*run.iterdir(), run]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        before = _snapshot(run)

        child = _spawn(base, "--name", "ro", "--epochs", "2", "--resume",
                       preexec=_without_root_file_override)
        _, err = child.communicate(timeout=300)
        assert child.returncode == 4, err
        line = _one_error_line(err)
        assert "Permission denied" in line and "metrics.jsonl" in line, line
        assert _snapshot(run) == before
    finally:
        for path in base.rglob("*"):
            path.chmod(0o755)
        subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_ctrl_c_is_one_line_exit_130_and_keeps_checkpoint_and_metrics_consistent(
    tmp_path: Path,
) -> None:
    # Ctrl-C's default action in the child even when this test runs in a background job
    # (a shell's `cmd &` starts it with SIGINT ignored, which Python then keeps ignoring)
    run = _spawn(tmp_path, "--name", "int", "--epochs", "100000",
                 preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL) and None)
    _wait_for_records(tmp_path / "int" / "metrics.jsonl", 4, run)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    line = _one_error_line(err)
    assert "interrupted" in line and "--resume" in line, line
    folder = tmp_path / "int"
    assert not list(folder.glob("*.partial"))
    epochs = _epochs(folder / "metrics.jsonl")
    assert epochs == list(range(len(epochs)))
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == epochs[-1]
    assert main(_args(tmp_path, "--name", "int", "--epochs", str(epochs[-1] + 1),
                      "--resume")) == 0
    assert _epochs(folder / "metrics.jsonl") == [*epochs, epochs[-1] + 1]


def test_a_directory_where_the_checkpoint_goes_is_one_line_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(tmp_path, "--name", "d")
    assert main(args) == 0
    run = tmp_path / "d"
    (run / "checkpoint.pt").unlink()
    (run / "checkpoint.pt").mkdir()
    before = _snapshot(run)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 3
    line = _one_error_line(capsys.readouterr().err)
    assert "checkpoint.pt" in line and "is a directory" in line, line
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--overwrite"])
    assert exit_info.value.code == 2
    assert "is a directory" in _one_error_line(capsys.readouterr().err)
    assert _snapshot(run) == before and (run / "checkpoint.pt").is_dir()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--threads", "-1"], "--threads: must be >= 0"),
        (["--dataset", "synthetic", "--model", "mlp", "--synthetic-size", "0"],
         "--synthetic-size: must be >= 1"),
        (["--dataset", "synthetic", "--model", "mlp", "--image-size", "0"],
         "--image-size: must be >= 1"),
        (["--log-every", "0"], "--log-every: must be >= 1"),
        (["--lr", "nan"], "--lr: must be a finite number"),
        (["--lr", "inf"], "--lr: must be a finite number"),
        (["--weight-decay", "nan"], "--weight-decay: must be a finite number"),
        (["--time-budget", "-5"], "--time-budget: must be > 0"),
        (["--time-budget", "nan"], "--time-budget: must be a finite number"),
        (["--target", "nan"], "--target: must be a finite number"),
        (["--warmup-epochs", "-1"], "--warmup-epochs: must be >= 0"),
        (["--pg-timeout", "-1"], "--pg-timeout: must be > 0"),
        (["--compare", ""], "--compare needs at least one configuration"),
        (["--compare", "sgd@lr=nan"], "invalid value 'nan' for lr"),
        (["--name", ""], "--name must name a run directory"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tmp_path, *argv))
    assert exit_info.value.code == 2
    assert expected in _one_error_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())  # nothing written


def test_resume_at_another_world_size_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(tmp_path, "--name", "w")
    assert main(args) == 0
    run = tmp_path / "w"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["settings"]["sgd"]["world_size"] == 1
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["settings"]["world_size"] == 1
    state["settings"]["world_size"] = 2  # as written by torchrun --nproc_per_node=2
    torch.save(state, run / "checkpoint.pt")
    before = _snapshot(run)
    capsys.readouterr()
    assert main([*args, "--epochs", "2", "--resume"]) == 3
    line = _one_error_line(capsys.readouterr().err)
    assert "written by 2 processes, this run has 1" in line and "nproc_per_node=2" in line
    assert _snapshot(run) == before
