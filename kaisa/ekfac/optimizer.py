"""``kaisa.EKFAC``: Adam in the Kronecker eigenbasis, a drop-in for ``torch.optim.AdamW``.

EKFAC (George et al., 2018) with Adam's moments, as SOAP (Vyas et al., 2024) runs them in
Shampoo's eigenbasis; the exact update is ``docs/conventions.md``'s "EKFAC" section. On
the curvature core (:class:`~kaisa.core.curvature.KFACCurvature`: every KAISA strategy works):
the hooks record the K-FAC factors of the registered blocks on factor-update steps, the
bases are refreshed every ``basis_update_steps`` (by ``eigh`` or a warm-started QR step),
and each block's Adam step runs in its eigenbasis on its gradient workers
(:meth:`~kaisa.core.curvature.KFACCurvature.transform` with
:meth:`~kaisa.methods.EigenAdamMethod.adam_step`; the moments live with the bases).
Parameters no Kronecker block covers take ``torch.optim.AdamW``'s step. With the identity
basis EKFAC is AdamW bit for bit.

Usage, as AdamW's::

    opt = kaisa.EKFAC(model, lr=1e-3, weight_decay=0.1)
    loss.backward(); opt.step(); opt.zero_grad()

Mixed precision: pass the ``torch.amp.GradScaler`` as ``grad_scaler`` (the hooks divide
the output gradients by its scale) and call ``scaler.step(opt)`` and ``scaler.update()``
as for AdamW; bf16 autocast needs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from kaisa.core.config import KFACConfig
from kaisa.core.curvature import KFACCurvature
from kaisa.core.optimizer import CurvatureOptimizer, partition_groups
from kaisa.core.recording import ArmPlan
from kaisa.core.schedule import warm_refresh
from kaisa.distributed.config import DistributedConfig
from kaisa.ekfac.config import KRONECKER_KINDS, BasisRefresh, EKFACConfig, check_adam_group
from kaisa.methods import EigenAdamMethod
from kaisa.utils.enums import AssignmentStrategy, DistributedStrategy, FactorStorage, KFACApprox
from kaisa.utils.first_order import AdamStep, adamw_update, step_count
from kaisa.utils.hyperparams import Schedule, Schedules
from kaisa.utils.profiling import phase
from kaisa.utils.ranks import rank
from kaisa.utils.shards import rows_of

__all__ = ["EKFAC", "BasisRefresh"]

#: The core's schedules EKFAC evaluates (numbers or callables of the step).
_SCHEDULES = ("factor_update_steps", "basis_update_steps", "factor_decay")


class EKFAC(CurvatureOptimizer):
    """Adam in the eigenbasis of each block's K-FAC factors (see the module docstring).

    Args:
        model: The model; its Kronecker blocks (``layer_kinds``) take the EKFAC step, every
            other trainable parameter AdamW's.
        lr: Learning rate (AdamW's meaning; the default of the param groups).
        betas: ``(beta1, beta2)`` of Adam's moments.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay (``p <- p (1 - lr wd)``).
        param_groups: Parameter groups as for ``torch.optim`` (dicts with ``'params'`` and
            any of ``lr``, ``betas``, ``eps``, ``weight_decay``) that partition the model's
            trainable parameters; default one group of all. A block's parameters must
            share ``lr``, ``betas`` and ``eps``.
        factor_update_steps: Steps between factor updates (int or callable of the step).
        basis_update_steps: Steps between eigenbasis refreshes (int or callable).
        factor_decay: Running-average decay of the factors (float or callable).
        basis_refresh: ``'eigh'`` (the default: always a full one), ``'qr'`` (a
            warm-started subspace-iteration step, a full ``eigh`` every
            ``eigh_every``-th refresh) or ``'auto'`` (``'qr'`` on a CUDA device, where an
            ``eigh`` is far slower than the product and QR of a warm start, ``'eigh'``
            elsewhere).
        eigh_every: See ``basis_refresh``.
        kfac_approx: Linear blocks on sequences: ``'expand'`` or ``'reduce'``.
        factor_storage: ``'dense'`` running factors, or ``'packed'``: their upper
            triangles, about half the bytes (``docs/conventions.md``, "Packed factors").
        factor_rows: Row-subsampled factor statistics: each call of a Linear, attention or
            embedding block (tied or not; not convolutions) with more rows than
            ``factor_rows`` computes its ``A`` and ``G`` from ``factor_rows`` of them drawn
            at random, the same rows for both (an unbiased estimate of the full factors,
            ``docs/conventions.md``, "Row-subsampled factor statistics"); ``None`` (the
            default) keeps every row. An int ``>= 1``; needs
            ``update_factors_in_hook=True``.
        seed: Seed of the generator the row subsets are drawn from (a CPU
            ``torch.Generator`` seeded ``seed + rank``; its state is in
            :meth:`state_dict`).
        max_basis_dim: One-sided bases, as SOAP's ``max_precond_dim``: a side of a Linear
            or attention block whose dimension exceeds it is kept as its diagonal and
            not rotated (its statistics, decomposition and rotations skipped;
            ``docs/conventions.md``, "One-sided bases"); ``None`` (the default) rotates
            every side. An int ``>= 1``.
        layer_kinds: The block kinds to register (``'all'``: every Kronecker kind).
        skip_layers: Module names or class names (regular expressions) not to register.
        cross_attention: Which ``nn.MultiheadAttention`` modules have the cross-attention
            layout (``None``: decoder layers' and those whose first call has a query, key
            and value that are not one tensor; see :class:`~kaisa.core.config.KFACConfig`).
        factor_dtype: Factor dtype (``None``: the activations', at least float32).
        inv_dtype: Dtype of the bases and moments (``None``: the parameters' working dtype).
        accumulation_steps: Micro-batches (backward passes) per step.
        update_factors_in_hook: Compute the factors in the hooks (else in :meth:`step`).
        grad_scaler: The ``torch.amp.GradScaler`` used with ``scaler.step(opt)``, or
            ``None``.
        grad_worker_fraction: KAISA's strategy (:class:`~kaisa.DistributedStrategy`, a
            float in ``(0, 1]`` or ``'auto'`` with ``memory_budget_mb`` and/or
            ``cost_model``).
        memory_budget_mb: Per-rank budget of ``'auto'``.
        cost_model: The time objective of ``'auto'`` (such as
            :class:`kaisa.plan.FractionObjective`): the fraction it predicts fastest
            within ``memory_budget_mb``; ``None``: the memory rule.
        assignment_strategy: Cost model for placing the refreshes.
        colocate_factors: Whether the A and G refreshes of a block share a rank.
        symmetry_aware: Send symmetric factors as triangles.
        allreduce_bucket_cap_mb: Fusion bucket capacity.
        collective_timeout: Seconds a kaisa collective may wait (``None``: the group's).
        loglevel: Logging level of the informational messages.
        distributed: The distributed settings above (``grad_worker_fraction`` to
            ``collective_timeout``) as one :class:`~kaisa.DistributedConfig`, as every
            product takes them (not with those keywords too).

    Raises:
        ValueError: For invalid arguments (naming them).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        param_groups: Iterable[dict[str, Any]] | None = None,
        factor_update_steps: Schedule[int] = 1,
        basis_update_steps: Schedule[int] = 10,
        factor_decay: Schedule[float] = 0.95,
        basis_refresh: BasisRefresh | str = BasisRefresh.EIGH,
        eigh_every: int = 10,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        factor_storage: FactorStorage | str = FactorStorage.DENSE,
        factor_rows: int | None = None,
        seed: int = 0,
        max_basis_dim: int | None = None,
        layer_kinds: str | tuple[str, ...] = KRONECKER_KINDS,
        skip_layers: str | list[str] | None = None,
        cross_attention: str | list[str] | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        accumulation_steps: int = 1,
        update_factors_in_hook: bool = True,
        grad_scaler: Any = None,
        grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT,
        memory_budget_mb: float | None = None,
        cost_model: Any = None,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        symmetry_aware: bool = False,
        allreduce_bucket_cap_mb: float = 25.0,
        collective_timeout: float | None = None,
        loglevel: int = logging.DEBUG,
        distributed: DistributedConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model must be a torch.nn.Module (EKFAC(model, lr=...), not "
                f"EKFAC(model.parameters(), ...)), got {type(model).__name__}"
            )
        arguments = dict(locals())
        params = [p for p in model.parameters() if p.requires_grad]
        core = {k: arguments[k] for k in KFACConfig.keywords()
                if k in arguments and k not in ("lr", "inv_dtype", "layer_kinds")}
        self.config = config = EKFACConfig.of(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            basis_update_steps=basis_update_steps, inv_dtype=inv_dtype, layer_kinds=layer_kinds,
            weight_dtype=params[0].dtype if params else torch.float32,
            factor_rows=factor_rows, seed=seed, max_basis_dim=max_basis_dim, **core,
        )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(_groups(params, param_groups), defaults)
        for i, group in enumerate(self.param_groups):
            check_adam_group(group, f" of param group {i}")
        self._schedules = Schedules({"factor_update_steps": factor_update_steps,
                                     "basis_update_steps": basis_update_steps,
                                     "factor_decay": factor_decay})
        self._method = EigenAdamMethod()
        #: The row subsets' generator (``factor_rows``): advanced only by their draws.
        self.row_generator = torch.Generator().manual_seed(config.seed + rank())
        self.curvature = KFACCurvature(model, config.kfac, stacklevel=2,
                                       settings=config.settings(), method=self._method,
                                       factor_rows=config.factor_rows,
                                       row_generator=self.row_generator,
                                       max_dense_dim=config.max_basis_dim)
        self._covered = {id(p) for b in self.curvature.blocks.values() if not b.diagonal
                         for p in b.parameters()}
        #: Steps taken (:meth:`step` calls, overflowed ones included).
        self.steps = 0
        #: Basis refreshes so far (counts ``eigh_every``).
        self.refreshes = 0
        self._arm()

    # ------------------------------------------------------------------ step
    def _curvature_phases(self) -> None:
        """Factors when due, then the bases when due (``basis_update_steps``)."""
        steps, schedules = self.steps, self._schedules
        if steps % schedules.integer("factor_update_steps", steps) == 0:
            self.curvature.update_factors(schedules.real("factor_decay", steps),
                                          zero_start=True)
        if steps % schedules.integer("basis_update_steps", steps) == 0:
            warm = warm_refresh(self.refreshes, self.config.basis_refresh,
                                self.config.eigh_every, cuda=self.curvature.on_cuda)
            self.curvature.update_decompositions(0.0, warm_start=warm)
            self.refreshes += 1

    def _update(self) -> None:
        """The EKFAC step of every block with a gradient, AdamW's of the rest."""
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        steps: dict[str, AdamStep] = {}
        counted: dict[int, torch.Tensor] = {}  # each parameter's step count, once
        stepped: list[tuple[str, dict[str, Any], int]] = []  # (block, group, id of its weight)
        for block in (b for b in self.curvature.blocks.values() if not b.diagonal):
            if block.weight.grad is None:
                continue
            group = group_of[id(block.weight)]
            for p in block.parameters()[1:]:
                other = group_of[id(p)]
                if any(other[k] != group[k] for k in ("lr", "betas", "eps")):
                    raise ValueError(
                        f"the parameters of block {block.name!r} are in param groups with "
                        "different lr, betas or eps: EKFAC keeps one Adam state per block")
            for p in block.parameters():  # once per step, also when blocks share p's rows
                if p.grad is not None and id(p) not in counted:
                    if "step" not in self.state[p]:
                        self.state[p]["step"] = step_count()
                    counted[id(p)] = self.state[p]["step"]
            stepped.append((block.name, group, id(block.weight)))
        if counted:  # one multi-tensor increment, one read of the (CPU) counts
            torch._foreach_add_(list(counted.values()), 1)
            values = dict(zip(counted, torch.stack(list(counted.values())).tolist(),
                              strict=True))
        for name, group, index in stepped:
            beta1, beta2 = group["betas"]
            steps[name] = AdamStep(float(group["lr"]), float(beta1), float(beta2),
                                   float(group["eps"]), float(values[index]))
        method, dtype = self._method, self.config.kfac.inv_dtype
        results = self.curvature.transform_grouped(
            lambda block, grad: method.adam_step(block.decomposition, grad, steps[block.name],
                                                 dtype=dtype, diagonal=block.diagonal_sides),
            lambda group, grad: method.adam_step(group.stacked, grad,
                                                 steps[group.blocks[0].name], dtype=dtype),
            # one Adam step for the stack: the same scalars and weight decay for every part
            uniform=lambda group: len({(steps[b.name], group_of[id(p)]["weight_decay"])
                                       for b in group.blocks for p in b.parameters()}) == 1)
        with phase("update"):
            targets: list[torch.Tensor] = []
            parts: list[torch.Tensor] = []
            for stacked, _, update in results.groups:
                dst, src = stacked.destinations(update, params=True)
                targets += dst
                parts += src
            decay: dict[float, list[torch.Tensor]] = {}
            for p in targets:
                g = group_of[id(p)]
                if g["weight_decay"] != 0:
                    decay.setdefault(1 - g["lr"] * g["weight_decay"], []).append(p)
            for factor, ps in decay.items():
                torch._foreach_mul_(ps, factor)
            if targets:
                torch._foreach_add_(targets, parts)
            for entry in results.single:
                block = entry.block
                for p, part, rows in zip(block.parameters(), block.parts(entry.direction),
                                         block.row_slices(), strict=True):
                    if p.grad is None:
                        continue
                    target = rows_of(p, p, rows)  # the block's rows of a shared p (held: FSDP2)
                    group = group_of[id(p)]
                    if group["weight_decay"] != 0:
                        target.mul_(1 - group["lr"] * group["weight_decay"])
                    target.add_(part)
        with phase("first_order"):
            for group in self.param_groups:
                adamw_update([p for p in group["params"] if id(p) not in self._covered],
                             self.state, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                             weight_decay=group["weight_decay"])

    def _arm(self) -> None:
        """Whether the coming forward passes record (and how they fold), when first needed."""
        def plan() -> ArmPlan:
            s = self.steps
            recording = s % self._schedules.integer("factor_update_steps", s) == 0
            return recording, self._schedules.real("factor_decay", s) if recording else None

        self.curvature.arm_when_used(plan, zero_start=True)


def _groups(
    params: Sequence[torch.Tensor], given: Iterable[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The param groups: ``given`` (checked to partition ``params``), or one of all."""
    if given is None:
        return [{"params": list(params)}]
    return partition_groups(params, given)
