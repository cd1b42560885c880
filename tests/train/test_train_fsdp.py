"""``kaisa-train --fsdp``: the GPT sharded by FSDP2 under torchrun (gloo, 127.0.0.1).

* fast: 2 ranks, ``adamw+kfac`` and ``kfac`` (``kaisa.KFAC``) in one run; one epoch,
  ``--resume`` to two, equals two uninterrupted epochs bit for bit (every tensor of the
  final DCP checkpoint: weights, AdamW moments, K-FAC factors and decompositions, KFAC's
  velocity, its first-order AdamW's moments and its sampler's state; the metrics);
  refusals (kaisa.KFAC with ``--kfac-jvp double_backward``, no torchrun, a
  ``--replicate`` that does not divide the world, a DDP checkpoint under ``--fsdp``).
* slow: EKFAC and plain SGD likewise; a checkpoint of 2 ranks resumed at 1 rank; HSDP
  (``--replicate 2`` at 4 ranks) equals the 1-D mesh of 4 up to float rounding; ``--fsdp``
  with ``--accumulation-steps 2`` equals DDP up to float rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kaisa.train.cli import main
from tests.support.torchrun import torchrun

pytestmark = pytest.mark.distributed

TINY = ["--task", "lm", "--d-model", "32", "--context", "16", "--steps-per-epoch", "3",
        "--eval-windows", "16", "--text-bytes", "20000", "--batch-size", "4", "--quiet",
        "--no-plot"]


def _torchrun(ranks: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(ranks, ["--run-dir", str(tmp_path), *TINY, *args],
                    log_dir=tmp_path / "stderr")


def _records(run: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("type") != "settings"]


def _losses(run: Path, config: str) -> list[tuple[int, int, float | None, float]]:
    return [(r["epoch"], r["step"], r.get("train_loss"), r["test_loss"])
            for r in _records(run) if r["config"] == config]


def _checkpoint(path: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint directory, read in one process."""
    out = path.with_suffix(".pt")
    dcp_to_torch_save(path, out)
    state: dict[str, Any] = torch.load(out, weights_only=False)
    return state


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


def _split_equals_whole(tmp_path: Path, configs: str, name: str) -> None:
    """1 epoch, ``--resume`` to 2, vs 2 epochs: the checkpoints and metrics are equal."""
    common = ["--fsdp", "--compare", configs]
    _torchrun(2, tmp_path, *common, "--name", f"{name}-split", "--epochs", "1")
    _torchrun(2, tmp_path, *common, "--name", f"{name}-split", "--epochs", "2", "--resume")
    _torchrun(2, tmp_path, *common, "--name", f"{name}-whole", "--epochs", "2")
    split, whole = tmp_path / f"{name}-split", tmp_path / f"{name}-whole"
    for config in configs.split(","):
        suffix = "" if "," not in configs else f"-{config}"
        saved = [_checkpoint(run / f"checkpoint{suffix}.dcp") for run in (split, whole)]
        assert set(saved[0]) >= {"model", "optim"}
        _assert_equal(saved[0], saved[1], config)
        state = torch.load(split / f"checkpoint{suffix}.dcp" / "trainer.pt", weights_only=True)
        assert state["epoch"] == 2 and state["steps"] == 6
        assert _losses(split, config) == _losses(whole, config)
        assert len(_losses(split, config)) == 3


@pytest.mark.timeout(300)
def test_fsdp_resume_is_bit_exact(tmp_path: Path) -> None:
    """AdamW + ``KFACPreconditioner``, and ``kaisa.KFAC`` (adaptive lr, momentum and
    damping; a closure per step), one after the other in each run."""
    _split_equals_whole(tmp_path, "adamw+kfac,kfac", "k")
    saved = _checkpoint(tmp_path / "k-split" / "checkpoint-kfac.dcp")
    assert "generator" in saved["kfac"] and saved["optim"]["first_order"]["state"]
    assert all("velocity" in v for v in saved["optim"]["state"].values())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_resume_is_bit_exact_for_ekfac_and_sgd(tmp_path: Path) -> None:
    _split_equals_whole(tmp_path, "sgd,ekfac", "e")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_checkpoint_of_two_ranks_resumes_at_one(tmp_path: Path) -> None:
    """What holds at another world size: the history up to the checkpoint is replayed
    unchanged, the step count and the schedule continue, the run trains on (the data
    order and the sums are those of 1 rank, so later values differ from 2 ranks')."""
    common = ["--fsdp", "--kfac", "--optimizer", "adamw", "--name", "w"]
    _torchrun(2, tmp_path, *common, "--epochs", "1")
    before = _losses(tmp_path / "w", "adamw+kfac")
    result = _torchrun(1, tmp_path, *common, "--epochs", "3", "--resume")
    after = _losses(tmp_path / "w", "adamw+kfac")
    assert after[:2] == before and [e for e, *_ in after] == [0, 1, 2, 3]
    assert [s for _, s, *_ in after] == [0, 3, 6, 9]
    assert after[-1][3] < after[1][3], after  # it keeps learning
    state = torch.load(tmp_path / "w" / "checkpoint.dcp" / "trainer.pt", weights_only=True)
    assert state["settings"]["world_size"] == 1 and "final test_loss" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_hsdp_replicate_equals_the_one_dimensional_mesh(tmp_path: Path) -> None:
    """``--replicate 2`` at 4 ranks (a 2 x 2 mesh: 2 replicas, each sharded over 2 ranks)
    trains as the 1-D mesh of 4 ranks does (the same data; float rounding apart)."""
    common = ["--fsdp", "--kfac", "--optimizer", "adamw", "--epochs", "2"]
    _torchrun(4, tmp_path, *common, "--name", "flat")
    _torchrun(4, tmp_path, *common, "--replicate", "2", "--name", "hsdp")
    flat, hsdp = (_losses(tmp_path / n, "adamw+kfac") for n in ("flat", "hsdp"))
    assert [r[:2] for r in flat] == [r[:2] for r in hsdp] and len(flat) == 3
    for a, b in zip(flat, hsdp, strict=True):
        assert b[3] == pytest.approx(a[3], rel=1e-5, abs=1e-6)
    summary = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    assert summary["settings"]["adamw+kfac"]["replicate"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_with_accumulation_equals_ddp(tmp_path: Path) -> None:
    """``--fsdp`` trains as DDP does (the same data and steps; float rounding apart), also
    with 2 micro-batches a step (under FSDP2 each one reduce-scatters its gradients)."""
    common = ["--kfac", "--optimizer", "adamw", "--epochs", "2", "--accumulation-steps", "2"]
    _torchrun(2, tmp_path, *common, "--name", "ddp")
    _torchrun(2, tmp_path, *common, "--fsdp", "--name", "fsdp")
    ddp, fsdp = (_losses(tmp_path / n, "adamw+kfac") for n in ("ddp", "fsdp"))
    assert [r[:2] for r in ddp] == [r[:2] for r in fsdp] == [(0, 0), (1, 3), (2, 6)]
    for a, b in zip(ddp, fsdp, strict=True):
        assert b[3] == pytest.approx(a[3], rel=1e-5, abs=1e-6)


# --- refusals --------------------------------------------------------------------------


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.timeout(120)
def test_fsdp_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["--run-dir", str(tmp_path), *TINY, "--epochs", "1"]
    err = _refused([*base, "--fsdp", "--kfac"], capsys)
    assert "--fsdp needs torchrun" in err
    assert "--replicate needs --fsdp" in _refused([*base, "--replicate", "2"], capsys)
    classify = ["--run-dir", str(tmp_path), "--task", "classify", "--fsdp"]
    assert "--fsdp shards the GPT of --task lm" in _refused(classify, capsys)
    ports = iter(range(29_500 + os.getpid() % 500 * 10, 65_000))

    def one_rank(argv: list[str]) -> int:
        """``main`` in a one-process gloo group, as torchrun --nproc_per_node=1 starts it."""
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(next(ports)))):
            monkeypatch.setenv(key, value)
        try:
            return main(argv)
        except SystemExit as exit_info:
            return int(str(exit_info.code))

    jvp = ["--fsdp", "--compare", "sgd,kfac", "--kfac-jvp", "double_backward"]
    assert one_rank([*base, *jvp]) == 2
    assert "needs --kfac-jvp forward" in capsys.readouterr().err
    assert one_rank([*base, "--fsdp", "--replicate", "2"]) == 2
    assert "must divide the number of processes (1)" in capsys.readouterr().err
    # a checkpoint resumed with --fsdp changed: exit 3, one line, nothing touched
    for name, flag in (("ddp", []), ("fsdp", ["--fsdp"])):
        assert one_rank([*base, "--name", name, *flag]) == 0
        run = tmp_path / name
        before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
        capsys.readouterr()
        toggled = [] if flag else ["--fsdp"]
        assert one_rank([*base, "--name", name, "--epochs", "2", "--resume", *toggled]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"written by a run {'with' if flag else 'without'} --fsdp" in err[0]
        assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
