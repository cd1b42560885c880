"""kaisa-train preempted under torchrun (2 gloo ranks on 127.0.0.1): DDP and ``--fsdp``.

* SIGTERM at 5 random moments, to torchrun (which forwards it to every rank) or to one
  rank alone (the other learns of it in the next step's all-reduce): every time exit 75
  within the grace time, one line from rank 0, a checkpoint at the step both ranks agreed
  on; the chain of resumes equals an uninterrupted run bit for bit.
* SIGKILL of one rank at 10 (DDP: 5) random file operations inside saves (every step
  saves; DCP under ``--fsdp``), under ``torchrun --max-restarts 10 --resume auto``: each restart
  resumes from the last whole checkpoint, and the run ends equal to an uninterrupted one.
* A full disk (a small tmpfs) during a save, and a read-only run folder: one line, exit 4
  on every rank (rank 0 first), the previous checkpoint whole; after freeing space (or
  with the folder writable again) ``--resume`` ends bit for bit.
* ``torchrun --max-restarts 1 --resume auto`` with one rank killed mid-run (DDP).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kaisa.train.preemption import EXIT_STOPPED
from tests.support.torchrun import torchrun
from tests.train.preempt_support import (
    assert_same,
    epochs_written,
    learned_state,
    records,
    wait_until,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "support" / "killshim"
PACE = ROOT / "tests" / "support" / "paceshim"
#: Each step 25 ms (DDP, 115 steps) or 100 ms (--fsdp, 40) or more: the five launches, each
#: signalled within 0.5 s of its first record, reach at most 100 and 25 steps on any machine.
MIN_STEP_SECONDS = {"ddp": "0.025", "fsdp": "0.1"}

#: DDP: the digits CNN with K-FAC, 23 steps of 32 per rank and epoch.
DDP = ["--task", "classify", "--kfac", "--batch-size", "32", "--epochs", "5"]
#: --fsdp: the byte GPT, AdamW + K-FAC, 10 steps per epoch.
FSDP = ["--task", "lm", "--d-model", "32", "--context", "16", "--steps-per-epoch", "10",
        "--eval-windows", "16", "--text-bytes", "20000", "--batch-size", "4", "--fsdp",
        "--kfac", "--optimizer", "adamw", "--epochs", "4"]
COMMON = ["--quiet", "--no-plot"]


def _command(run_dir: Path, name: str, args: list[str], restarts: int = 0,
             quiet: bool = True) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone",
            "--nproc_per_node=2", f"--max-restarts={restarts}", "-m", "kaisa.train",
            "--run-dir", str(run_dir), "--name", name, *(COMMON if quiet else COMMON[1:]),
            *args]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "KAISA_BACKEND": "torch",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **extra}


def _launch(run_dir: Path, name: str, args: list[str], restarts: int = 0, quiet: bool = True,
            **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(_command(run_dir, name, args, restarts, quiet),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(**env))


def _workers(agent: subprocess.Popen[str]) -> dict[int, psutil.Process]:
    """The agent's worker processes by rank (from each one's ``RANK``)."""
    out: dict[int, psutil.Process] = {}
    for child in psutil.Process(agent.pid).children():
        try:
            out[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError, ValueError):
            continue
    return out


def _dcp(path: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint directory, and its ``trainer.pt`` without times."""
    out = path.with_name(path.name + ".whole.pt")
    dcp_to_torch_save(path, out)
    state: dict[str, Any] = torch.load(out, weights_only=False)
    out.unlink()
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    state["trainer"] = {k: trainer[k] for k in ("epoch", "steps", "scheduler", "rng")}
    return state


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted runs, ``ddp`` and ``fsdp``: what every stopped chain must equal."""
    base = tmp_path_factory.mktemp("whole")
    for name, args in (("ddp", DDP), ("fsdp", FSDP)):
        torchrun(2, ["--run-dir", str(base), "--name", name, *COMMON, *args],
                 log_dir=base / "stderr")
    return base


def _assert_equals_whole(run: Path, whole: Path, fsdp: bool) -> None:
    if fsdp:
        assert_same(_dcp(run / "checkpoint.dcp"), _dcp(whole / "checkpoint.dcp"))
    else:
        assert_same(learned_state(run / "checkpoint.pt"), learned_state(whole / "checkpoint.pt"))
    assert records(run) == records(whole)


def _written_since(path: Path, since_ns: int) -> bool:
    return path.is_file() and path.stat().st_mtime_ns > since_ns and path.stat().st_size > 0


def _steps(run: Path, fsdp: bool) -> int:
    path = run / "checkpoint.dcp" / "trainer.pt" if fsdp else run / "checkpoint.pt"
    return int(torch.load(path, weights_only=True)["steps"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sigterm_at_five_random_moments_under_torchrun(
    mode: str, whole: Path, tmp_path: Path
) -> None:
    fsdp = mode == "fsdp"
    args, run = FSDP if fsdp else DDP, tmp_path / mode
    rng = random.Random(7 if fsdp else 11)
    stops: list[int] = []
    for attempt in range(5):
        launched = time.time_ns()
        agent = _launch(tmp_path, mode, [*args, *(["--resume"] if attempt else [])],
                        PYTHONPATH=os.pathsep.join([str(PACE), str(ROOT)]),
                        KAISA_TEST_MIN_STEP_SECONDS=MIN_STEP_SECONDS[mode])
        # training has begun (the stop signals are handled) once this launch wrote a record
        wait_until(lambda t=launched: _written_since(run / "metrics.jsonl", t), timeout=180,
                   what="the first record", alive=lambda a=agent: a.poll() is None)
        time.sleep(rng.uniform(0.1, 0.5))
        target = ("torchrun", "rank 1", "rank 0")[attempt % 3]
        if target == "torchrun":  # forwards it to every rank
            agent.send_signal(signal.SIGTERM)
        else:  # one rank alone: the other stops at the same step
            _workers(agent)[int(target[-1])].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = agent.communicate(timeout=120)
        (tmp_path / f"attempt{attempt}.stderr").write_text(err)
        assert time.monotonic() - sent < 25.0, err[-3000:]
        assert agent.returncode != 0, err[-3000:]
        ours = [line for line in err.splitlines() if line.startswith("kaisa-train: ")]
        assert len(ours) == 1 and "stopped by " in ours[0], err[-3000:]
        assert ("SIGTERM" in ours[0]) == (target != "rank 1"), ours
        assert f"exitcode  : {EXIT_STOPPED}" in err or target == "torchrun", err[-3000:]
        stops.append(_steps(run, fsdp))
        assert f"at step {stops[-1]} " in ours[0], (ours, stops)
        assert not list(run.glob("*.partial")), list(run.iterdir())
    assert stops == sorted(stops) and len(set(stops)) == 5, stops
    torchrun(2, ["--run-dir", str(tmp_path), "--name", mode, *COMMON, *args, "--resume"],
             log_dir=tmp_path / "stderr")
    _assert_equals_whole(run, whole / mode, fsdp)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sigkill_of_a_rank_at_ten_points_of_saves_resumes_bit_exact(
    mode: str, whole: Path, tmp_path: Path
) -> None:
    """Every step saves; 10 launches (5 under DDP) each lose a rank at a random file
    operation of a save.
    ``--fsdp`` (DCP): rank 0 has ~12 per save, from clearing the partial directory to
    removing the old checkpoint after the swap, rank 1 its shard files. DDP: rank 0 writes
    ``checkpoint.pt.partial`` and renames it. torchrun restarts the group, which resumes
    from the last whole checkpoint."""
    fsdp = mode == "fsdp"
    rng = random.Random(2026)
    ranks = [rng.randint(0, 1) if fsdp else 0 for _ in range(10 if fsdp else 5)]
    kills = [[rank, rng.randint(1, (24 if rank == 0 else 4) if fsdp else 4)] for rank in ranks]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kills": kills, "match": ".dcp" if fsdp else "checkpoint.pt"}))
    args = [*(FSDP if fsdp else DDP), "--checkpoint-every", "1", "--resume", "auto"]
    agent = _launch(tmp_path, "killed", args, restarts=len(kills), quiet=False,
                    KAISA_TEST_KILL_PLAN=str(plan),
                    PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT)]))
    out, err = agent.communicate(timeout=840)
    (tmp_path / "torchrun.stderr").write_text(err)
    done = plan.with_name(plan.name + ".done").read_text().split("\n")[:-1]
    assert [line.split() for line in done] == [[str(r), str(op)] for r, op in kills], done
    assert agent.returncode == 0, err[-4000:]
    assert not list((tmp_path / "killed").glob("*.partial"))
    # Every restart resumed (the first kill may come before any checkpoint), each from a
    # whole checkpoint no older than the one before it.
    resumed = [int(m) for m in re.findall(r"kaisa-train: resuming from \S+ at step (\d+)", out)]
    assert len(kills) - 2 <= len(resumed) <= len(kills), (resumed, out[-4000:])
    assert resumed == sorted(resumed) and resumed[0] >= 1, resumed
    _assert_equals_whole(tmp_path / "killed", whole / mode, fsdp)


@pytest.mark.timeout(600)
def test_max_restarts_with_resume_auto_survives_a_killed_rank(
    whole: Path, tmp_path: Path
) -> None:
    agent = _launch(tmp_path, "restarted",
                    [*DDP, "--checkpoint-every", "10", "--resume", "auto"], restarts=1)
    run = tmp_path / "restarted"
    wait_until(lambda: epochs_written(run) > 2 and len(_workers(agent)) == 2, timeout=240,
               what="epoch 2", alive=lambda: agent.poll() is None)
    time.sleep(0.3)
    _workers(agent)[1].send_signal(signal.SIGKILL)
    _, err = agent.communicate(timeout=480)
    assert agent.returncode == 0, err[-4000:]
    assert "Signals.SIGKILL" in err or "-9" in err, err[-4000:]  # torchrun saw the kill
    _assert_equals_whole(run, whole / "ddp", fsdp=False)


def _can_mount_tmpfs() -> str | None:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt 2>&1 || "
                            "mount -t tmpfs -o size=1m tmpfs /tmp 2>&1"],
                           capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else (probe.stderr or probe.stdout).strip()


def _in_namespace(tmp_path: Path, size: int, steps: list[tuple[str, list[str]]]) -> Path:
    """Runs ``steps`` on a tmpfs of ``size`` bytes mounted at ``tmp_path/disk`` in a user and
    mount namespace (no privileges needed): each is ``("run NAME", torchrun args)``,
    ``("copy NAME", [])`` (the run folder to ``out/NAME``) or ``("mount OPTIONS", [])``.
    Returns ``out``: ``NAME.err`` and ``NAME.rc`` of each run, the copies."""
    if shutil.which("unshare") is None or (why := _can_mount_tmpfs()) is not None:
        pytest.skip(f"needs a tmpfs mounted in a user namespace (unshare -Urm): {why}")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    lines = [f"mount -t tmpfs -o size={size} tmpfs {disk} || exit 9"]
    for what, args in steps:
        verb, name = what.split(" ", 1)
        if verb == "run":
            command = " ".join(_command(disk, "r", args))
            lines.append(f"{command} > {out}/{name}.out 2> {out}/{name}.err; "
                         f"echo $? > {out}/{name}.rc")
        elif verb == "copy":
            lines.append(f"cp -a {disk}/r {out}/{name} || exit 9")
        else:
            lines.append(f"mount -o remount,{name} {disk} || exit 9")
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                    "\n".join(lines)], env=_env(), check=True, timeout=560)
    return out


def _failed_with_one_line(out: Path, name: str, reason: str, file: str) -> None:
    """Run ``name`` failed: rank 0 exited 4 first, with one line naming ``file``."""
    err = (out / f"{name}.err").read_text()
    assert (out / f"{name}.rc").read_text().strip() != "0", err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("kaisa-train: ")]
    assert len(ours) == 1 and reason in ours[0] and file in ours[0], err[-3000:]
    cause = err[err.index("Root Cause"):]  # torchrun's summary: the first rank to exit
    assert "rank      : 0" in cause and "exitcode  : 4" in cause, err[-3000:]
    assert "]: Traceback" not in err, err[-3000:]  # no rank's traceback


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoint(
    mode: str, whole: Path, tmp_path: Path
) -> None:
    """The run folder on a tmpfs that holds one checkpoint but not two (a save writes the
    new one beside the previous): the second save fails on every rank; after the tmpfs
    grows, ``--resume`` continues from the first and ends equal to the uninterrupted run."""
    fsdp, args = mode == "fsdp", FSDP if mode == "fsdp" else DDP
    saved = whole / mode / ("checkpoint.dcp" if fsdp else "checkpoint.pt")
    size = sum(p.stat().st_size for p in saved.iterdir()) if fsdp else saved.stat().st_size
    out = _in_namespace(tmp_path, int(size * 1.5) + 65536, [
        ("run first", [*args, "--checkpoint-every", "1"]), ("copy after", []),
        ("mount size=256m", []), ("run again", [*args, "--resume"]), ("copy final", [])])
    _failed_with_one_line(out, "first", "No space left on device", saved.name)
    assert not list((out / "after").glob("*.partial")), list((out / "after").iterdir())
    assert _steps(out / "after", fsdp) == 1
    assert (out / "again.rc").read_text().strip() == "0", (out / "again.err").read_text()[-3000:]
    _assert_equals_whole(out / "final", whole / mode, fsdp)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_read_only_run_folder_is_one_line_and_touches_nothing(
    mode: str, whole: Path, tmp_path: Path
) -> None:
    fsdp, args = mode == "fsdp", FSDP if mode == "fsdp" else DDP
    out = _in_namespace(tmp_path, 256 << 20, [
        ("run first", [*args, "--epochs", "1"]), ("copy before", []), ("mount ro", []),
        ("run refused", [*args, "--resume"]), ("copy after", []), ("mount rw", []),
        ("run again", [*args, "--resume"]), ("copy final", [])])
    assert (out / "first.rc").read_text().strip() == "0", (out / "first.err").read_text()[-3000:]
    _failed_with_one_line(out, "refused", "Read-only file system", "metrics.jsonl")
    for before in (out / "before").rglob("*"):
        if before.is_file():
            assert before.read_bytes() == (out / "after" / before.relative_to(
                out / "before")).read_bytes(), before
    assert (out / "again.rc").read_text().strip() == "0", (out / "again.err").read_text()[-3000:]
    _assert_equals_whole(out / "final", whole / mode, fsdp)
