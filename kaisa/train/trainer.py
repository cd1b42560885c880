"""Train one configuration: epochs or a time budget, metrics, checkpoints, resume."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset
from tqdm import tqdm

from kaisa.train import checkpoint, sharded
from kaisa.train.configs import settings
from kaisa.train.data import Dataset, augment_batch
from kaisa.train.distributed import (
    DistContext,
    all_gather_rows,
    all_reduce_sum,
    data_parallel,
    raise_together,
)
from kaisa.train.evaluation import epoch_record, loss_fn
from kaisa.train.files import deferred_interrupt
from kaisa.train.models import build_model, gpt
from kaisa.train.optim import (
    OWN_CURVATURE,
    build_kfac,
    build_optimizer,
    build_preconditioner,
    build_scheduler,
)
from kaisa.train.outcome import (
    NonFiniteLossError,
    Record,
    RunResult,
    fingerprint,
    kfac_summary,
)
from kaisa.train.preemption import Preempted, StopSignals

__all__ = ["NonFiniteLossError", "Record", "RunResult", "Trainer", "build", "model_for", "train"]


def model_for(options: argparse.Namespace, data: Dataset) -> nn.Module:
    """The model ``options`` name, shaped for ``data`` (on the CPU, unseeded)."""
    if options.task == "lm":
        return gpt(d_model=options.d_model, context=options.context)
    return build_model(
        options.model,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        input_dim=data.input_dim,
    )


def build(options: argparse.Namespace, data: Dataset, context: DistContext) -> nn.Module:
    """Build the model of ``options`` seeded with ``options.seed`` (same for every config)."""
    checkpoint.seed_rng(options.seed)
    return model_for(options, data).to(context.device)


class Trainer:
    """Model, optimiser, schedule and preconditioner of one configuration."""

    def __init__(
        self,
        options: argparse.Namespace,
        data: Dataset,
        context: DistContext,
        *,
        checkpoint_path: Path,
        on_record: Callable[[Record], None],
        signals: StopSignals | None = None,
    ) -> None:
        self.options, self.data, self.context = options, data, context
        self.checkpoint_path, self.on_record = checkpoint_path, on_record
        self.signals = signals
        self.model = build(options, data, context)
        self.result = RunResult(label=options.label, init_checksum=fingerprint(self.model))
        self.net: nn.Module = (sharded.shard(self.model, context, options.replicate)
                               if options.fsdp else data_parallel(self.model, context))
        #: kaisa.KFAC (``--optimizer kfac``): adaptive lr/momentum, its own preconditioner.
        self.kfac_optimizer = options.optimizer == "kfac"
        if self.kfac_optimizer and options.accumulation_steps != 1:
            raise ValueError("optimizer kfac does not support --accumulation-steps > 1")
        self.optimizer: Any = (
            build_kfac(self.model, options)
            if self.kfac_optimizer
            else build_optimizer(self.model, options)
        )
        #: kaisa.KFAC, kaisa.EKFAC or kaisa.KFACMuon: the optimizer owns the curvature (no
        #: separate preconditioner; its state dict gathers the decompositions).
        self.owns_curvature = options.optimizer in OWN_CURVATURE
        self.sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
            TensorDataset(torch.arange(data.train_size)),
            num_replicas=context.world_size,
            rank=context.rank,
            shuffle=True,
            seed=options.seed,
        )
        self.micro_batches = math.ceil(len(self.sampler) / options.batch_size)
        steps_per_epoch = math.ceil(self.micro_batches / options.accumulation_steps)
        # kaisa.KFAC chooses its own step size: no learning-rate schedule.
        self.scheduler = (
            None
            if self.kfac_optimizer
            else build_scheduler(self.optimizer, options, steps_per_epoch)
        )
        self.pre: Any = (
            build_preconditioner(self.model, options, self.optimizer) if options.kfac else None
        )
        if self.owns_curvature:
            self.pre = cast(Any, self.optimizer).curvature
        if self.pre is not None and context.is_main and not options.quiet:
            tqdm.write(kfac_summary(options.label, self.pre.curvature if not self.owns_curvature
                                    else self.pre), file=sys.stdout)
        self.kfac_offset: dict[str, float] = {}
        self.epoch = 0
        #: Where a checkpoint written inside an epoch stopped it (``None``: at its end).
        self.position: dict[str, Any] | None = None
        self.started = time.perf_counter()
        self.last_save = time.monotonic()

    def resume(self, state: dict[str, Any]) -> None:
        """Restore everything from a checked checkpoint; replay its history to ``on_record``."""
        if self.options.fsdp:  # a DCP directory: resharded, K-FAC owners re-placed
            sharded.load(self.checkpoint_path, self.model, self.optimizer, self._preconditioner())
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # KFAC: also its preconditioner
            if self._preconditioner() is not None:
                self.pre.load_state_dict(state["preconditioner"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        result = self.result
        self.epoch, result.steps = state["epoch"], state["steps"]
        result.train_time, result.history = state["train_time"], state["history"]
        self.position = state.get("position")
        self.kfac_offset = dict(result.history[-1].get("kfac", {}) if self.position is None
                                else self.position["kfac"])
        self.started -= (result.history[-1]["wall"] if self.position is None
                         else self.position["wall"])
        for record in result.history:
            self.on_record(record)

    def save(self, position: dict[str, Any] | None = None, train_time: float | None = None,
             ) -> None:
        """Write the checkpoint; every rank calls it (building the state may be collective).

        Args:
            position: Inside an epoch (``--checkpoint-every``, a stop signal): where the
                epoch continues (its micro-batch index, every rank's running totals, the
                augmentation generator); ``None`` at an epoch's end.
            train_time: The training seconds so far (default: the result's).
        """
        result = self.result
        state = {
            "label": self.options.label,
            "settings": settings(self.options),
            "epoch": self.epoch if position is None else self.epoch - 1,
            "steps": result.steps,
            "train_time": result.train_time if train_time is None else train_time,
            "history": result.history,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            "position": position,
        }
        if self.options.fsdp:
            sharded.save(self.checkpoint_path, state, self.model, self.optimizer,
                         self._preconditioner(), self.context)
        else:
            state |= {
                "model": self.model.state_dict(),
                # K-FAC: with the decompositions other ranks hold (MEM-OPT, HYBRID-OPT)
                "optimizer": (cast(Any, self.optimizer).state_dict(gather=True)
                              if self.owns_curvature else self.optimizer.state_dict()),
                "preconditioner": (
                    None if self._preconditioner() is None else self.pre.state_dict(gather=True)
                ),
            }
            checkpoint.save_agreed(self.checkpoint_path, state, self.context)
        if self.context.is_main:
            checkpoint.retain(self.checkpoint_path, result.steps, self.options.keep)
        self.last_save = time.monotonic()

    def _preconditioner(self) -> Any:
        """The :class:`kaisa.KFACPreconditioner` (``None``: none, or the optimizer's own)."""
        return None if self.owns_curvature else self.pre

    def _postfix(self, totals: torch.Tensor) -> dict[str, str]:
        """Progress-bar fields: running loss and accuracy (classify) or MSE (autoencode)."""
        loss = float(totals[0] / totals[2])
        if self.options.task == "classify":
            return {"loss": f"{loss:.4f}", "acc": f"{float(totals[1] / totals[2]):.3f}"}
        return {"mse": f"{loss:.4f}"}

    def record(
        self, running: dict[str, float], partial: bool = False, emit: bool = True
    ) -> Record:
        """Evaluate, append the epoch's metrics record and (``emit``) hand it to ``on_record``.

        ``running`` holds the minibatch averages of the epoch (``train_loss``
        and, for classify, ``train_acc``, replaced by the full-set value when
        ``--eval-train``).
        """
        result = self.result
        record: Record = {
            "config": self.options.label,
            "epoch": self.epoch,
            "step": result.steps,
            "time": result.train_time,
            "wall": 0.0,
            "lr": self._lr(),
        }
        record |= running
        if partial:
            record["partial_epoch"] = True
        record |= epoch_record(self.options, self.model, self.data, self.context)
        if self.pre is not None:
            record["kfac"] = self._kfac_timings()
        record["seconds_per_iter"] = result.train_time / max(1, result.steps)
        record["wall"] = time.perf_counter() - self.started
        result.history.append(record)
        if emit:
            self.emit(record)
        return record

    def emit(self, record: Record) -> None:
        """Hand ``record`` to ``on_record``; a failed write (rank 0) stops every rank."""
        failure: OSError | None = None
        try:
            self.on_record(record)
        except OSError as err:
            failure = err
        raise_together(failure, self.context, self.checkpoint_path.parent / "metrics.jsonl")

    def _kfac_timings(self) -> dict[str, float]:
        """K-FAC's seconds per phase since the run began (those before a resume included)."""
        timings = {k: float(v) for k, v in self.pre.timings.items()}
        if self.kfac_optimizer:  # the optimizer's own phases (quadratic model, LM rule)
            extra = cast(Any, self.optimizer).timings
            timings |= {k: float(extra[k]) for k in ("quadratic_model", "damping")}
        return {k: self.kfac_offset.get(k, 0.0) + v for k, v in timings.items()}

    def _lr(self) -> float:
        """The learning rate of the last step (KFAC: the quadratic model's choice)."""
        if self.kfac_optimizer:
            return float(self.optimizer.last.get("lr", math.nan))
        return float(self.optimizer.param_groups[0]["lr"])

    def _kfac_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One kaisa.KFAC step; returns the loss and the outputs of its forward pass."""
        seen: list[torch.Tensor] = []

        def closure() -> tuple[torch.Tensor, torch.Tensor]:
            out = self.net(x)
            if not seen:
                seen.append(out.detach())
            return out, x.flatten(1) if self.options.task == "autoencode" else y

        loss = self.optimizer.step(closure)
        self.result.steps += 1
        return loss, seen[0]

    def _step(self, x: torch.Tensor, y: torch.Tensor, last_micro: bool) -> torch.Tensor:
        """Forward/backward one micro-batch; precondition and step after the last one.

        Returns:
            ``[loss, loss * n, correct, n]`` in float64 on the CPU (``correct`` is 0
            for autoencode).
        """
        if self.kfac_optimizer:
            loss, output = self._kfac_step(x, y)
        else:
            sync = contextlib.nullcontext()
            if self.context.enabled and not last_micro and not self.options.fsdp:
                sync = self.net.no_sync()  # type: ignore[operator]
            with sync:
                output = self.net(x)
                loss = loss_fn(self.options.task, output, x, y)
                (loss / self.options.accumulation_steps).backward()
        correct = (output.detach().argmax(1) == y).sum() if self.options.task == "classify" else 0
        if last_micro and not self.kfac_optimizer:
            if self.pre is not None and not self.owns_curvature:
                self.pre.step()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            assert self.scheduler is not None
            self.scheduler.step()
            self.result.steps += 1
        value = loss.detach().double().cpu()
        return torch.stack(
            [value, value * len(x), torch.tensor(float(correct)), torch.tensor(float(len(x)))]
        )

    def run_epoch(self, budget: float, show_bar: bool) -> bool:
        """Train one epoch (or until ``budget`` seconds); return whether time ran out.

        A resumed mid-epoch checkpoint continues the epoch where it stopped. After each
        optimizer step the ranks agree (one all-reduce of flags, made per micro-batch
        anyway) on a non-finite loss, the time budget, a stop signal and a due
        ``--checkpoint-every`` time.

        Raises:
            NonFiniteLossError: On a NaN or infinite loss.
            Preempted: After writing the checkpoint at the step a stop signal ended.
        """
        options, context, result = self.options, self.context, self.result
        self.epoch += 1
        self.sampler.set_epoch(self.epoch)
        order = torch.tensor(list(self.sampler))
        generator = torch.Generator().manual_seed(options.seed * 100_003 + self.epoch)
        totals, first = torch.zeros(3, dtype=torch.float64), 0
        if (position := self.position) is not None:
            self.position = None
            first, totals = position["index"], position["totals"][context.rank].clone()
            generator.set_state(position["generator"])
        bar = tqdm(total=self.micro_batches, initial=first, desc=f"{options.label} {self.epoch}",
                   leave=False, disable=not show_bar, unit="it")
        out_of_time, start = False, time.perf_counter()
        stop, due = False, False
        every = options.checkpoint_every
        for index in range(first, self.micro_batches):
            batch = order[index * options.batch_size : (index + 1) * options.batch_size]
            x, y = self.data.batch(batch, self.epoch)
            if options.augment:
                x = augment_batch(x, generator, flip=self.data.name != "digits")
            stepped = (index + 1) % options.accumulation_steps == 0
            stepped = stepped or index + 1 == self.micro_batches
            stats = self._step(x.to(context.device), y.to(context.device), stepped)
            elapsed = result.train_time + time.perf_counter() - start
            flags = torch.tensor(
                [float(not torch.isfinite(stats[0])), float(elapsed >= budget),
                 float(self.signals is not None and self.signals.requested is not None),
                 float(every.seconds is not None
                       and time.monotonic() - self.last_save >= every.seconds)],
                dtype=torch.float64)
            all_reduce_sum(flags, context)
            if flags[0] > 0:
                bar.close()
                raise NonFiniteLossError(
                    label=options.label,
                    epoch=self.epoch,
                    step=index + 1,
                    value=float(stats[0]),
                    history=result.history,
                )
            totals += stats[1:]
            bar.update()
            if index % 5 == 0:
                bar.set_postfix(self._postfix(totals), refresh=False)
            if flags[1] > 0:
                out_of_time = True
                break
            stop, due = stop or bool(flags[2] > 0), due or bool(flags[3] > 0)
            due = due or (every.steps is not None and stepped and result.steps % every.steps == 0)
            if stepped and (stop or due) and index + 1 < self.micro_batches:
                bar.close()
                self.save(position={
                    "index": index + 1,
                    "totals": all_gather_rows(totals, context),
                    "generator": generator.get_state(),
                    "wall": time.perf_counter() - self.started,
                    "kfac": {} if self.pre is None else self._kfac_timings(),
                }, train_time=result.train_time + time.perf_counter() - start)
                due = False
                if stop:
                    raise self._preempted()
        if context.device.type == "cuda":
            torch.cuda.synchronize()
        result.train_time += time.perf_counter() - start
        bar.close()
        all_reduce_sum(totals, context)
        running = {"train_loss": float(totals[0] / totals[2])}
        if options.task == "classify":
            running["train_acc"] = float(totals[1] / totals[2])
        record = self.record(running, partial=index + 1 < self.micro_batches, emit=False)
        with deferred_interrupt():  # checkpoint first, then its metrics line: never one alone
            self.save()
            self.emit(record)
        if not out_of_time and self.epoch < options.epochs and self._stop_agreed():
            raise self._preempted()
        return out_of_time

    def _stop_agreed(self) -> bool:
        """Whether any rank got a stop signal (every rank calls it: one all-reduce)."""
        flag = torch.tensor([float(self.signals is not None
                                   and self.signals.requested is not None)], dtype=torch.float64)
        return bool(all_reduce_sum(flag, self.context)[0] > 0)

    def _preempted(self) -> Preempted:
        """The stop after the checkpoint at this step (the grace timer is cancelled)."""
        assert self.signals is not None
        self.signals.done()
        return Preempted(label=self.options.label,
                         signal_name=self.signals.requested or "a stop signal to another rank",
                         epoch=self.epoch, step=self.result.steps,
                         path=str(self.checkpoint_path))


def train(
    options: argparse.Namespace,
    data: Dataset,
    context: DistContext,
    *,
    checkpoint_path: Path,
    on_record: Callable[[Record], None],
    resume_state: dict[str, Any] | None = None,
    signals: StopSignals | None = None,
) -> RunResult:
    """Train the configuration ``options.label`` and return its history.

    Saves ``checkpoint_path`` after every epoch; with ``resume_state`` (a checkpoint
    already loaded and checked by the caller) it continues from there. Stops after
    ``options.epochs`` epochs or ``options.time_budget`` seconds of training (evaluation
    excluded). Raises :class:`NonFiniteLossError` on a NaN or infinite loss, leaving the
    last good checkpoint in place, and :class:`~kaisa.train.preemption.Preempted` after
    the checkpoint at the step where one of ``signals`` stopped it.
    """
    if resume_state is None and context.is_main:
        checkpoint_path.unlink(missing_ok=True)
    trainer = Trainer(options, data, context, checkpoint_path=checkpoint_path,
                      on_record=on_record, signals=signals)
    if resume_state is not None:
        trainer.resume(resume_state)
    else:
        trainer.record({"train_loss": math.nan})
    budget = options.time_budget or math.inf
    show_bar = context.is_main and not options.quiet and sys.stderr.isatty()
    out_of_time = trainer.result.train_time >= budget
    while trainer.epoch < options.epochs and not out_of_time:
        out_of_time = trainer.run_epoch(budget, show_bar)
    return trainer.result
