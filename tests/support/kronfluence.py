"""Kronfluence 1.0.1's EK-FAC influence in float64 on the CPU: the anchor of
``docs/conventions.md``, "Influence".

:func:`kronfluence_ekfac` runs Kronfluence's own pipeline (``prepare_model``, an
``Analyzer``) on a classifier with every dtype float64 and returns what it stored: per
module the covariances, eigenbases, ``Λ`` and the damping it used, and the pairwise and
self-influence scores. Import it only where ``kronfluence`` is installed
(``pip install --no-deps kronfluence==1.0.1``; it needs no torchvision).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch import nn
from torch.utils.data import TensorDataset

F64 = torch.float64


class ClassificationTask(Task):  # type: ignore[misc]
    """Summed cross-entropy, as Kronfluence's own classification tests define it.

    Batches are ``(inputs, labels, index)``; logits ``(..., classes)`` with labels of the
    leading shape (a sequence model: one label per position). The Fisher labels
    (``sample=True``) are ``fixed_labels[index]`` when given (the same in both passes),
    else drawn from the model (Kronfluence's default). The measurement is the query's
    summed loss. ``tracked``: the names of the modules Kronfluence tracks (``None``: every
    ``nn.Linear`` and ``nn.Conv2d``).
    """

    def __init__(self, fixed_labels: torch.Tensor | None = None,
                 tracked: list[str] | None = None) -> None:
        self.fixed_labels = fixed_labels
        self.tracked = tracked

    def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> Any:
        inputs, labels, index = batch
        logits = model(inputs)
        flat = logits.reshape(-1, logits.shape[-1])
        if sample:
            if self.fixed_labels is not None:
                labels = self.fixed_labels[index]
            else:
                with torch.no_grad():
                    labels = torch.multinomial(F.softmax(flat, dim=-1), 1).flatten()
        return F.cross_entropy(flat, labels.reshape(-1), reduction="sum")

    def compute_measurement(self, batch: Any, model: nn.Module) -> Any:
        inputs, labels, _ = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="sum")

    def get_influence_tracked_modules(self) -> list[str] | None:
        return self.tracked


def _indexed(data: TensorDataset, dtype: torch.dtype) -> TensorDataset:
    x, y = data.tensors[0], data.tensors[1]
    return TensorDataset(x if not x.is_floating_point() else x.to(dtype), y.long(),
                         torch.arange(len(x)))


def kronfluence_ekfac(
    model: nn.Module, train: TensorDataset, query: TensorDataset, *, damping: float | None,
    batch_size: int, workdir: str, empirical: bool, fixed_labels: torch.Tensor | None = None,
    dtype: torch.dtype = F64, self_scores: bool = True, tracked: list[str] | None = None,
    score_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Kronfluence's EK-FAC factors and scores, every dtype float64 (or ``dtype``).

    Args:
        model: The classifier (copied; Kronfluence wraps its layers).
        train: ``(inputs, labels)`` of the training examples.
        query: ``(inputs, labels)`` of the queries.
        damping: Absolute damping, or ``None`` for ``0.1 mean(Λ)`` per module.
        batch_size: Examples per batch (every pass).
        workdir: Where Kronfluence writes its files.
        empirical: The Fisher of the true labels (``use_empirical_fisher``); else the
            sampled or ``fixed_labels``.
        fixed_labels: The Fisher labels of both passes, by training index.
        dtype: The statistics' and scores' dtype (float32: Kronfluence's defaults; its
            eigendecompositions run in float64 either way); the model and data follow it.
        self_scores: Also the self-influence scores.
        tracked: The modules Kronfluence tracks (``None``: its default).
        score_options: Further ``ScoreArguments`` of the pairwise scores (e.g.
            ``compute_per_token_scores``, ``query_gradient_low_rank``).

    Returns:
        ``{"factors": {module: {"A", "S", "QA", "QS", "lambda", "damping"}},
        "pairwise": (n_query, n_train), "self": (n_train,)}``.
    """
    warnings.filterwarnings("ignore", message=".*GradScaler.*")
    task = ClassificationTask(fixed_labels, tracked)
    model = prepare_model(model=copy.deepcopy(model).to(dtype), task=task)
    analyzer = Analyzer(analysis_name="kaisa_anchor", model=model, task=task, cpu=True,
                        log_level=logging.WARNING, disable_tqdm=True, output_dir=workdir)
    factor_args = FactorArguments(
        strategy="ekfac", use_empirical_fisher=empirical, amp_dtype=None,
        covariance_max_examples=None, lambda_max_examples=None,
        activation_covariance_dtype=dtype, gradient_covariance_dtype=dtype,
        eigendecomposition_dtype=F64, per_sample_gradient_dtype=dtype, lambda_dtype=dtype)
    score_args = ScoreArguments(
        damping_factor=damping, amp_dtype=None, query_gradient_low_rank=None,
        query_gradient_svd_dtype=dtype, per_sample_gradient_dtype=dtype,
        precondition_dtype=dtype, score_dtype=dtype)
    train_set, query_set = _indexed(train, dtype), _indexed(query, dtype)
    analyzer.fit_all_factors("f", train_set, per_device_batch_size=batch_size,
                             factor_args=factor_args, overwrite_output_dir=True)
    pairwise_args = copy.deepcopy(score_args)
    for key, value in (score_options or {}).items():
        setattr(pairwise_args, key, value)
    analyzer.compute_pairwise_scores(
        scores_name="pairwise", factors_name="f", query_dataset=query_set,
        train_dataset=train_set, per_device_query_batch_size=batch_size,
        per_device_train_batch_size=batch_size, score_args=pairwise_args,
        overwrite_output_dir=True)
    if self_scores:
        analyzer.compute_self_scores(
            scores_name="self", factors_name="f", train_dataset=train_set,
            per_device_train_batch_size=batch_size, score_args=score_args,
            overwrite_output_dir=True)
    cov = analyzer.load_covariance_matrices("f")
    eig = analyzer.load_eigendecomposition("f")
    lam = analyzer.load_lambda_matrices("f")
    factors = {}
    for name in cov["activation_covariance"]:
        lam_m = lam["lambda_matrix"][name].to(F64) / float(lam["num_lambda_processed"][name])
        factors[name] = {
            "A": cov["activation_covariance"][name]
            / float(cov["num_activation_covariance_processed"][name]),
            "S": cov["gradient_covariance"][name]
            / float(cov["num_gradient_covariance_processed"][name]),
            "QA": eig["activation_eigenvectors"][name],
            "QS": eig["gradient_eigenvectors"][name],
            "lambda": lam_m,
            "damping": float(damping) if damping is not None else float(0.1 * lam_m.mean()),
        }
    return {"factors": factors,
            "pairwise": analyzer.load_pairwise_scores("pairwise")["all_modules"],
            "self": analyzer.load_self_scores("self")["all_modules"] if self_scores else None}
