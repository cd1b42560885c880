"""What the user sees: epoch lines, metrics.jsonl, the comparison plot and table."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kaisa.train.files import AppendFile, write_atomic
from kaisa.train.trainer import Record, RunResult


@dataclass(frozen=True)
class Metric:
    """The metric a task is judged by and its ``--target`` direction."""

    key: str
    title: str
    higher_is_better: bool

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` meets ``target``."""
        return value >= target if self.higher_is_better else value <= target


def target_metric(task: str, eval_train: bool) -> Metric:
    """Test accuracy (classify), validation loss (lm), full-train-set MSE (autoencode)."""
    if task == "classify":
        return Metric("test_acc", "test accuracy", True)
    if task == "lm":
        return Metric("test_loss", "validation loss (cross-entropy per byte)", False)
    if eval_train:
        return Metric("train_mse", "train MSE (full set, eval mode)", False)
    return Metric("test_mse", "test MSE", False)


def time_to_target(history: Sequence[Record], metric: Metric, target: float) -> Record | None:
    """First record whose metric meets ``target`` (None if never)."""
    for record in history:
        value = record.get(metric.key)
        if value is not None and not math.isnan(value) and metric.reached(value, target):
            return record
    return None


def read_metrics(path: Path) -> tuple[dict[str, dict[str, Any]], list[Record]]:
    """``metrics.jsonl`` as (settings by configuration, epoch records in file order)."""
    headers: dict[str, dict[str, Any]] = {}
    records: list[Record] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry.get("type") == "settings":
            headers[entry["config"]] = entry["settings"]
        else:
            records.append(entry)
    return headers, records


class MetricsFile:
    """The run's ``metrics.jsonl``.

    At its head one ``{"type": "settings"}`` line per configuration (every resolved
    option), then one JSON object per configuration and epoch. Only whole lines are
    ever written (:class:`kaisa.train.files.AppendFile`); on ``--resume`` the old file
    stays until the new one holds every record it had.
    """

    def __init__(self, *, path: Path) -> None:
        self.path = path
        self._file = AppendFile(path, is_header='{"type": "settings"')

    def write_header(self, label: str, settings: dict[str, Any]) -> None:
        """Write the resolved settings of configuration ``label``."""
        self._file.append(json.dumps({"type": "settings", "config": label, "settings": settings}))

    def write(self, record: Record) -> None:
        """Append ``record`` (NaNs become ``null``)."""
        clean = {
            k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()
        }
        self._file.append(json.dumps(clean))

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def abort(self) -> None:
        """Close after a failure (keeps an old file the new one has not caught up with)."""
        self._file.abort()


def epoch_line(record: Record, epochs: int) -> str:
    """One human-readable summary line for an epoch record."""
    parts = [f"[{record['config']}] epoch {record['epoch']:>3}/{epochs}", f"{record['time']:7.2f}s"]
    keys = ("train_loss", "train_mse", "train_acc", "test_loss", "test_mse", "test_acc")
    for key in (*keys, "test_bpb"):
        value = record.get(key)
        if value is not None and not math.isnan(value):
            parts.append(f"{key} {value:.4f}")
    parts.append(f"lr {record['lr']:.3g}")
    kfac = record.get("kfac")
    if kfac:
        split = "/".join(
            f"{kfac.get(k, 0.0):.2f}"
            for k in ("factors", "communication", "decompositions", "preconditioning")
        )
        parts.append(f"kfac f/c/d/p {split}s")
    return "  ".join(parts)


def summary_rows(
    results: Sequence[RunResult], metric: Metric, target: float
) -> list[dict[str, Any]]:
    """Per-configuration summary: time/epochs to target, best metric, s/iter."""
    rows = []
    for result in results:
        history = [r for r in result.history if r["epoch"] > 0] or result.history
        values = [r[metric.key] for r in history if r.get(metric.key) is not None]
        values = [v for v in values if not math.isnan(v)]
        best = (max if metric.higher_is_better else min)(values) if values else math.nan
        hit = time_to_target(result.history, metric, target)
        rows.append(
            {
                "config": result.label,
                "epochs": result.history[-1]["epoch"],
                "steps": result.steps,
                "train_time": result.train_time,
                "seconds_per_iter": result.train_time / max(1, result.steps),
                "time_to_target": hit["time"] if hit else None,
                "epochs_to_target": hit["epoch"] if hit else None,
                f"best_{metric.key}": best,
                f"final_{metric.key}": values[-1] if values else math.nan,
                "init_checksum": result.init_checksum,
                "diverged": result.diverged,
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, Any]], metric: Metric, target: float) -> str:
    """Markdown table of :func:`summary_rows`."""
    header = (
        f"| config | epochs | train time (s) | ms/iter | time to {target:g} (s) "
        f"| epochs to {target:g} | best {metric.key} | final {metric.key} |"
    )
    lines = [header, "|" + "---|" * 8]
    for row in rows:
        reach = f"{row['time_to_target']:.2f}" if row["time_to_target"] is not None else "-"
        epochs = str(row["epochs_to_target"]) if row["epochs_to_target"] is not None else "-"
        if row["diverged"]:
            reach = epochs = "diverged"
        lines.append(
            f"| {row['config']} | {row['epochs']} | {row['train_time']:.2f} "
            f"| {row['seconds_per_iter'] * 1e3:.2f} | {reach} | {epochs} "
            f"| {number(row[f'best_{metric.key}'])} | {number(row[f'final_{metric.key}'])} |"
        )
    return "\n".join(lines)


def number(value: float) -> str:
    """Four decimals, or scientific notation for huge, tiny or non-finite values."""
    if math.isnan(value):
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def plot(
    results: Sequence[RunResult], metric: Metric, target: float, task: str, path: Path
) -> None:
    """Save a 2x2 figure: test metric and train loss against wall time and epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test_key = {"classify": "test_acc", "lm": "test_loss"}.get(task, "test_mse")
    rows = [(test_key, test_key.replace("_", " ")), (_train_key(results, task), "")]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5), squeeze=False)
    for row, (key, title) in enumerate(rows):
        for column, x_key in enumerate(("time", "epoch")):
            axis = axes[row][column]
            for result in results:
                points = [(r[x_key], r[key]) for r in result.history if r.get(key) is not None]
                points = [(x, y) for x, y in points if not math.isnan(y)]
                if not points:
                    continue
                label = result.label + (" (diverged)" if result.diverged else "")
                (line,) = axis.plot(*zip(*points, strict=True), label=label)
                if result.diverged:  # where it stopped
                    axis.plot(*points[-1], marker="x", markersize=10, color=line.get_color())
                hit = time_to_target(result.history, metric, target)
                if hit is not None and key == metric.key:
                    axis.axvline(hit[x_key], color=line.get_color(), linestyle=":", alpha=0.8)
            if key == metric.key:
                axis.axhline(target, color="grey", linestyle="--", linewidth=0.8)
            if task == "autoencode" or key.endswith("loss"):
                axis.set_yscale("log")
            axis.set_xlabel("training wall time (s)" if x_key == "time" else "epoch")
            axis.set_ylabel(title or key.replace("_", " "))
            axis.grid(alpha=0.3)
    axes[0][0].legend()
    figure.suptitle(
        f"{task}: dotted lines mark reaching {metric.title} target {target:g}; "
        "x marks where a diverged configuration stopped"
    )
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_atomic(path, buffer.getvalue())


def _train_key(results: Sequence[RunResult], task: str) -> str:
    eval_key = "train_mse" if task == "autoencode" else "train_eval_loss"
    has_eval = any(r.get(eval_key) is not None for res in results for r in res.history)
    return eval_key if has_eval else "train_loss"
