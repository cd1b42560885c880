"""The planner's command in its short form (what CI runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisa.plan.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench" / "results" / "gpu-nvidia-h100-80gb-hbm3-2026-11-27.json"


def tiny() -> tuple[nn.Module, torch.Tensor]:
    """A ``module:callable`` model for ``--model`` (built under the meta device)."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), torch.empty(4, 32)


def test_short_form_resnet50(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, out = tmp_path / "curves.png", tmp_path / "plan.json"
    assert main(["--model", "resnet50", "--world", "8,64", "--profile", str(PROFILE),
                 "--memory-budget-mb", "2000", "--plot", str(plot), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "COMM-OPT" in text and "MEM-OPT" in text and "recommended" in text
    assert "world 64: grad_worker_fraction=" in text
    assert plot.stat().st_size > 1000
    data = json.loads(out.read_text())
    rows = data["models"]["resnet50"]["rows"]
    assert {r["world_size"] for r in rows} == {8, 64}
    assert len(rows) == 4 + 7  # the valid fractions of 8 and 64


def test_module_callable_and_microbenchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tests.plan.test_cli:tiny", "--world", "2,4",
                 "--network", "1x1Gb/s@100us"]) == 0
    text = capsys.readouterr().out
    assert "microbenchmark" in text and "tests.plan.test_cli:tiny: 2 K-FAC blocks" in text
