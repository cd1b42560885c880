"""The main job's headline: time to the best first-order baseline's final metric (AlgoPerf)."""

import json
import math
import sys
from pathlib import Path

import pytest

from kaisa.train import report
from kaisa.train.cli import main
from kaisa.train.options import DEFAULT_COMPARE, build_parser
from kaisa.train.trainer import RunResult


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--run-dir", str(tmp_path), "--quiet", "--batch-size", "256", "--epochs", "1", *extra]


def _records(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r.get("type") != "settings"]


def _result(label: str, values: list[float], *, diverged: str | None = None) -> RunResult:
    history = [
        {"epoch": e, "step": 10 * e, "time": 0.5 * e, "test_mse": v, "test_acc": v}
        for e, v in enumerate(values)
    ]
    return RunResult(label=label, history=history, steps=10 * (len(values) - 1),
                     train_time=0.5 * (len(values) - 1), diverged=diverged)


def test_the_default_comparison_is_the_main_job_with_ekfac() -> None:
    assert DEFAULT_COMPARE.split(",") == ["sgd", "adamw", "kfac", "ekfac"]
    assert build_parser().parse_args(["--compare"]).compare == DEFAULT_COMPARE
    assert build_parser().parse_args(["--compare", "sgd"]).compare == "sgd"
    assert build_parser().parse_args([]).compare is None


def test_the_target_is_the_best_first_order_final_metric() -> None:
    mse = report.target_metric("autoencode")
    assert mse.key == "test_mse" and not mse.higher_is_better and mse.train_key == "train_mse"
    results = [
        _result("sgd", [0.5, 0.2, 0.1]),
        _result("adamw", [0.5, 0.05, 0.08]),  # best on the way, final 0.08: the target
        _result("kfac", [0.5, 0.01, 0.001]),  # not first-order: never the target
        _result("adamw@lr=1", [0.5, 0.01, 0.001], diverged="non-finite loss"),
    ]
    target = report.choose_target(results, mse, ["sgd", "adamw", "adamw@lr=1"])
    assert (target.value, target.baseline, target.epochs) == (0.08, "adamw", 2)
    assert target.baselines == ("sgd", "adamw")
    assert report.choose_target(results, mse, ["sgd"]).value == 0.1
    override = report.choose_target(results, mse, ["sgd"], override=0.3)
    assert override.value == 0.3 and override.baseline is None
    # no first-order configuration: the best final value of all
    assert report.choose_target(results[2:3], mse, []).baseline == "kfac"
    accuracy = report.target_metric("classify")
    assert report.choose_target(results[:2], accuracy, ["sgd", "adamw"]).value == 0.1
    rows = report.summary_rows(results[:3], mse, 0.08, "adamw")
    adamw, kfac = rows[1], rows[2]
    assert (adamw["epochs_to_target"], adamw["steps_to_target"], adamw["time_to_target"]) == (
        1, 10, 0.5)
    assert (adamw["best_test_mse"], adamw["best_epoch"], adamw["final_test_mse"]) == (
        0.05, 1, 0.08)
    assert kfac["cost_vs_baseline"] == pytest.approx(1.0) and rows[0]["time_to_target"] is None
    assert math.isnan(kfac["final_train_mse"])  # no train_mse in these histories
    lines = report.headline(rows, mse, target)
    assert lines[0].startswith("Target: test MSE 0.0800, the final value of adamw after 2")
    assert lines[1] == "Fastest to it: adamw: 0.50 s of training, 10 steps (epoch 1)."
    assert lines[2] == ("kfac: 0.50 s of training, 10 steps (epoch 1), 1.00x adamw's time "
                        "in 1.00x its steps at 1.00x its cost per step.")
    assert any(line.startswith("sgd: did not reach it") for line in lines)


def test_main_job_table_leads_with_time_to_the_baselines_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(tmp_path, "--name", "t", "--compare", "sgd,adamw,ekfac",
                      "--epochs", "3")) == 0
    run = tmp_path / "t"
    summary = json.loads((run / "summary.json").read_text())
    records = _records(run / "metrics.jsonl")
    finals = {c: [r for r in records if r["config"] == c][-1]["test_mse"]
              for c in ("sgd", "adamw")}
    baseline = min(finals, key=lambda c: finals[c])
    assert summary["metric"] == "test_mse" and summary["first_order"] == ["sgd", "adamw"]
    assert summary["target"] == finals[baseline] and summary["target_from"] == baseline
    for row in summary["configs"]:
        mine = [r for r in records if r["config"] == row["config"]]
        hit = next((r for r in mine if r["test_mse"] <= summary["target"]), None)
        if hit is None:
            assert row["time_to_target"] is None
        else:
            assert row["time_to_target"] == hit["time"]
            assert row["steps_to_target"] == hit["step"]
            assert row["epochs_to_target"] == hit["epoch"]
        trained = [r for r in mine if r["epoch"] > 0]
        best = min(trained, key=lambda r: float(r["test_mse"]))  # type: ignore[arg-type]
        assert row["best_epoch"] == best["epoch"] and row["best_test_mse"] == best["test_mse"]
        assert row["final_test_mse"] == trained[-1]["test_mse"]
        assert row["final_train_mse"] == trained[-1]["train_mse"]
    assert summary["configs"][[c["config"] for c in summary["configs"]].index(baseline)][
        "cost_vs_baseline"] == pytest.approx(1.0)
    table = (run / "table.md").read_text()
    first, second = table.splitlines()[:2]
    assert first.startswith(f"Target: test MSE {report.number(finals[baseline])}, the final "
                            f"value of {baseline} after 3 epochs")
    assert second.startswith("Fastest to it: ")
    header = next(line for line in table.splitlines() if line.startswith("| config"))
    assert header.startswith(
        f"| config | time to {report.number(finals[baseline])} (s) | steps to it")
    assert f"ms/iter vs {baseline}" in header and "best test_mse (epoch)" in header
    assert "| ekfac |" in table and first in capsys.readouterr().out
    assert (run / "comparison.png").stat().st_size > 0


def test_the_plot_has_two_panels_with_the_target_line() -> None:
    import matplotlib.pyplot as plt

    results = [_result("adamw", [0.5, 0.05, 0.08]), _result("kfac", [0.5, 0.01, 0.001])]
    fig = report.figure(results, report.target_metric("autoencode"), 0.08)
    try:
        assert len(fig.axes) == 2
        seconds, steps = fig.axes
        assert seconds.get_xlabel() == "training wall time (s)" and steps.get_xlabel() == "steps"
        for axis in fig.axes:  # the target: a horizontal line at 0.08
            assert any(list(line.get_ydata()) == [0.08, 0.08] for line in axis.get_lines())
    finally:
        plt.close(fig)


def test_one_progress_bar_spans_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["--run-dir", str(tmp_path), "--batch-size", "256", "--epochs", "2", "--name", "b",
            "--compare", "sgd,adamw", "--no-plot"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "all configurations" in captured.err and "4/4" in captured.err
    assert "[adamw] epoch   2/2" in captured.out  # the per-epoch lines stay
