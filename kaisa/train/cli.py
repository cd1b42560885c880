"""Command line of ``kaisa-train`` (also ``python -m kaisa.train``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from kaisa.models import build_model
from kaisa.train import distributed, report
from kaisa.train.configs import RunSpec, parse_spec, resolve
from kaisa.train.data import (
    Dataset,
    DatasetError,
    load_cifar10,
    load_digits,
    make_synthetic,
)
from kaisa.train.optim import build_optimizer, build_preconditioner
from kaisa.train.options import build_parser
from kaisa.train.trainer import NonFiniteLossError, Record, RunResult, train

TASK_DEFAULTS = {
    "autoencode": {"model": "autoencoder", "epochs": 100, "target": 0.02},
    "classify": {"model": "cnn", "epochs": 20, "target": 0.97},
}


class UsageError(Exception):
    """A user error reported as ``kaisa-train: error: ...`` with exit code 2."""


def _complete(options: argparse.Namespace) -> None:
    """Fill task- and dataset-dependent defaults and check task/model compatibility."""
    defaults = TASK_DEFAULTS[options.task]
    for key, value in defaults.items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    if options.task == "autoencode" and options.model != "autoencoder":
        raise UsageError(f"--task autoencode needs --model autoencoder, not {options.model!r}")
    if options.task == "classify" and options.model == "autoencoder":
        raise UsageError("--model autoencoder only supports --task autoencode")
    if options.eval_train is None:
        options.eval_train = options.dataset != "cifar10"
    if options.augment is None:
        options.augment = options.dataset == "cifar10"
    if options.epochs < 1 or options.batch_size < 1 or options.accumulation_steps < 1:
        raise UsageError("--epochs, --batch-size and --accumulation-steps must be >= 1")
    if options.threads is None:
        options.threads = 1 if options.dataset == "digits" else 0
    if options.name is None:
        options.name = f"{options.dataset}-{options.model}-{options.task}"


def _load_data(options: argparse.Namespace) -> Dataset:
    if options.dataset == "digits":
        return load_digits()
    if options.dataset == "cifar10":
        if options.data_dir is None:
            raise UsageError("--dataset cifar10 needs --data-dir DIR")
        return load_cifar10(options.data_dir)
    flat = options.model in ("mlp", "autoencoder")
    return make_synthetic(
        in_channels=1 if flat else options.in_channels,
        image_size=options.image_size,
        train_size=options.synthetic_size,
        test_size=max(1, options.synthetic_size // 4),
        seed=options.seed,
    )


def _check(config: argparse.Namespace, data: Dataset) -> None:
    """Build the optimiser and preconditioner once so bad values fail before training."""
    model = build_model(
        config.model,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        input_dim=data.input_dim,
    )
    try:
        optimizer = build_optimizer(model.parameters(), config)
        if config.kfac:
            build_preconditioner(model, config, optimizer)
    except (ValueError, TypeError) as error:
        raise UsageError(f"configuration {config.label!r}: {error}") from error


def _specs(options: argparse.Namespace, parser: argparse.ArgumentParser) -> list[RunSpec]:
    if not options.compare:
        return [RunSpec(optimizer=options.optimizer, kfac=options.kfac)]
    try:
        specs = [parse_spec(item, parser) for item in options.compare.split(",") if item.strip()]
    except ValueError as error:
        raise UsageError(str(error)) from error
    labels = [spec.label for spec in specs]
    if not specs or len(set(labels)) != len(labels):
        raise UsageError(f"--compare needs distinct configurations, got {options.compare!r}")
    return specs


def _error(parser: argparse.ArgumentParser, message: str, is_main: bool) -> NoReturn:
    if is_main:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kaisa-train``; returns the exit status (0 ok, 1 diverged, 2 usage error)."""
    parser = build_parser()
    options = parser.parse_args(argv)
    context = distributed.setup(options.device)
    try:
        status = _run(options, parser, context)
    except (UsageError, DatasetError) as failure:
        distributed.teardown(context, wait=False)
        _error(parser, str(failure), context.is_main)
    except BaseException:
        distributed.teardown(context, wait=False)
        raise
    distributed.teardown(context)
    return status


def _run(
    options: argparse.Namespace,
    parser: argparse.ArgumentParser,
    context: distributed.DistContext,
) -> int:
    _complete(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    specs = _specs(options, parser)
    try:
        configs = [resolve(spec, options, parser) for spec in specs]
    except ValueError as error:
        raise UsageError(str(error)) from error
    data = _load_data(options)
    for config in configs:
        _check(config, data)
    run_dir = Path(options.run_dir) / options.name
    metric = report.target_metric(options.task, options.eval_train)
    metrics = report.MetricsFile(path=run_dir / "metrics.jsonl") if context.is_main else None
    results: list[RunResult] = []
    status = 0
    for spec, config in zip(specs, configs, strict=True):
        name = "checkpoint.pt" if len(specs) == 1 else f"checkpoint-{spec.slug}.pt"

        def on_record(record: Record, epochs: int = config.epochs) -> None:
            if metrics is None:
                return
            metrics.write(record)
            if not options.quiet and record["epoch"] % options.log_every == 0:
                print(report.epoch_line(record, epochs), flush=True)

        try:
            result = train(
                config, data, context, checkpoint_path=run_dir / name, on_record=on_record
            )
        except NonFiniteLossError as error:
            status = 1
            kept = run_dir / name
            note = f"last good checkpoint kept: {kept}" if kept.exists() else "no checkpoint yet"
            if context.is_main:
                print(f"kaisa-train: stopped: {error}; {note}", file=sys.stderr, flush=True)
            last: Record = error.history[-1] if error.history else {"step": 0, "time": 0.0}
            result = RunResult(
                label=spec.label,
                diverged=str(error),
                history=error.history,
                steps=last["step"],
                train_time=last["time"],
            )
        results.append(result)
    if metrics is not None:
        metrics.close()
        _write_summary(results, metric, options, run_dir)
    return status


def _write_summary(
    results: list[RunResult], metric: report.Metric, options: argparse.Namespace, run_dir: Path
) -> None:
    results = [r for r in results if r.history]
    if not results:
        return
    rows = report.summary_rows(results, metric, options.target)
    table = report.format_table(rows, metric, options.target)
    (run_dir / "table.md").write_text(table + "\n", encoding="utf-8")
    clean = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        for row in rows
    ]
    summary = {
        "task": options.task,
        "model": options.model,
        "dataset": options.dataset,
        "metric": metric.key,
        "target": options.target,
        "configs": clean,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if options.plot:
        report.plot(results, metric, options.target, options.task, run_dir / "comparison.png")
    print(f"\n{metric.title}, target {options.target:g}:\n{table}\n")
    print(
        f"wrote {run_dir / 'metrics.jsonl'}, {run_dir / 'table.md'}"
        + (f", {run_dir / 'comparison.png'}" if options.plot else "")
    )


__all__ = ["main"]
