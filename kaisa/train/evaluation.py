"""Evaluation of a configuration: the loss, the test metrics of an epoch record."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from kaisa.distributed.fsdp_tangents import reshard
from kaisa.train.data import Dataset
from kaisa.train.distributed import DistContext, all_reduce_sum

Record = dict[str, Any]


def loss_fn(task: str, output: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE reconstruction loss (autoencode), cross-entropy (classify; lm: per byte)."""
    if task == "autoencode":
        return F.mse_loss(output, x.flatten(1))
    if task == "lm":
        return F.cross_entropy(output.flatten(0, 1), y.flatten())
    return F.cross_entropy(output, y)


def _rounds(model: nn.Module, size: int, span: int) -> int:
    """Where the evaluation loop stops: ``size``, under FSDP2 rounded up to ``span``.

    Under FSDP2 every rank runs the same number of forwards (the all-gathers are
    collectives).
    """
    return -(-size // span) * span if isinstance(model, FSDPModule) else size


@torch.no_grad()
def evaluate(
    model: nn.Module, task: str, x: torch.Tensor, y: torch.Tensor, context: DistContext
) -> tuple[float, float]:
    """Mean loss and accuracy over ``(x, y)`` in eval mode, sharded over ranks.

    For ``autoencode`` the loss is the per-element MSE and the accuracy is NaN.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=context.device)
    span = context.world_size * 1024
    for start in range(context.rank * 1024, _rounds(model, len(x), span), span):
        if start >= len(x):  # FSDP2: a forward is a collective; run one, count nothing
            model(x[:1].to(context.device))
            continue
        xb = x[start : start + 1024].to(context.device)
        yb = y[start : start + 1024].to(context.device)
        out = model(xb)
        totals[0] += loss_fn(task, out, xb, yb).double() * len(xb)
        if task == "classify":
            totals[1] += (out.argmax(1) == yb).sum()
        totals[2] += len(xb)
    reshard(model)  # FSDP2 keeps the root unsharded after a no-grad forward (none after it)
    all_reduce_sum(totals, context)
    model.train(was_training)
    loss = float(totals[0] / totals[2])
    accuracy = float(totals[1] / totals[2]) if task == "classify" else math.nan
    return loss, accuracy


def epoch_record(
    options: argparse.Namespace, model: nn.Module, data: Dataset, context: DistContext
) -> Record:
    """Evaluation part of a metrics record (test set, and train set if enabled)."""
    task = options.task
    record: Record = {}
    if options.eval_train:
        loss, accuracy = evaluate(model, task, data.train_x, data.train_y, context)
        record["train_eval_loss"] = loss
        record["train_mse" if task == "autoencode" else "train_acc"] = (
            loss if task == "autoencode" else accuracy
        )
    loss, accuracy = evaluate(model, task, data.test_x, data.test_y, context)
    record["test_loss"] = loss
    if task == "lm":  # validation cross-entropy per byte, in bits
        record["test_bpb"] = loss / math.log(2)
    record["test_mse" if task == "autoencode" else "test_acc"] = (
        loss if task == "autoencode" else accuracy
    )
    return record
