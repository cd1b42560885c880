"""kaisa-train on a shared cluster, one process: step-level checkpoints, ``--keep``, stop
signals (SIGTERM at random steps, a second signal, the grace time) and ``--resume``
continuing mid-epoch bit for bit. The distributed cases: ``test_preemption_distributed.py``."""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kaisa.train import checkpoint
from kaisa.train.cli import main
from kaisa.train.preemption import EXIT_STOPPED, Every, parse_every, parse_signals
from tests.train.preempt_support import (
    assert_same,
    epochs_written,
    learned_state,
    records,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
#: On ``PYTHONPATH`` with ``KAISA_TEST_MIN_STEP_SECONDS``: steps no faster than that.
PACE = ROOT / "tests" / "support" / "paceshim"

#: Every product and the first-order baselines, on the digits CNN: 12 micro-batches of 128
#: per epoch, so a checkpoint every 5 steps falls inside epochs.
COMPARE = "sgd,sgd+kfac,kfac,ekfac"
BASE = ["--quiet", "--no-plot", "--task", "classify", "--batch-size", "128"]


def _run(tmp_path: Path, name: str, *extra: str) -> int:
    return main(["--run-dir", str(tmp_path), "--name", name, *BASE, *extra])


# --- parsing ---------------------------------------------------------------------------------


def test_checkpoint_every_and_signal_lists_parse_or_say_why() -> None:
    assert parse_every("500") == Every(steps=500) and parse_every("7 steps") == Every(steps=7)
    assert parse_every("30m") == Every(seconds=1800.0) == parse_every("30min")
    assert parse_every("1.5h") == Every(seconds=5400.0) and parse_every("90s").seconds == 90
    assert str(Every()) == "epoch" and str(Every(steps=5)) == "5 steps"
    for bad in ("0", "-3", "2.5", "soon", "5 parsecs", "0m"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_every(bad)
    assert parse_signals("TERM,usr1,SIGTERM") == ("SIGTERM", "SIGUSR1")
    assert parse_signals("none") == ()
    for bad in ("KILL", "STOP", "NOPE"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a signal"):
            parse_signals(bad)


@pytest.mark.parametrize("argv", [["--checkpoint-every", "0"], ["--keep", "0"],
                                  ["--stop-signals", "KILL"], ["--grace", "-1"],
                                  ["--resume", "always"]])
def test_bad_checkpoint_flags_exit_2_with_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--run-dir", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kaisa-train: error: argument"), err


# --- step-level checkpoints and --keep ---------------------------------------------------------


def test_keep_prunes_to_the_newest_and_hard_links(tmp_path: Path) -> None:
    latest = tmp_path / "checkpoint.pt"
    for steps in (5, 10, 15, 20):
        latest.write_bytes(str(steps).encode())
        checkpoint.retain(latest, steps, keep=3)
    kept = sorted(p.name for p in tmp_path.glob("checkpoint.step*.pt"))
    assert kept == [f"checkpoint.step{s:09d}.pt" for s in (10, 15, 20)]
    assert (tmp_path / kept[-1]).stat().st_ino == latest.stat().st_ino  # no bytes copied
    directory = tmp_path / "checkpoint.dcp"
    directory.mkdir()
    (directory / "a").write_text("x")
    checkpoint.retain(directory, 7, keep=2)
    assert (tmp_path / "checkpoint.step000000007.dcp" / "a").read_text() == "x"
    checkpoint.retain(latest, 25, keep=1)  # keep 1: nothing more is kept
    assert not (tmp_path / "checkpoint.step000000025.pt").exists()


@pytest.mark.timeout(300)
def test_resume_from_inside_an_epoch_is_bit_exact_for_every_product(tmp_path: Path) -> None:
    """Two epochs with a checkpoint every 5 steps, all kept; each configuration resumed from
    its mid-epoch checkpoint of step 5 (epoch 1) and of step 15 (epoch 2), to the end, equals
    the uninterrupted run: weights, optimizer, K-FAC state, schedule, RNG, every metric."""
    whole = ["--compare", COMPARE, "--epochs", "2", "--checkpoint-every", "5", "--keep", "10"]
    assert _run(tmp_path, "whole", *whole) == 0
    done = tmp_path / "whole"
    slugs = [p.name.removeprefix("checkpoint-").removesuffix(".pt")
             for p in sorted(done.glob("checkpoint-*.pt")) if ".step" not in p.name]
    assert len(slugs) == len(COMPARE.split(","))
    for steps in (5, 15):
        split = tmp_path / f"split{steps}"
        split.mkdir()
        for slug in slugs:
            kept = done / f"checkpoint-{slug}.step{steps:09d}.pt"
            state = torch.load(kept, weights_only=True)
            assert state["position"] is not None and state["steps"] == steps, slug
            shutil.copy(kept, split / f"checkpoint-{slug}.pt")
        assert _run(tmp_path, split.name, *whole[:4], "--resume") == 0
        for slug in slugs:
            assert_same(learned_state(split / f"checkpoint-{slug}.pt"),
                        learned_state(done / f"checkpoint-{slug}.pt"), f"{slug}@{steps}")
        assert records(split) == records(done)


@pytest.mark.timeout(300)
def test_resume_from_inside_an_epoch_continues_the_augmentation_generator(
    tmp_path: Path,
) -> None:
    """``--augment`` draws each epoch's crops and flips from one generator: resumed from its
    mid-epoch checkpoints of step 5 (epoch 1) and of step 15 (epoch 2), the run continues
    that generator where it stopped and equals the uninterrupted run bit for bit (restarting
    it at the epoch's seed would augment the rest of the epoch differently)."""
    common = ["--kfac", "--augment", "--epochs", "2"]
    assert _run(tmp_path, "whole", *common, "--checkpoint-every", "5", "--keep", "10") == 0
    done = tmp_path / "whole"
    for steps in (5, 15):
        kept = done / f"checkpoint.step{steps:09d}.pt"
        state = torch.load(kept, weights_only=True)
        assert state["settings"]["augment"] is True and state["steps"] == steps
        assert state["position"] is not None and state["position"]["index"] > 0
        split = tmp_path / f"split{steps}"
        split.mkdir()
        shutil.copy(kept, split / "checkpoint.pt")
        assert _run(tmp_path, split.name, *common, "--resume") == 0
        assert_same(learned_state(split / "checkpoint.pt"), learned_state(done / "checkpoint.pt"),
                    f"@{steps}")
        assert records(split) == records(done)


def test_checkpoint_every_time_writes_inside_epochs(tmp_path: Path) -> None:
    """``--checkpoint-every 0.2s`` on epochs of ~0.5 s: checkpoints inside epochs too (each
    resumable mid-epoch), besides the epochs' own."""
    assert _run(tmp_path, "timed", "--kfac", "--epochs", "3", "--batch-size", "32",
                "--checkpoint-every", "0.2s", "--keep", "1000") == 0
    kept = sorted((tmp_path / "timed").glob("checkpoint.step*.pt"))
    inside = [p for p in kept if torch.load(p, weights_only=True)["position"] is not None]
    assert len(kept) > 3 and inside, [p.name for p in kept]


# --- stop signals ------------------------------------------------------------------------------


def _spawn(tmp_path: Path, name: str, *extra: str,
           min_step_seconds: float = 0.0) -> subprocess.Popen[str]:
    """``kaisa-train`` in a subprocess, each optimizer step lasting ``min_step_seconds``
    or more (so that a signal sent at a wall-clock moment lands inside the run)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACE), str(ROOT)]),
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path),
           "KAISA_TEST_MIN_STEP_SECONDS": str(min_step_seconds)}
    return subprocess.Popen(
        [sys.executable, "-m", "kaisa.train", "--run-dir", str(tmp_path), "--name", name,
         *BASE, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kaisa-train: "), err
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_at_five_random_steps_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """SIGTERM (or SIGUSR1) at a random moment of 5 epochs: each time exit 75 within the
    grace time, one line naming the checkpoint and the step it stopped at, which that
    checkpoint holds (mid-epoch unless the step ended an epoch); the resumed chain equals
    one run."""
    common = ["--kfac", "--epochs", "8", "--batch-size", "32"]  # 45 steps an epoch
    assert _run(tmp_path, "whole", *common) == 0
    per_epoch = records(tmp_path / "whole")[1]["step"]
    rng = random.Random(45)
    stops: list[int] = []
    for attempt, epoch in enumerate(sorted(rng.sample(range(1, 8), 5))):
        # 45 steps of 10 ms or more: an epoch outlasts the 0.3 s wait below on any machine
        run = _spawn(tmp_path, "split", *common, *(["--resume"] if attempt else []),
                     min_step_seconds=0.01)
        wait_until(lambda e=epoch: epochs_written(tmp_path / "split") > e, timeout=120,
                   what=f"epoch {epoch}", alive=lambda r=run: r.poll() is None)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the next epoch
        sent = time.monotonic()
        run.send_signal(signal.SIGUSR1 if attempt == 2 else signal.SIGTERM)
        _, err = run.communicate(timeout=60)
        assert run.returncode == EXIT_STOPPED, err
        assert time.monotonic() - sent < 25.0
        line = _one_line(err)
        assert "--resume" in line and str(tmp_path / "split" / "checkpoint.pt") in line, line
        # the checkpoint is the one of the step the line names, not an older epoch's
        stopped = re.search(r"\bat step (\d+) \(epoch (\d+)\)", line)
        assert stopped is not None, line
        step, in_epoch = int(stopped[1]), int(stopped[2])
        state = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
        assert state["steps"] == step, (line, state["steps"])
        inside = state["position"] is not None  # else at the end of the epoch it names
        assert inside == (step % per_epoch != 0), (line, state["position"])
        assert state["epoch"] == in_epoch - int(inside) and in_epoch == -(-step // per_epoch), line
        stops.append(step)
        assert not list((tmp_path / "split").glob("*.partial"))
    assert stops == sorted(stops) and len(set(stops)) == 5, stops
    assert _run(tmp_path, "split", *common, "--resume") == 0
    assert_same(learned_state(tmp_path / "split" / "checkpoint.pt"),
                learned_state(tmp_path / "whole" / "checkpoint.pt"))
    assert records(tmp_path / "split") == records(tmp_path / "whole")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_signal_or_the_grace_time_stops_at_once_keeping_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The grace time running out before the checkpoint, and a second, different stop
    signal: exit 128 + signal at once, one line, the last whole checkpoint resumable."""
    common = ["--kfac", "--epochs", "100"]
    for name, extra in (("grace", ["--grace", "0.001"]), ("twice", ["--grace", "600"])):
        run = _spawn(tmp_path, name, *common, *extra)
        wait_until(lambda n=name: epochs_written(tmp_path / n) > 1, timeout=120,
                   what="epoch 1", alive=lambda r=run: r.poll() is None)
        if name == "grace":
            run.send_signal(signal.SIGTERM)
        else:  # held, so that both arrive together: USR1 is handled first, TERM second
            run.send_signal(signal.SIGSTOP)
            run.send_signal(signal.SIGTERM)
            run.send_signal(signal.SIGUSR1)
            run.send_signal(signal.SIGCONT)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 128 + signal.SIGTERM, err
        line = _one_line(err)
        assert ("--grace" in line) == (name == "grace") and "last complete checkpoint" in line
        state = checkpoint.load(tmp_path / name / "checkpoint.pt", torch.device("cpu"))
        assert state["steps"] > 0
        assert _run(tmp_path, name, "--kfac", "--epochs", str(state["epoch"] + 1),
                    "--resume") == 0
