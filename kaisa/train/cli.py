"""Command line of ``kaisa-train`` (also ``python -m kaisa.train``)."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
from tqdm import tqdm

from kaisa.train import checkpoint, distributed, report, sharded
from kaisa.train.configs import RunSpec, parse_spec, resolve, settings
from kaisa.train.data import (
    Dataset,
    DatasetError,
    load_cifar10,
    load_digits,
    make_synthetic,
)
from kaisa.train.lock import RunDirBusyError, RunLock
from kaisa.train.optim import OWN_CURVATURE, build_kfac, build_optimizer, build_preconditioner
from kaisa.train.options import build_parser
from kaisa.train.preemption import EXIT_STOPPED, Preempted, StopSignals
from kaisa.train.text import STDLIB_TEXT, load_text
from kaisa.train.trainer import NonFiniteLossError, Record, RunResult, build, model_for, train

TASK_DEFAULTS = {
    "autoencode": {
        "model": "autoencoder", "epochs": 100, "dataset": "digits",
        "batch_size": 128,
    },
    "classify": {"model": "cnn", "epochs": 20, "dataset": "digits",
                 "batch_size": 128},
    "lm": {"model": "gpt", "epochs": 3, "dataset": STDLIB_TEXT, "batch_size": 32},
}


class UsageError(Exception):
    """A user error reported as ``kaisa-train: error: ...`` with exit code 2."""


#: Exit statuses of ``kaisa-train``: done, diverged, usage error, cannot resume, cannot
#: write the run's files (disk full, ``ulimit -f``, read-only), stopped by a stop signal
#: with a checkpoint at that step (:data:`~kaisa.train.preemption.EXIT_STOPPED`),
#: interrupted (Ctrl-C). Stopped at once (a second signal, the grace time): 128 + signal.
EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_CHECKPOINT, EXIT_IO = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130

#: Seconds a rank waits before exiting on rank 0's failed write, so that rank 0, which
#: prints the error, exits first and torchrun reports it as the root cause.
PEER_EXIT_DELAY_S = 1.0

#: Files of a run directory that a new run would replace.
RUN_FILES = ("metrics.jsonl", "summary.json", "table.md", "comparison.png")


def _complete(options: argparse.Namespace, world_size: int = 1) -> None:
    """Fill task- and dataset-dependent defaults and check task/model compatibility."""
    defaults = TASK_DEFAULTS[options.task]
    for key, value in defaults.items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    if options.task == "autoencode" and options.model != "autoencoder":
        raise UsageError(f"--task autoencode needs --model autoencoder, not {options.model!r}")
    if options.task == "classify" and options.model == "autoencoder":
        raise UsageError("--model autoencoder only supports --task autoencode")
    if (options.task == "lm") != (options.model == "gpt"):
        raise UsageError("--task lm needs --model gpt, and --model gpt needs --task lm")
    if (options.task == "lm") != (options.dataset == STDLIB_TEXT):
        raise UsageError(f"--task lm needs --dataset {STDLIB_TEXT}, and only it reads it")
    if options.eval_train is None:
        options.eval_train = options.dataset not in ("cifar10", STDLIB_TEXT)
    if options.augment is None:
        options.augment = options.dataset == "cifar10"
    if options.epochs < 1 or options.batch_size < 1 or options.accumulation_steps < 1:
        raise UsageError("--epochs, --batch-size and --accumulation-steps must be >= 1")
    if options.threads is None:
        options.threads = 1 if options.dataset in ("digits", STDLIB_TEXT) else 0
    if options.name is None:
        options.name = f"{options.dataset}-{options.model}-{options.task}"
    if options.name.strip() in ("", ".", ".."):
        raise UsageError(f"--name must name a run directory, got {options.name!r}")
    problem = sharded.check_options(options, world_size, distributed.launched_by_torchrun())
    if problem is not None:
        raise UsageError(problem)


def _load_data(options: argparse.Namespace, world_size: int) -> Dataset:
    if options.dataset == STDLIB_TEXT:
        steps = options.steps_per_epoch * options.accumulation_steps
        try:
            return load_text(
                context=options.context,
                examples_per_epoch=steps * options.batch_size * world_size,
                max_bytes=options.text_bytes,
                eval_windows=options.eval_windows,
                seed=options.seed,
            )
        except ValueError as error:  # --text-bytes beyond the corpus, or a damaged copy
            raise UsageError(f"--dataset {STDLIB_TEXT}: {error}") from error
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
    model = model_for(config, data)
    if (why := sharded.check_config(config)) is not None:
        raise UsageError(f"configuration {config.label!r}: {why}")
    try:
        if config.optimizer == "kfac":
            if config.accumulation_steps != 1:
                raise ValueError("optimizer kfac does not support --accumulation-steps > 1")
            build_kfac(model, config).curvature.remove_hooks()
        else:
            optimizer = build_optimizer(model, config)
            if config.optimizer in OWN_CURVATURE:  # ekfac, kfac-muon
                cast(Any, optimizer).curvature.remove_hooks()
            if config.kfac:
                build_preconditioner(model, config, optimizer).remove_hooks()
    except (ValueError, TypeError) as error:
        raise UsageError(f"configuration {config.label!r}: {error}") from error


def _specs(options: argparse.Namespace, parser: argparse.ArgumentParser) -> list[RunSpec]:
    if options.compare is None:
        if options.kfac and options.optimizer in OWN_CURVATURE:
            raise UsageError(f"--optimizer {options.optimizer} is K-FAC itself; drop --kfac")
        return [RunSpec(optimizer=options.optimizer, kfac=options.kfac)]
    try:
        specs = [parse_spec(item, parser) for item in options.compare.split(",") if item.strip()]
    except ValueError as error:
        raise UsageError(str(error)) from error
    labels = [spec.label for spec in specs]
    if not specs:
        raise UsageError(f"--compare needs at least one configuration, got {options.compare!r}")
    if len(set(labels)) != len(labels):
        raise UsageError(f"--compare needs distinct configurations, got {options.compare!r}")
    return specs


def _error(message: str, is_main: bool) -> NoReturn:
    if is_main:
        print(f"kaisa-train: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None, *, exit_fast: bool = False) -> int:
    """Run ``kaisa-train``; returns the exit status.

    With ``exit_fast`` (the process's own command) a torchrun worker that stopped on a
    signal or failed to read or write the run's files exits right after reporting it
    (:func:`_leave`).

    0 ok, 1 a configuration diverged, 2 usage error, 3 a checkpoint cannot be resumed
    from, 4 the run's files cannot be written, 75 stopped by a stop signal (a checkpoint
    at that step written), 130 interrupted, 128 + signal stopped at once (every error is
    one line on stderr).
    """
    parser = build_parser()
    options = parser.parse_args(argv)
    context = distributed.setup(options.device, timeout_s=options.pg_timeout)
    signals = StopSignals(options.stop_signals, grace=options.grace, is_main=context.is_main,
                          hold_on_error=exit_fast and context.enabled)
    try:
        with signals:
            status = _run(options, parser, context, signals)
    except Preempted as stop:
        if context.is_main:
            print(f"kaisa-train: {stop}", file=sys.stderr, flush=True)
        signals.exiting(EXIT_STOPPED)
        return _leave(EXIT_STOPPED, context, exit_fast)
    except (UsageError, DatasetError) as failure:
        distributed.teardown(context, wait=False)
        _error(str(failure), context.is_main)
    except checkpoint.CheckpointError as failure:
        if context.is_main:
            print(f"kaisa-train: error: {failure}", file=sys.stderr)
        return _leave(EXIT_CHECKPOINT, context, exit_fast)
    except OSError as failure:
        if context.is_main:
            print(f"kaisa-train: error: {_io_message(failure)}", file=sys.stderr, flush=True)
        signals.exiting(EXIT_IO)
        if isinstance(failure, distributed.PeerWriteError):
            time.sleep(PEER_EXIT_DELAY_S)  # rank 0 exits first: torchrun names it the cause
        return _leave(EXIT_IO, context, exit_fast)
    except KeyboardInterrupt:
        distributed.teardown(context, wait=False)
        if context.is_main:
            where = Path(options.run_dir) / (options.name or "")
            print(
                f"kaisa-train: interrupted; {where} keeps the last complete checkpoint and "
                "its metrics (continue with --resume)",
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED
    except BaseException:
        distributed.teardown(context, wait=False)
        raise
    distributed.teardown(context)
    return status


def _leave(status: int, context: distributed.DistContext, exit_fast: bool) -> int:
    """Ends a stopped or failed run with ``status`` (``exit_fast``: a worker exits here).

    With ``exit_fast``, a torchrun worker exits right here: its error is reported and its
    files are whole. Tearing the process group down could wait on a rank that is exiting
    too (seen: 30 s, until torchrun killed the rank), and the operating system closes its
    connections anyway. Called in a process that goes on (``exit_fast`` false: tests, a
    user's own code), it tears the group down and returns.
    """
    if not (exit_fast and context.enabled):
        distributed.teardown(context, wait=False)
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _io_message(failure: OSError) -> str:
    """One line for a failed write: the file, the reason, what is kept."""
    what = f"cannot write {failure.filename}" if failure.filename else "cannot write the run"
    reason = failure.strerror or str(failure)
    kept = ""
    if failure.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        kept = ("; the metrics written so far and the last complete checkpoint are kept, no "
                "partial file is left (free space, then continue with --resume)")
    return f"{what}: {reason}{kept}"


def _existing_run_files(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        return []
    files = [run_dir / name for name in RUN_FILES]
    files += sorted(run_dir.glob("checkpoint*.pt")) + sorted(run_dir.glob("checkpoint*.partial"))
    files += sorted(run_dir.glob("checkpoint*.dcp")) + sorted(run_dir.glob("checkpoint*.dcp.*"))
    return [f for f in dict.fromkeys(files) if f.exists()]


def _not_a_file(options: argparse.Namespace, run_dir: Path) -> Exception | None:
    """A run file or checkpoint path that exists but is no regular file (a directory)."""
    if not run_dir.is_dir():
        return None
    paths = [run_dir / name for name in RUN_FILES] + sorted(run_dir.glob("checkpoint*.pt"))
    for path in paths:
        if path.exists() and not path.is_file():
            if options.resume and path.suffix == ".pt":
                return checkpoint.CheckpointError(
                    f"cannot resume from {path}: it is a directory, not a checkpoint file"
                )
            return UsageError(
                f"{path} is a directory, not a file; remove or rename it, or choose another "
                "--name"
            )
    return None


def _prepare_run_dir(
    options: argparse.Namespace, run_dir: Path, context: distributed.DistContext
) -> RunLock | None:
    """Locks the run directory, refuses to replace a previous run, clears its files.

    Rank 0 takes the lock (returned, to release at the end); a previous run is replaced
    only with ``--overwrite``. Every rank looks before any rank writes, and they agree
    (one all-reduce), so a fast rank 0 creating the new run's files never makes a slower
    rank refuse it.
    """
    lock: RunLock | None = None
    problem: Exception | None = None
    if context.is_main:
        try:
            lock = RunLock(run_dir)
        except RunDirBusyError as busy:
            problem = UsageError(str(busy))
        except OSError as failure:
            problem = failure
        problem = problem or _not_a_file(options, run_dir)
        if problem is None and options.resume and run_dir.is_dir():
            for old in sorted(run_dir.glob("checkpoint*.dcp.old")):  # killed inside a swap
                sharded.recover(old.with_name(old.name.removesuffix(".old")))
    existing = [] if options.resume else _existing_run_files(run_dir)
    refuse = bool(existing) and not options.overwrite
    flags = torch.tensor([float(refuse), float(problem is not None)], dtype=torch.float64)
    if context.enabled:
        flags = flags.to(context.device)
    distributed.all_reduce_sum(flags, context)
    if float(flags[1]) > 0 or float(flags[0]) > 0:
        if lock is not None:
            lock.release()
        if float(flags[1]) > 0:
            raise problem or UsageError(f"{run_dir}: see rank 0")
        names = ", ".join(f.name for f in existing[:4]) or "see rank 0"
        raise UsageError(
            f"{run_dir} already holds a run ({names}); pass --resume to continue it or "
            "--overwrite to replace it"
        )
    if context.is_main:
        for f in existing:
            if f.is_dir():  # an --fsdp checkpoint (a DCP directory)
                shutil.rmtree(f)
            else:
                f.unlink()
    return lock


def _resume_states(
    specs: list[RunSpec],
    configs: list[argparse.Namespace],
    data: Dataset,
    run_dir: Path,
    context: distributed.DistContext,
) -> list[dict[str, Any] | None]:
    """Loads and checks every checkpoint to resume from, before any file is touched."""
    states: list[dict[str, Any] | None] = []
    for spec, config in zip(specs, configs, strict=True):
        path = run_dir / _checkpoint_name(spec, len(specs), config.fsdp)
        other = run_dir / _checkpoint_name(spec, len(specs), not config.fsdp)
        if config.resume and not path.exists() and other.exists():
            flag = "without" if config.fsdp else "with"
            raise checkpoint.CheckpointError(
                f"cannot resume from {other}: written by a run {flag} --fsdp (resume {flag} "
                "--fsdp)")
        if not (config.resume and path.exists()):
            states.append(None)
            continue
        now = settings(config)
        if config.fsdp:
            state = sharded.read(path, context.device)
            now = sharded.settings_for_check(state, now)
        else:
            state = checkpoint.load(path, context.device)
        checkpoint.check_matches(state, path, now, build(config, data, context))
        states.append(state)
    return states


def _checkpoint_name(spec: RunSpec, count: int, fsdp: bool = False) -> str:
    """The checkpoint: ``checkpoint.pt``, or ``checkpoint.dcp`` (a directory) under ``--fsdp``.

    With several configurations, ``checkpoint-SLUG.pt`` or ``checkpoint-SLUG.dcp``.
    """
    suffix = ".dcp" if fsdp else ".pt"
    return f"checkpoint{suffix}" if count == 1 else f"checkpoint-{spec.slug}{suffix}"


def _run(
    options: argparse.Namespace,
    parser: argparse.ArgumentParser,
    context: distributed.DistContext,
    signals: StopSignals,
) -> int:
    _complete(options, context.world_size)
    options.world_size = context.world_size  # recorded; --resume refuses another one
    if options.threads:
        torch.set_num_threads(options.threads)
    specs = _specs(options, parser)
    try:
        configs = [resolve(spec, options, parser) for spec in specs]
    except ValueError as error:
        raise UsageError(str(error)) from error
    data = _load_data(options, context.world_size)
    for config in configs:
        _check(config, data)
    run_dir = Path(options.run_dir) / options.name
    lock = _prepare_run_dir(options, run_dir, context)
    try:
        states = _resume_states(specs, configs, data, run_dir, context)  # nothing written yet
        metrics, failure = None, None
        if context.is_main:
            try:
                metrics = report.MetricsFile(path=run_dir / "metrics.jsonl")
                for config in configs:
                    metrics.write_header(config.label, settings(config))
            except OSError as err:
                failure = err
                if metrics is not None:
                    metrics.abort()
        distributed.raise_together(failure, context, run_dir / "metrics.jsonl")
        try:
            status = _train_all(options, specs, configs, states, data, run_dir, context, metrics,
                                signals)
        except BaseException:
            if metrics is not None:
                metrics.abort()
            raise
    finally:
        if lock is not None:
            lock.release()
    return status


def _train_all(
    options: argparse.Namespace,
    specs: list[RunSpec],
    configs: list[argparse.Namespace],
    states: list[dict[str, Any] | None],
    data: Dataset,
    run_dir: Path,
    context: distributed.DistContext,
    metrics: report.MetricsFile | None,
    signals: StopSignals,
) -> int:
    """Trains every configuration in turn; writes the summary, table and plot (rank 0)."""
    metric = report.target_metric(options.task)
    results: list[RunResult] = []
    status = EXIT_OK
    show_bar = metrics is not None and not options.quiet and sys.stderr.isatty()
    overall = tqdm(total=sum(c.epochs for c in configs), desc="all configurations",
                   unit="epoch", disable=not show_bar, dynamic_ncols=True)
    done = 0  # epochs of the configurations already finished
    for spec, config, state in zip(specs, configs, states, strict=True):
        name = _checkpoint_name(spec, len(specs), config.fsdp)

        def on_record(record: Record, epochs: int = config.epochs, done: int = done) -> None:
            if metrics is None:
                return
            metrics.write(record)
            overall.update(done + record["epoch"] - overall.n)
            if not options.quiet and record["epoch"] % options.log_every == 0:
                tqdm.write(report.epoch_line(record, epochs), file=sys.stdout)
                sys.stdout.flush()

        if config.resume is True and state is None and context.is_main:
            print(f"kaisa-train: no {run_dir / name} to resume; starting from scratch",
                  file=sys.stderr)
        elif state is not None and context.is_main and not options.quiet:
            print(f"kaisa-train: resuming from {run_dir / name} at step {state['steps']}",
                  flush=True)
        try:
            result = train(
                config, data, context, checkpoint_path=run_dir / name, on_record=on_record,
                resume_state=state, signals=signals,
            )
        except NonFiniteLossError as error:
            status = EXIT_DIVERGED
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
        done += config.epochs
        overall.update(done - overall.n)  # stopped early: a time budget, divergence
    overall.close()
    if metrics is not None:
        metrics.close()
        report.write_summary(results, metric, options, run_dir, configs)
    return status


__all__ = ["main"]
