"""``kaisa-train --optimizer kfac-muon``: kaisa.KFACMuon in the training app."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from kaisa.train import sharded
from kaisa.train.cli import main
from kaisa.train.options import build_parser


def _args(tmp_path: Path, *extra: str) -> list[str]:
    """The digits autoencoder, 6 steps per epoch (as tests/train/test_train.py)."""
    return ["--run-dir", str(tmp_path), "--quiet", "--no-plot", "--batch-size", "256",
            "--epochs", "1", *extra]


def _lm_args(tmp_path: Path, *extra: str) -> list[str]:
    """The tiniest byte GPT (as tests/train/test_gpt.py)."""
    return [
        "--run-dir", str(tmp_path), "--quiet", "--task", "lm", "--no-plot",
        "--steps-per-epoch", "2", "--context", "16", "--d-model", "16", "--batch-size", "4",
        "--text-bytes", "60000", "--eval-windows", "8", "--epochs", "1", *extra,
    ]


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _records(path: Path) -> list[dict[str, object]]:
    """Epoch records of metrics.jsonl (its head holds one settings line per configuration)."""
    return [r for r in _lines(path) if r.get("type") != "settings"]


@pytest.mark.parametrize("curvature", ["input", "eigen"])
def test_kfac_muon_trains_and_writes_metrics(tmp_path: Path, curvature: str) -> None:
    assert main(_args(tmp_path, "--name", "m", "--optimizer", "kfac-muon", "--epochs", "2",
                      "--kfac-muon-curvature", curvature)) == 0
    run = tmp_path / "m"
    settings = _lines(run / "metrics.jsonl")[0]["settings"]
    assert isinstance(settings, dict)
    assert settings["optimizer"] == "kfac-muon" and settings["kfac_muon_curvature"] == curvature
    # the generic Muon lr; the rest takes the task's AdamW lr
    assert settings["lr"] == 0.02 and settings["kfac_muon_adamw_lr"] == 3e-3
    records = _records(run / "metrics.jsonl")
    assert [(r["config"], r["epoch"]) for r in records] == [("kfac-muon", e) for e in (0, 1, 2)]
    assert records[-1]["step"] == 12 and records[-1]["lr"] == 0.02
    assert set(records[-1]["kfac"]) >= {"factors", "decompositions"}  # type: ignore[arg-type]
    assert records[-1]["train_mse"] < records[0]["train_mse"]  # type: ignore[operator]
    assert "| kfac-muon |" in (run / "table.md").read_text()
    state = torch.load(run / "checkpoint.pt", weights_only=True)["optimizer"]
    assert state["kaisa"]["steps"] == 12 and state["kaisa"]["layers"]
    muon, adamw = state["param_groups"]  # the autoencoder's weights, then its biases
    assert muon["use_muon"] and muon["lr"] == 0.02
    assert not adamw["use_muon"] and adamw["lr"] == 3e-3


def test_lm_compare_with_kfac_muon(tmp_path: Path) -> None:
    assert main(_lm_args(tmp_path, "--name", "lm", "--compare",
                         "adamw,kfac-muon@muon-curvature=eigen")) == 0
    run = tmp_path / "lm"
    records = _records(run / "metrics.jsonl")
    label = "kfac-muon@muon-curvature=eigen"
    assert [(r["config"], r["epoch"]) for r in records] == [
        ("adamw", 0), ("adamw", 1), (label, 0), (label, 1)
    ]
    assert records[0]["test_loss"] == pytest.approx(records[2]["test_loss"], rel=1e-6)
    assert records[3]["step"] == 2
    assert records[3]["test_loss"] < records[2]["test_loss"]  # type: ignore[operator]
    settings = json.loads((run / "summary.json").read_text())["settings"][label]
    assert settings["lr"] == 0.05 and settings["kfac_muon_adamw_lr"] == 3e-3
    assert settings["kfac_muon_curvature"] == "eigen"
    state = torch.load(run / "checkpoint-kfac-muon_muon-curvature=eigen.pt",
                       weights_only=True)["optimizer"]
    # Muon takes the four matrices of each of the 4 blocks; the tied embedding/head AdamW
    assert all(name.startswith("blocks.") for name in state["kaisa"]["layers"])
    muon, adamw = state["param_groups"]
    assert muon["use_muon"] and len(muon["params"]) == 16 and muon["lr"] == 0.05
    assert not adamw["use_muon"] and adamw["lr"] == 3e-3


def test_kfac_muon_resumes_bit_exactly(tmp_path: Path) -> None:
    common = ["--optimizer", "kfac-muon", "--kfac-muon-curvature", "eigen",
              "--kfac-inv-update-steps", "4", "--weight-decay", "0.01"]
    assert main(_args(tmp_path, *common, "--name", "split", "--epochs", "2")) == 0
    assert main(_args(tmp_path, *common, "--name", "split", "--epochs", "3", "--resume")) == 0
    assert main(_args(tmp_path, *common, "--name", "whole", "--epochs", "3")) == 0
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    assert split["epoch"] == whole["epoch"] == 3
    for key, value in whole["model"].items():
        assert torch.equal(split["model"][key], value), key
    assert split["optimizer"]["kaisa"]["steps"] == whole["optimizer"]["kaisa"]["steps"] == 18
    assert split["optimizer"]["kaisa"]["refreshes"] == whole["optimizer"]["kaisa"]["refreshes"]
    assert [r["epoch"] for r in _records(tmp_path / "split" / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--compare", "kfac-muon+kfac"], "OPTIMIZER[+kfac]"),
        (["--optimizer", "kfac-muon", "--kfac"], "K-FAC itself"),
        (["--optimizer", "kfac-muon", "--kfac-muon-curvature", "full"], "invalid choice"),
        (["--optimizer", "kfac-muon", "--kfac-decomposition-spread", "2"], "does not apply"),
        (["--compare", "kfac-muon@muon-adamw-lr=-1"], "kfac_muon_adamw_lr"),
    ],
)
def test_kfac_muon_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tmp_path, *argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_kfac_muon_is_refused_under_fsdp() -> None:
    config = argparse.Namespace(fsdp=True, optimizer="kfac-muon")
    why = sharded.check_config(config)
    assert why is not None and "does not run under --fsdp" in why
    assert sharded.check_config(argparse.Namespace(fsdp=False, optimizer="kfac-muon")) is None


def test_help_documents_the_kfac_muon_flags() -> None:
    text = build_parser().format_help()
    for flag in ("kfac-muon", "--kfac-muon-curvature", "--kfac-muon-adamw-lr"):
        assert flag in text
