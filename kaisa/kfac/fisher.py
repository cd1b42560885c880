"""The backward passes that record :class:`kaisa.KFAC`'s G from the predictive distribution.

``curvature='mc'``: one pass per Monte-Carlo sample of the loss at targets drawn by
:meth:`kaisa.kfac.losses.Loss.sample_targets`. ``curvature='type2'``: one pass per column of
:meth:`kaisa.kfac.losses.Loss.fisher_sqrt`, the output gradients whose outer products sum to
the sampled gradients' covariance, so that G is the Monte-Carlo estimate's expectation
where each row of a block's output gradient depends on one position
(``docs/conventions.md``, "Where ``kaisa.KFAC``'s G comes from", has the definitions and
the scalars). Each pass runs inside the core's
:meth:`~kaisa.core.curvature.KFACCurvature.output_gradients` scope, which records it with
the Fisher scale; the first pass can also build the quadratic model's ``J^T``
(``jvp='double_backward'``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from kaisa.core.curvature import KFACCurvature
from kaisa.kfac import quadratic
from kaisa.kfac.amp import LossScaling
from kaisa.kfac.config import TYPE2_MAX_COLUMNS, Curvature, KFACOptimizerConfig
from kaisa.kfac.losses import Loss, Share
from kaisa.utils.profiling import phase

__all__ = ["backward_passes", "record_g", "upstream"]


def record_g(
    source: Curvature,
    curvature: KFACCurvature,
    loss: Loss,
    outputs: torch.Tensor,
    *,
    params: list[torch.Tensor],
    covered: list[torch.Tensor],
    samples: int,
    generator: torch.Generator,
    share: Share,
    divisor: float | torch.Tensor,
    scaled: Callable[[torch.Tensor], torch.Tensor],
    linearize: bool,
) -> quadratic.Linearization | None:
    """Runs the backward passes of ``source`` (``MC`` or ``TYPE2``) that record G.

    Args:
        source: ``Curvature.MC`` or ``Curvature.TYPE2``.
        curvature: The core whose hooks record the passes.
        loss: The declared loss.
        outputs: The model outputs, with the training forward's graph (kept).
        params: The parameters the passes differentiate where the forward kept no hooked
            outputs (:attr:`~kaisa.core.hooks.StatisticsRecorder.keep_outputs`; their ``.grad``
            is untouched).
        covered: The parameters the quadratic model's ``J^T`` is built over.
        samples: Monte-Carlo samples (``MC``).
        generator: The target sampler's generator (``MC``).
        share: This rank's rows of the global batch the targets are drawn for (``MC``).
        divisor: The Fisher scale times the loss scale (the recorder divides by it).
        scaled: Multiplies by the loss scale.
        linearize: Make the first pass the create-graph pass of ``J^T``.

    Returns:
        The linearisation built by the first pass, or ``None`` unless ``linearize``.

    Raises:
        ValueError: With ``TYPE2``, when the outputs' last dimension (the passes) exceeds
            :data:`~kaisa.kfac.config.TYPE2_MAX_COLUMNS`.
    """
    linearization: quadratic.Linearization | None = None
    # the passes need only the hooked outputs' gradients where the forward kept them (no
    # weight-gradient products); the list is dropped once they ran
    wrt: list[Any] = upstream(curvature.recorder.kept_outputs) or params
    if source is Curvature.MC:
        with curvature.output_gradients(passes=samples, divisor=divisor):
            for sample in range(samples):
                targets = loss.sample_targets(outputs, generator, share)
                if sample == 0 and linearize:
                    # this pass records G and builds J^T for the quadratic model;
                    # the seed is taken off the graph (no layer hook fires twice)
                    free = outputs.detach().requires_grad_(True)
                    (seed,) = torch.autograd.grad(scaled(loss(free, targets)), free)
                    linearization = quadratic.Linearization(outputs, covered, seed)
                else:
                    torch.autograd.grad(scaled(loss(outputs, targets)), wrt,
                                        retain_graph=True, allow_unused=True)
        curvature.recorder.kept_outputs.clear()
        return linearization
    columns = loss.fisher_sqrt(outputs)
    count = int(columns.shape[0])
    if count > TYPE2_MAX_COLUMNS:
        raise ValueError(
            f"curvature='type2' runs one backward pass per output column: outputs of shape "
            f"{tuple(outputs.shape)} need {count}, more than {TYPE2_MAX_COLUMNS} "
            f"(TYPE2_MAX_COLUMNS); use curvature='mc' (mc_samples sets its cost)"
        )
    # the recorder averages over the passes: K times each pass's G sums them
    with curvature.output_gradients(passes=count, divisor=divisor / math.sqrt(count)):
        for index in range(count):
            seed = scaled(columns[index])
            if index == 0 and linearize:
                linearization = quadratic.Linearization(outputs, covered, seed)
            else:
                torch.autograd.grad(outputs, wrt, grad_outputs=seed, retain_graph=True,
                                    allow_unused=True)
    curvature.recorder.kept_outputs.clear()
    return linearization


def backward_passes(
    config: KFACOptimizerConfig,
    curvature: KFACCurvature,
    loss: Loss,
    scaling: LossScaling,
    outputs: torch.Tensor,
    value: torch.Tensor,
    *,
    factor_step: bool,
    params: list[torch.Tensor],
    covered: list[torch.Tensor],
    generator: torch.Generator,
    share: Share,
    keep: bool,
) -> quadratic.Linearization | None:
    """A step's backward passes: G's (:func:`record_g`) on factor steps, then the gradient's.

    With ``'empirical'`` curvature (or off factor steps) the gradient's pass is the one
    the core records.

    Args:
        config: KFAC's configuration (the G source, ``mc_samples``, the Fisher scale).
        curvature: The core whose hooks record the passes.
        loss: The declared loss.
        scaling: The loss scaling (divisor and scaled loss).
        outputs: The model outputs, with the training forward's graph.
        value: The loss at the batch's targets (its gradient lands in ``.grad``).
        factor_step: Whether the factors are updated this step.
        params: The trainable parameters.
        covered: The parameters the quadratic model's ``J^T`` is built over.
        generator: The target sampler's generator.
        share: This rank's rows of the global batch.
        keep: Keep the graph and build ``J^T`` in the first G pass (``jvp='double_backward'``).

    Returns:
        The linearisation :func:`record_g` built, or ``None``.
    """
    fisher = (math.sqrt(loss.scale(outputs) / loss.examples(outputs))
              if config.fisher_scaled else 1.0)
    divisor = scaling.divisor(fisher)
    scaled = scaling.scaled
    linearization = None
    if config.curvature is not Curvature.EMPIRICAL and factor_step:
        with phase("curvature_backward"):  # the sampled targets' passes, G
            linearization = record_g(
                config.curvature, curvature, loss, outputs, params=params, covered=covered,
                samples=config.mc_samples, generator=generator, share=share, divisor=divisor,
                scaled=scaled, linearize=keep,
            )
        with curvature.output_gradients(passes=0), phase("backward"):
            torch.autograd.backward(scaled(value), retain_graph=keep)
    else:
        with curvature.output_gradients(passes=1, divisor=divisor), phase("backward"):
            torch.autograd.backward(scaled(value), retain_graph=keep)
    return linearization


def upstream(edges: list[GradientEdge]) -> list[GradientEdge]:
    """The edges no other edge's node precedes in the autograd graph.

    A backward pass asked for their gradients computes every other edge's on the way (each
    lies on a path from the loss to one of them), and returns only theirs: G's passes ask
    for these, not for every hooked output (whose gradients would all be held to the end
    of the pass).
    """
    targets = {e.node for e in edges}
    below: dict[Node, bool] = {}  # node -> whether an edge's node precedes it
    for start in targets:
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:  # iterative post-order: graphs are deeper than the recursion limit
            node, expanded = stack.pop()
            if node in below:
                continue
            children = [n for n, _ in node.next_functions if n is not None]
            if expanded:
                below[node] = any(n in targets or below[n] for n in children)
            else:
                stack.append((node, True))
                stack.extend((n, False) for n in children if n not in below)
    return [e for e in edges if not below[e.node]]
