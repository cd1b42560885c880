"""The validated configuration of :class:`~kaisa.KFACPreconditioner`: one dataclass.

:class:`KFACConfig` holds every constructor keyword with kfac-pytorch's names and
defaults, validates it once (a ``ValueError`` naming the argument) and keeps enums as
enums. The preconditioner's signature repeats the fields only to stay a drop-in
replacement; a test checks that the two agree.

Hyperparameters given as callables of the step are checked when evaluated
(:func:`~kaisa.utils.hyperparams.scheduled_int`,
:func:`~kaisa.utils.hyperparams.scheduled_float`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kaisa.distributed.config import DistributedConfig, EngineConfig
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import (
    AssignmentStrategy,
    BasisRefresh,
    ComputeMethod,
    DistributedStrategy,
    FactorStorage,
    KFACApprox,
    parse_enum,
    parse_grad_worker_fraction,
)
from kaisa.utils.hyperparams import Schedule, check_bounded, check_float, check_int

__all__ = ["HYPERPARAMETERS", "REFERENCE_KINDS", "KFACConfig"]

#: kfac-pytorch's layer kinds: ``KFACPreconditioner``'s default.
REFERENCE_KINDS = ("linear", "conv2d")

#: Hyperparameters that may be numbers or callables of the step.
HYPERPARAMETERS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)

_FLAGS = (
    "colocate_factors",
    "compute_eigenvalue_outer_product",
    "symmetry_aware",
    "update_factors_in_hook",
)


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Every :class:`~kaisa.KFACPreconditioner` argument except the model, validated.

    Attributes:
        factor_update_steps: Steps between factor updates (int or callable).
        inv_update_steps: Steps between decomposition updates (int or callable).
        decomposition_spread: Parts the blocks are split into, each decomposed on its own
            steps of the ``inv_update_steps`` interval (``docs/conventions.md``, "Spread
            decompositions"); 1, the default, decomposes every block at once.
        basis_refresh: The eigen method's decompositions: ``'eigh'`` (the reference's:
            a full eigendecomposition every time), ``'qr'`` (one subspace-iteration step
            warm-started from the previous eigenbasis, with a full one every
            ``eigh_every``-th decomposition step; ``docs/conventions.md``, "Warm-started
            eigenbases") or ``'auto'`` (``'qr'`` on a CUDA device, ``'eigh'`` elsewhere;
            other methods ignore it).
        eigh_every: With ``'qr'``, every how many decomposition steps one is full.
        damping: Damping (float or callable).
        factor_decay: Running-average decay (float or callable).
        kl_clip: KL-clip threshold (float or callable), ``None`` disables clipping.
        lr: Learning rate used by KL clipping (float or callable).
        accumulation_steps: Micro-batches per optimisation step.
        allreduce_bucket_cap_mb: Fusion bucket capacity of the communicator.
        assignment_strategy: Cost model for placing decompositions.
        colocate_factors: Whether the A and G decompositions of a layer share a rank.
        compute_method: Eigendecompositions or inverses.
        compute_eigenvalue_outer_product: Whether the eigenvalue outer product is stored.
        grad_worker_fraction: A :class:`DistributedStrategy`, a float in ``(0, 1]`` or
            ``'auto'``.
        memory_budget_mb: Per-rank budget for ``grad_worker_fraction='auto'``, else
            ``None``.
        cost_model: The time objective of ``grad_worker_fraction='auto'`` (a
            :class:`kaisa.distributed.FractionCost`, such as
            :class:`kaisa.plan.FractionObjective`): ``'auto'`` then takes the fraction it
            predicts fastest among those within ``memory_budget_mb`` (every fraction
            without a budget); ``None``: the memory rule.
        symmetry_aware: Whether symmetric matrices are sent as upper triangles.
        grad_scaler: A gradient scaler, a callable returning the loss scale, or ``None``.
        factor_dtype: Factor dtype, ``None`` to follow the activations (at least
            float32).
        inv_dtype: Storage dtype of the decompositions.
        skip_layers: Regular expressions of module names or class names not to register
            (a string or a list; stored as a tuple).
        update_factors_in_hook: Whether factors are computed in the hooks (else in
            :meth:`~kaisa.KFACPreconditioner.step`).
        kfac_approx: Linear blocks on sequences: ``'expand'`` (every position a row, the
            default) or ``'reduce'`` (one row per example; Eschenhagen et al., 2023).
        factor_storage: ``'dense'`` running factors, or ``'packed'``: their upper triangles,
            about half the bytes (``docs/conventions.md``, "Packed factors").
        layer_kinds: The block kinds to register: kfac-pytorch's ``('linear', 'conv2d')``
            by default (the reference's math), ``'all'`` for every kind (adds
            ``'conv1d'``, ``'embedding'``, ``'scale_shift'``: LayerNorm, RMSNorm, BatchNorm affine,
            and
            ``'attention'``: ``nn.MultiheadAttention``'s projections), or a tuple of kind
            names; stored as a tuple.
        cross_attention: Which ``nn.MultiheadAttention`` modules have the
            cross-attention layout (three in-projection blocks, query and key/value
            apart; ``docs/conventions.md``): ``None`` (the default) for every
            ``nn.TransformerDecoderLayer.multihead_attn`` and every other MHA whose
            first call has a query, key and value that are not one tensor (detected
            then, before anything is recorded), or regular expressions of module names
            (a string or a list; stored as a tuple) naming exactly those modules, every
            other MHA then having the self-attention layout.
        loglevel: Logging level of the informational messages.
        collective_timeout: Seconds a K-FAC collective (factor averages, decomposition
            and gradient broadcasts, control reductions) may wait for its peers before it
            fails with an error naming the collective, the ranks and the timeout; ``None``
            uses the default process group's timeout (30 minutes on gloo). It does not
            cover collectives outside kaisa, such as DDP's gradient allreduce: those are
            bounded by the process group's own timeout
            (``init_process_group(timeout=...)``; ``kaisa-train --pg-timeout``).
        distributed: The distributed settings (``grad_worker_fraction`` to
            ``collective_timeout``) as one :class:`~kaisa.DistributedConfig`, instead of
            those keywords (giving both is a ``ValueError``); then it holds them validated
            (:meth:`distributed_settings` gives them however they were given).
    """

    factor_update_steps: Schedule[int] = 1
    inv_update_steps: Schedule[int] = 1
    decomposition_spread: int = 1
    basis_refresh: BasisRefresh = BasisRefresh.EIGH
    eigh_every: int = 10
    damping: Schedule[float] = 0.001
    factor_decay: Schedule[float] = 0.95
    kl_clip: Schedule[float] | None = 0.001
    lr: Schedule[float] = 0.1
    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = 25.0
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    compute_method: ComputeMethod = ComputeMethod.EIGEN
    compute_eigenvalue_outer_product: bool = True
    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT
    memory_budget_mb: float | None = None
    cost_model: Any = None
    symmetry_aware: bool = False
    grad_scaler: Any = None
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype = torch.float32
    skip_layers: tuple[str, ...] = ()
    update_factors_in_hook: bool = True
    kfac_approx: KFACApprox = KFACApprox.EXPAND
    factor_storage: FactorStorage = FactorStorage.DENSE
    layer_kinds: str | tuple[str, ...] = REFERENCE_KINDS
    cross_attention: str | tuple[str, ...] | None = None
    loglevel: int = logging.DEBUG
    collective_timeout: float | None = None
    distributed: DistributedConfig | None = field(default=None, compare=False)
    skip_patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    cross_attention_patterns: tuple[re.Pattern[str], ...] | None = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        _take_distributed(self)
        check_int("factor_update_steps", self.factor_update_steps)
        check_int("inv_update_steps", self.inv_update_steps)
        for name in ("damping", "factor_decay", "lr"):
            check_bounded(name, getattr(self, name))
        if self.kl_clip is not None:
            check_bounded("kl_clip", self.kl_clip)
        for name in ("accumulation_steps", "decomposition_spread", "eigh_every"):
            check_int(name, getattr(self, name))
            if callable(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 1")
        cap = self.allreduce_bucket_cap_mb
        if callable(cap):
            raise ValueError("allreduce_bucket_cap_mb must be a number")
        check_float("allreduce_bucket_cap_mb", cap, low=0.0, low_inclusive=True)
        set_(self, "allreduce_bucket_cap_mb", float(cap))
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        set_(self, "compute_method",
             parse_enum(ComputeMethod, self.compute_method, "compute_method"))
        set_(self, "kfac_approx", parse_enum(KFACApprox, self.kfac_approx, "kfac_approx"))
        set_(self, "basis_refresh",
             parse_enum(BasisRefresh, self.basis_refresh, "basis_refresh"))
        if (self.basis_refresh is BasisRefresh.QR
                and self.compute_method is not ComputeMethod.EIGEN):
            raise ValueError("basis_refresh='qr' warm-starts eigenbases: it needs "
                             f"compute_method='eigen', got {self.compute_method.value!r}")
        set_(self, "factor_storage",
             parse_enum(FactorStorage, self.factor_storage, "factor_storage"))
        set_(self, "layer_kinds", _parse_layer_kinds(self.layer_kinds))
        set_(self, "assignment_strategy",
             parse_enum(AssignmentStrategy, self.assignment_strategy, "assignment_strategy"))
        fraction = parse_grad_worker_fraction(self.grad_worker_fraction)
        set_(self, "grad_worker_fraction", fraction)
        budget = self.memory_budget_mb
        if fraction == "auto" and budget is None and self.cost_model is None:
            raise ValueError("grad_worker_fraction='auto' needs memory_budget_mb (or a "
                             "cost_model)")
        if self.cost_model is not None and (fraction != "auto" or not callable(self.cost_model)):
            raise ValueError("cost_model must be a callable cost model (kaisa.plan."
                             "FractionObjective), used with grad_worker_fraction='auto'")
        if fraction != "auto" and budget is not None:
            raise ValueError("memory_budget_mb is only used with grad_worker_fraction='auto'")
        if budget is not None:
            if callable(budget):
                raise ValueError("memory_budget_mb must be a number")
            check_float("memory_budget_mb", budget, low=0.0)
        for name in ("factor_dtype", "inv_dtype"):
            dt = getattr(self, name)
            if dt is None and name == "factor_dtype":
                continue
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"{name} must be a floating torch.dtype, got {dt!r}")
        scaler = self.grad_scaler
        if scaler is not None and not (callable(scaler) or hasattr(scaler, "get_scale")):
            raise ValueError(
                "grad_scaler must be a torch.amp.GradScaler, torch.cuda.amp.GradScaler or a "
                f"callable returning the loss scale, got {type(scaler).__name__}"
            )
        if isinstance(self.loglevel, bool) or not isinstance(self.loglevel, int):
            raise ValueError(f"loglevel must be an int logging level, got {self.loglevel!r}")
        if self.collective_timeout is not None:
            if callable(self.collective_timeout):
                raise ValueError("collective_timeout must be a number of seconds or None")
            check_float("collective_timeout", self.collective_timeout, low=0.0)
            set_(self, "collective_timeout", float(self.collective_timeout))
        if self.distributed is not None:  # given: it holds the validated settings
            set_(self, "distributed", self.distributed_settings())
        patterns = _parse_skip_layers(self.skip_layers)
        set_(self, "skip_layers", patterns)
        try:
            set_(self, "skip_patterns", tuple(re.compile(p) for p in patterns))
        except re.error as err:
            raise ValueError(f"skip_layers has an invalid regular expression: {err}") from None
        cross = self.cross_attention
        if cross is not None:
            cross = _parse_patterns("cross_attention", cross)
        set_(self, "cross_attention", cross)
        try:
            set_(self, "cross_attention_patterns",
                 None if cross is None else tuple(re.compile(p) for p in cross))
        except re.error as err:
            raise ValueError(f"cross_attention has an invalid regular expression: {err}"
                             ) from None

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """The constructor keywords (every field the user sets)."""
        return tuple(f.name for f in fields(cls) if f.init)

    def settings(self) -> dict[str, object]:
        """The settings every rank must share: each that changes the math or the schedule.

        A schedule given as a callable counts with its value at step 0; the grad scaler
        with its type; ``loglevel`` and ``collective_timeout`` may differ.
        """
        out: dict[str, object] = {}
        for name in self.keywords():
            value = getattr(self, name)
            if name in ("loglevel", "collective_timeout", "distributed"):
                continue
            if name in ("grad_scaler", "cost_model"):
                value = None if value is None else type(value).__qualname__
            elif name in HYPERPARAMETERS and callable(value):
                value = value(0)
            out[name] = value
        return out

    def distributed_settings(self) -> DistributedConfig:
        """The validated distributed settings, given as keywords or as ``distributed``."""
        return DistributedConfig(
            **{f.name: getattr(self, f.name) for f in fields(DistributedConfig)})

    def engine_config(self, weight_dtype: torch.dtype) -> EngineConfig:
        """The part the distributed engine needs.

        Args:
            weight_dtype: The model's parameter dtype (the factors' when
                ``factor_dtype`` is ``None``: at least float32).
        """
        shared = {f.name: getattr(self, f.name) for f in fields(EngineConfig)
                  if f.name != "packed_factors"}
        shared["factor_dtype"] = self.factor_dtype or working_dtype(weight_dtype)
        shared["packed_factors"] = self.factor_storage is FactorStorage.PACKED
        return EngineConfig(**shared)


def _take_distributed(config: KFACConfig) -> None:
    """Takes ``config.distributed``'s settings (none of them given as keywords too)."""
    given = config.distributed
    if given is None:
        return
    if not isinstance(given, DistributedConfig):
        raise ValueError("distributed must be a kaisa.DistributedConfig, got "
                         f"{type(given).__name__}")
    defaults = {f.name: f.default for f in fields(KFACConfig)}
    names = [f.name for f in fields(DistributedConfig)]
    both = [n for n in names  # (a copy, as dataclasses.replace makes one, has both: the same)
            if getattr(config, n) != defaults[n] and getattr(config, n) != getattr(given, n)]
    if both:
        raise ValueError(f"give the distributed settings either as distributed= or as "
                         f"keywords, not both: {both} given as keywords too")
    for name in names:
        object.__setattr__(config, name, getattr(given, name))


def _parse_layer_kinds(value: object) -> tuple[str, ...]:
    from kaisa.blocks import BLOCK_KINDS  # the registry names the kinds

    known = tuple(kind.kind for kind in BLOCK_KINDS)
    if isinstance(value, str) and value.strip().lower() == "all":
        return known
    if isinstance(value, str):
        value = tuple(v.strip() for v in value.split(",") if v.strip())
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(v, str) and v in known for v in value
    ):
        raise ValueError(
            f"layer_kinds must be 'all' or a non-empty tuple of {known}, got {value!r}"
        )
    return tuple(value)


def _parse_skip_layers(skip_layers: object) -> tuple[str, ...]:
    if skip_layers is None:
        return ()
    return _parse_patterns("skip_layers", skip_layers)


def _parse_patterns(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise ValueError(f"{name} must be a str or a list of str, got {value!r}")
