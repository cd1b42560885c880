"""Optimisers, learning-rate schedules and the K-FAC preconditioner from CLI options."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import torch
from torch import nn

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw", "kfac", "ekfac", "kfac-muon")
"""``kfac`` is :class:`kaisa.KFAC` (adaptive lr, momentum and damping); ``ekfac`` is
:class:`kaisa.EKFAC` (Adam in the K-FAC eigenbasis, AdamW's lr and schedule); ``kfac-muon``
is :class:`kaisa.KFACMuon` (Muon on the weight matrices after K-FAC's curvature, AdamW on
the rest); ``sgd+kfac`` is SGD with :class:`kaisa.KFACPreconditioner`."""
#: The optimizers that are K-FAC themselves (no ``+kfac``; they own their curvature).
OWN_CURVATURE: tuple[str, ...] = ("kfac", "ekfac", "kfac-muon")
#: ``--kfac-muon-curvature``: what precedes Muon's orthogonalisation in kaisa.KFACMuon.
MUON_CURVATURES: tuple[str, ...] = ("input", "eigen", "identity")
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step")
STRATEGIES: tuple[str, ...] = ("comm_opt", "mem_opt", "hybrid_opt")
DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_kfac(model: nn.Module, options: argparse.Namespace) -> Any:
    """The adaptive :class:`kaisa.KFAC` optimizer from the ``--kfac-*`` options."""
    import kaisa

    return kaisa.KFAC(
        model,
        loss="mse" if options.task == "autoencode" else "cross_entropy",
        curvature=options.kfac_curvature,
        jvp=options.kfac_jvp,
        min_damping=options.kfac_min_damping,
        adaptive_damping=options.kfac_adaptive_damping,
        damping_interval=options.kfac_damping_interval,
        weight_decay=options.weight_decay,
        seed=options.seed,
        **_curvature_arguments(options),
    )


def _curvature_arguments(options: argparse.Namespace) -> dict[str, Any]:
    """The ``--kfac-*`` options that ``KFAC`` and ``KFACPreconditioner`` share."""
    skip = [name for name in options.kfac_skip_layers.split(",") if name] or None
    return {
        "factor_update_steps": options.kfac_factor_update_steps,
        "inv_update_steps": options.kfac_inv_update_steps,
        "decomposition_spread": options.kfac_decomposition_spread,
        **({} if options.kfac_basis_refresh is None else {
            "basis_refresh": options.kfac_basis_refresh}),
        "eigh_every": options.kfac_eigh_every,
        "damping": options.kfac_damping,
        "factor_decay": options.kfac_factor_decay,
        "allreduce_bucket_cap_mb": options.kfac_bucket_cap_mb,
        "assignment_strategy": options.kfac_assignment_strategy,
        "colocate_factors": options.kfac_colocate_factors,
        "compute_method": options.kfac_compute_method,
        "grad_worker_fraction": options.kfac_grad_worker_fraction,
        "memory_budget_mb": options.kfac_memory_budget_mb,
        "symmetry_aware": options.kfac_symmetry_aware,
        "factor_dtype": DTYPES[options.kfac_factor_dtype],
        "inv_dtype": DTYPES[options.kfac_inv_dtype] or torch.float32,
        "skip_layers": skip,
        "kfac_approx": options.kfac_approx,
        "factor_storage": options.kfac_factor_storage,
        **({} if options.kfac_layer_kinds is None else {"layer_kinds": options.kfac_layer_kinds}),
        **({} if options.kfac_cross_attention is None else {
            "cross_attention": [n for n in options.kfac_cross_attention.split(",") if n]}),
        "loglevel": getattr(logging, options.kfac_loglevel),
        "collective_timeout": options.kfac_collective_timeout,
    }


def build_ekfac(model: nn.Module, options: argparse.Namespace) -> Any:
    """:class:`kaisa.EKFAC` from ``--lr``, ``--weight-decay`` and the ``--kfac-*`` options.

    ``--kfac-inv-update-steps`` is its ``basis_update_steps``; the damping and the compute
    method do not apply.
    """
    import kaisa

    curvature = _curvature_arguments(options)
    if curvature.pop("decomposition_spread") != 1:
        raise ValueError("--kfac-decomposition-spread does not apply to --optimizer ekfac "
                         "(it refreshes every basis on its refresh steps)")
    for name in ("damping", "compute_method", "inv_dtype"):
        del curvature[name]
    return kaisa.EKFAC(
        model, lr=options.lr, weight_decay=options.weight_decay,
        basis_update_steps=curvature.pop("inv_update_steps"),
        inv_dtype=DTYPES[options.kfac_inv_dtype],
        accumulation_steps=options.accumulation_steps,
        update_factors_in_hook=options.kfac_update_factors_in_hook,
        **curvature,
    )


def build_kfac_muon(model: nn.Module, options: argparse.Namespace) -> Any:
    """:class:`kaisa.KFACMuon` from ``--lr``, ``--weight-decay`` and the ``--kfac-*`` options.

    ``--lr`` and ``--weight-decay`` are Muon's (the weight matrices of the K-FAC blocks);
    the other parameters take AdamW at ``--kfac-muon-adamw-lr`` with ``--weight-decay``.
    ``--kfac-muon-curvature`` picks the direction; ``--kfac-inv-update-steps`` is its
    ``refresh_steps`` (``M`` or the bases). The damping, the compute method, the
    decomposition spread, the factor storage and the memory budget do not apply.
    Embeddings, and a head tied to one (the GPT of ``--task lm``), take AdamW.

    Raises:
        ValueError: For a ``--kfac-*`` option that does not apply given another value than
            its default, or from :class:`kaisa.KFACMuon`.
    """
    import kaisa

    curvature = _curvature_arguments(options)
    for name, flag, default in (("decomposition_spread", "decomposition-spread", 1),
                                ("factor_storage", "factor-storage", "dense"),
                                ("memory_budget_mb", "memory-budget-mb", None)):
        if curvature.pop(name) != default:
            raise ValueError(f"--kfac-{flag} does not apply to --optimizer kfac-muon")
    for name in ("damping", "compute_method", "inv_dtype"):
        del curvature[name]
    return kaisa.KFACMuon(
        model, lr=options.lr, weight_decay=options.weight_decay,
        curvature=options.kfac_muon_curvature,
        adamw_lr=options.kfac_muon_adamw_lr, adamw_weight_decay=options.weight_decay,
        refresh_steps=curvature.pop("inv_update_steps"),
        inv_dtype=DTYPES[options.kfac_inv_dtype],
        accumulation_steps=options.accumulation_steps,
        seed=options.seed,
        **curvature,
    )


def build_optimizer(model: nn.Module, options: argparse.Namespace) -> torch.optim.Optimizer:
    """Create the SGD, AdamW, EKFAC or KFACMuon optimiser described by ``options``."""
    params = model.parameters()
    if options.optimizer == "ekfac":
        return build_ekfac(model, options)  # type: ignore[no-any-return]
    if options.optimizer == "kfac-muon":
        return build_kfac_muon(model, options)  # type: ignore[no-any-return]
    if options.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=options.lr,
            momentum=options.momentum,
            nesterov=options.nesterov,
            weight_decay=options.weight_decay,
        )
    if options.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    raise ValueError(f"unknown optimizer {options.optimizer!r}; choose from {OPTIMIZERS}")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at iteration ``step``.

    Linear warmup over ``warmup_steps``, then ``constant``, ``cosine`` (to zero
    at ``total_steps``) or ``step`` (x0.1 at 50% and again at 75% of
    ``total_steps``).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, options: argparse.Namespace, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-iteration schedule over ``options.epochs`` epochs with warmup."""
    warmup = round(options.warmup_epochs * steps_per_epoch)
    total = options.epochs * steps_per_epoch

    def factor(step: int) -> float:
        return lr_factor(step, schedule=options.schedule, warmup_steps=warmup, total_steps=total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def parse_worker_fraction(text: str) -> Any:
    """Parse ``--kfac-grad-worker-fraction``: a strategy name, ``auto`` or a float in (0, 1]."""
    from kaisa.enums import parse_grad_worker_fraction

    try:
        return parse_grad_worker_fraction(float(text))
    except ValueError:
        pass
    try:
        return parse_grad_worker_fraction(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(STRATEGIES)}, auto or a float in (0, 1], got {text!r}"
        ) from None


def parse_kl_clip(text: str) -> float | None:
    """Parse ``--kfac-kl-clip``: a float or ``none`` to disable clipping."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a float or 'none', got {text!r}") from None


def build_preconditioner(
    model: nn.Module, options: argparse.Namespace, optimizer: torch.optim.Optimizer
) -> Any:
    """Create a :class:`kaisa.KFACPreconditioner` from the ``--kfac-*`` options.

    The preconditioner's ``lr`` follows the optimiser's (scheduled) learning
    rate, so the KL clip sees the step size actually taken.

    Raises:
        ValueError: From the preconditioner, for invalid arguments or a model
            without supported layers.
    """
    import kaisa

    return kaisa.KFACPreconditioner(
        model,
        kl_clip=parse_kl_clip(str(options.kfac_kl_clip)),
        lr=lambda _step: float(optimizer.param_groups[0]["lr"]),
        accumulation_steps=options.accumulation_steps,
        compute_eigenvalue_outer_product=options.kfac_eigenvalue_outer_product,
        update_factors_in_hook=options.kfac_update_factors_in_hook,
        **_curvature_arguments(options),
    )
