"""What the user sees: epoch lines, metrics.jsonl, the comparison plot and table."""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kaisa.train.configs import settings
from kaisa.train.files import AppendFile, write_atomic
from kaisa.train.trainer import Record, RunResult

#: Optimizers that count as first-order baselines (without ``+kfac``): the target is the
#: best final validation metric among them (AlgoPerf's time to a baseline's target).
FIRST_ORDER: tuple[str, ...] = ("sgd", "adamw")


@dataclass(frozen=True)
class Metric:
    """The validation metric a task is judged by, and its direction.

    Attributes:
        key: Its key in the epoch records (``test_mse``, ``test_acc``, ``test_loss``).
        title: How the table and the plot name it.
        higher_is_better: Accuracy (True) or a loss (False).
        train_key: The training-set counterpart shown beside it (``train_mse``), if any.
    """

    key: str
    title: str
    higher_is_better: bool
    train_key: str | None = None

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` meets ``target``."""
        return value >= target if self.higher_is_better else value <= target

    def best_of(self, values: Sequence[float]) -> float:
        """The best of ``values`` (the largest or the smallest)."""
        return max(values) if self.higher_is_better else min(values)


def target_metric(task: str) -> Metric:
    """The validation metric: test accuracy (classify), validation loss (lm), test MSE.

    The digits and CIFAR-10 test sets are the validation sets (nothing is tuned on a
    separate split). For ``autoencode`` the full-training-set MSE is reported beside it.
    """
    if task == "classify":
        return Metric("test_acc", "test accuracy", True)
    if task == "lm":
        return Metric("test_loss", "validation loss (cross-entropy per byte)", False)
    return Metric("test_mse", "test MSE", False, train_key="train_mse")


@dataclass(frozen=True)
class Target:
    """The value every configuration's time is measured to.

    Attributes:
        value: The target (None: no configuration has a finite final metric).
        baseline: The configuration whose final metric it is (None with ``--target``).
        baselines: The first-order configurations it was chosen among (empty: none ran,
            and the best final metric of all configurations is used).
        epochs: Epochs the baseline ran.
    """

    value: float | None
    baseline: str | None = None
    baselines: tuple[str, ...] = ()
    epochs: int = 0


def _trained(history: Sequence[Record]) -> list[Record]:
    """The records after training began (epoch 0 is before; kept if it is all there is)."""
    return [r for r in history if r["epoch"] > 0] or list(history)


def _value(record: Record, key: str) -> float | None:
    value = record.get(key)
    return None if value is None or math.isnan(value) else float(value)


def final_value(history: Sequence[Record], key: str) -> float:
    """The metric ``key`` of the last record that has one (NaN if none)."""
    values = [v for r in _trained(history) if (v := _value(r, key)) is not None]
    return values[-1] if values else math.nan


def choose_target(
    results: Sequence[RunResult],
    metric: Metric,
    first_order: Sequence[str],
    override: float | None = None,
) -> Target:
    """AlgoPerf-style target: the best final validation metric of the first-order baselines.

    Args:
        results: Every configuration's outcome.
        metric: The validation metric.
        first_order: Labels of the first-order configurations (``sgd``, ``adamw``, ...).
        override: ``--target``, which replaces the baseline's value.

    Returns:
        The target; with no (undiverged) first-order configuration, the best final metric
        of all configurations.
    """
    if override is not None:
        return Target(override, baselines=tuple(first_order))
    alive = [r for r in results if not r.diverged and r.history]
    pool = [r for r in alive if r.label in first_order] or alive
    finals = [(final_value(r.history, metric.key), r) for r in pool]
    finals = [(v, r) for v, r in finals if not math.isnan(v)]
    if not finals:
        return Target(None, baselines=tuple(first_order))
    best = metric.best_of([v for v, _ in finals])
    result = next(r for v, r in finals if v == best)
    chosen = tuple(r.label for r in pool if r.label in first_order)
    return Target(best, result.label, chosen, _trained(result.history)[-1]["epoch"])


def time_to_target(
    history: Sequence[Record], metric: Metric, target: float | None
) -> Record | None:
    """First record whose metric meets ``target`` (None if never, or no target)."""
    if target is None:
        return None
    for record in history:
        value = _value(record, metric.key)
        if value is not None and metric.reached(value, target):
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
    results: Sequence[RunResult], metric: Metric, target: float | None,
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Per configuration: steps, epochs and seconds to ``target``, cost per step, metrics.

    ``cost_vs_baseline`` is the seconds per step over those of ``baseline`` (a label).
    """
    per_step = {r.label: r.train_time / max(1, r.steps) for r in results}
    rows = []
    for result in results:
        history = _trained(result.history)
        values = [(v, r["epoch"]) for r in history if (v := _value(r, metric.key)) is not None]
        best = metric.best_of([v for v, _ in values]) if values else math.nan
        hit = time_to_target(result.history, metric, target)
        base = per_step.get(baseline) if baseline is not None else None
        row: dict[str, Any] = {
            "config": result.label,
            "time_to_target": hit["time"] if hit else None,
            "steps_to_target": hit.get("step") if hit else None,
            "epochs_to_target": hit["epoch"] if hit else None,
            "seconds_per_iter": per_step[result.label],
            "cost_vs_baseline": per_step[result.label] / base if base else None,
            f"final_{metric.key}": values[-1][0] if values else math.nan,
            f"best_{metric.key}": best,
            "best_epoch": next((e for v, e in values if v == best), None),
            "epochs": result.history[-1]["epoch"],
            "steps": result.steps,
            "train_time": result.train_time,
            "init_checksum": result.init_checksum,
            "diverged": result.diverged,
        }
        if metric.train_key is not None:
            row[f"final_{metric.train_key}"] = final_value(result.history, metric.train_key)
        rows.append(row)
    return rows


def format_table(
    rows: Sequence[dict[str, Any]], metric: Metric, target: float | None,
    baseline: str | None = None,
) -> str:
    """Markdown table of :func:`summary_rows`, led by the time to ``target``."""
    key, train = metric.key, metric.train_key
    goal = "target" if target is None else number(target)
    columns = [
        "config", f"time to {goal} (s)", "steps to it", "epochs to it", "ms/iter",
        f"ms/iter vs {baseline}" if baseline else "ms/iter vs baseline",
        f"final {key}", f"best {key} (epoch)", *([f"final {train}"] if train else []),
        "epochs", "train time (s)",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        reach = [
            "-" if row[name] is None else (f"{row[name]:.2f}" if name == "time_to_target"
                                           else str(row[name]))
            for name in ("time_to_target", "steps_to_target", "epochs_to_target")
        ]
        if row["diverged"] and row["time_to_target"] is None:
            reach = ["diverged"] * 3
        ratio = "-" if row["cost_vs_baseline"] is None else f"{row['cost_vs_baseline']:.2f}x"
        best = number(row[f"best_{key}"])
        if row["best_epoch"] is not None:
            best += f" ({row['best_epoch']})"
        cells = [
            row["config"], *reach, f"{row['seconds_per_iter'] * 1e3:.2f}", ratio,
            number(row[f"final_{key}"]), best,
            *([number(row[f"final_{train}"])] if train else []),
            str(row["epochs"]), f"{row['train_time']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(rows: Sequence[dict[str, Any]], metric: Metric, target: Target) -> list[str]:
    """The sentences above the table: what the target is, who reached it how fast."""
    if target.value is None:
        return [f"No target: no configuration has a finite final {metric.title}."]
    value = number(target.value)
    if target.baseline is None:
        lines = [f"Target: {metric.title} {value} (--target)."]
    elif target.baselines:
        among = ", ".join(target.baselines)
        lines = [
            f"Target: {metric.title} {value}, the final value of {target.baseline} after "
            f"{target.epochs} epochs, the best first-order baseline ({among})."
        ]
    else:
        lines = [
            f"Target: {metric.title} {value}, the best final value ({target.baseline}, after "
            f"{target.epochs} epochs); no first-order baseline ran."
        ]
    base = next((r for r in rows if r["config"] == target.baseline), None)
    reached = sorted((r for r in rows if r["time_to_target"] is not None),
                     key=lambda r: r["time_to_target"])
    for row in reached:
        line = (
            f"{row['config']}: {row['time_to_target']:.2f} s of training, "
            f"{row['steps_to_target']} steps (epoch {row['epochs_to_target']})"
        )
        if base is not None and row is not base and base["time_to_target"]:
            steps = (row["steps_to_target"] or 0) / max(1, base["steps_to_target"] or 0)
            line += (
                f", {row['time_to_target'] / base['time_to_target']:.2f}x "
                f"{base['config']}'s time in {steps:.2f}x its steps "
                f"at {row['cost_vs_baseline']:.2f}x its cost per step"
            )
        lines.append(line + ".")
    for row in rows:
        if row["time_to_target"] is None:
            how = "diverged" if row["diverged"] else "did not reach it"
            lines.append(f"{row['config']}: {how} (best {number(row[f'best_{metric.key}'])}).")
    if reached:
        lines[1] = "Fastest to it: " + lines[1]
    return lines


def number(value: float) -> str:
    """Four decimals, or scientific notation for huge, tiny or non-finite values."""
    if math.isnan(value):
        return "nan"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def figure(
    results: Sequence[RunResult], metric: Metric, target: float | None, title: str = ""
) -> Any:
    """Two panels: the validation metric against training seconds and against steps.

    The target is a dashed horizontal line; dotted vertical lines mark where each
    configuration reached it, an x where a diverged one stopped. Returns the
    :class:`matplotlib.figure.Figure` (Agg backend; close it after saving).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), squeeze=False)
    for axis, x_key in zip(axes[0], ("time", "step"), strict=True):
        for result in results:
            points = [(r[x_key], v) for r in result.history
                      if x_key in r and (v := _value(r, metric.key)) is not None]
            if not points:
                continue
            label = result.label + (" (diverged)" if result.diverged else "")
            (line,) = axis.plot(*zip(*points, strict=True), label=label)
            if result.diverged:  # where it stopped
                axis.plot(*points[-1], marker="x", markersize=10, color=line.get_color())
            hit = time_to_target(result.history, metric, target)
            if hit is not None and x_key in hit:
                axis.axvline(hit[x_key], color=line.get_color(), linestyle=":", alpha=0.8)
        if target is not None:
            axis.axhline(target, color="grey", linestyle="--", linewidth=0.9,
                         label=f"target {number(target)}")
        if not metric.higher_is_better:
            axis.set_yscale("log")
        axis.set_xlabel("training wall time (s)" if x_key == "time" else "steps")
        axis.set_ylabel(metric.title)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title or f"{metric.title}: dashed line the target, dotted where reached",
                 fontsize="medium")
    fig.tight_layout()
    return fig


def plot(
    results: Sequence[RunResult], metric: Metric, target: float | None, path: Path,
    title: str = "",
) -> None:
    """Save :func:`figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(results, metric, target, title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def write_summary(
    results: Sequence[RunResult],
    metric: Metric,
    options: argparse.Namespace,
    run_dir: Path,
    configs: Sequence[argparse.Namespace],
) -> None:
    """Write ``table.md``, ``summary.json`` and ``comparison.png``; print the headline.

    The target is ``--target`` or the best final metric of the first-order
    configurations (:data:`FIRST_ORDER` without ``+kfac``).
    """
    results = [r for r in results if r.history]
    if not results:
        return
    first_order = [c.label for c in configs if c.optimizer in FIRST_ORDER and not c.kfac]
    target = choose_target(results, metric, first_order, options.target)
    rows = summary_rows(results, metric, target.value, target.baseline)
    table = format_table(rows, metric, target.value, target.baseline)
    lines = headline(rows, metric, target)
    text = "\n".join(lines) + "\n\n" + table + "\n"
    write_atomic(run_dir / "table.md", text.encode("utf-8"))
    clean = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        for row in rows
    ]
    summary = {
        "task": options.task,
        "model": options.model,
        "dataset": options.dataset,
        "metric": metric.key,
        "target": target.value,
        "target_from": target.baseline or "--target",
        "first_order": first_order,
        "headline": lines,
        "configs": clean,
        "settings": {config.label: settings(config) for config in configs},
    }
    write_atomic(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    if options.plot:
        plot(results, metric, target.value, run_dir / "comparison.png", title=lines[0])
    print(f"\n{text}")
    print(
        f"wrote {run_dir / 'metrics.jsonl'}, {run_dir / 'table.md'}"
        + (f", {run_dir / 'comparison.png'}" if options.plot else "")
    )
