"""``kaisa.KFACMuon``: K-FAC's curvature in front of Muon's orthogonalisation.

A drop-in for ``torch.optim.Muon`` on the weight matrices of the model's Kronecker blocks,
with ``torch.optim.AdamW`` on every other trainable parameter (``docs/conventions.md``,
"KFACMuon"). ``curvature`` picks the direction Muon orthogonalises:

* ``'input'`` (Newton-Muon): the gradient times ``(A / k + ridge I)^-1``, ``A`` the
  running second moment of the layer's inputs; one-sided, no output-gradient hooks;
* ``'eigen'``: EKFAC's Adam step in the Kronecker eigenbasis;
* ``'identity'``: the gradient itself, ``torch.optim.Muon`` + ``torch.optim.AdamW`` bit
  for bit.

On the curvature core (:class:`~kaisa.core.curvature.KFACCurvature`): every KAISA
strategy works; a block's curvature, momentum and orthogonalised update are computed on
its gradient workers (:meth:`~kaisa.core.curvature.KFACCurvature.transform_grouped`) and
broadcast, and matrices of one shape are orthogonalised together. Usage::

    opt = kaisa.KFACMuon(model, lr=0.05, adamw_lr=3e-3)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from kaisa.core.curvature import KFACCurvature
from kaisa.core.optimizer import CurvatureOptimizer, partition_groups
from kaisa.core.recording import ArmPlan
from kaisa.core.schedule import warm_refresh
from kaisa.distributed.config import DistributedConfig
from kaisa.ekfac.config import check_adam_group
from kaisa.methods import EigenAdamMethod
from kaisa.methods.base import State
from kaisa.muon.config import MUON_KINDS, KFACMuonConfig, MuonCurvature, check_muon_group
from kaisa.muon.methods import InputMuonMethod, input_inverse, input_parts
from kaisa.muon.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    adjusted_lr,
    momentum_update,
    orthogonalize,
)
from kaisa.utils.enums import (
    AssignmentStrategy,
    BasisRefresh,
    DistributedStrategy,
    KFACApprox,
    Side,
)
from kaisa.utils.first_order import AdamStep, adamw_update, step_count
from kaisa.utils.hyperparams import Schedule, Schedules
from kaisa.utils.profiling import phase
from kaisa.utils.ranks import rank
from kaisa.utils.shards import rows_of

__all__ = ["KFACMuon", "MuonCurvature"]

_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps",
              "ns_steps", "adjust_lr_fn")


class KFACMuon(CurvatureOptimizer):
    """Muon with K-FAC's curvature (see the module docstring and ``docs/conventions.md``).

    Args:
        model: The model; the weights of its Kronecker blocks (``layer_kinds``) take the
            Muon step, every other trainable parameter AdamW's.
        lr: Muon's learning rate.
        weight_decay: Muon's decoupled weight decay.
        momentum: Muon's momentum (``'eigen'``: Adam's ``beta1``).
        nesterov: Muon's Nesterov mix (``'identity'`` and ``'input'``).
        ns_coefficients: The Newton-Schulz coefficients ``(a, b, c)``.
        eps: The Newton-Schulz norm's floor.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``'original'`` or ``'match_rms_adamw'`` (Muon's).
        curvature: ``'eigen'`` (the default: the mode that reached Muon's loss first on
            the wide byte GPT, ``docs/benchmarks.md``), ``'input'`` or ``'identity'``.
        param_groups: Parameter groups (dicts with ``'params'`` and any per-group value)
            that partition the model's trainable parameters, each holding block weights
            (Muon's keys) or other parameters (AdamW's keys, defaulting to the ``adamw_*``
            arguments) only; default one group of each.
        adamw_lr: AdamW's learning rate for the other parameters.
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's eps.
        adamw_weight_decay: AdamW's weight decay.
        factor_update_steps: Steps between factor updates (int or callable of the step).
        refresh_steps: Steps between refreshes of ``M`` or of the bases (int or callable).
        factor_decay: Running-average decay of the factors (float or callable).
        ridge: ``'input'``: the ridge relative to ``A``'s mean eigenvalue.
        beta2: ``'eigen'``: the second moment's decay.
        adam_eps: ``'eigen'``: Adam's eps.
        basis_refresh: ``'eigen'``: ``'eigh'`` (the default), ``'qr'`` or ``'auto'`` (as
            EKFAC's).
        eigh_every: ``'eigen'`` with ``'qr'``: every how many refreshes a full ``eigh``.
        ns_dtype: Dtype of the Newton-Schulz iteration (Muon's bfloat16).
        batch_matrices: Orthogonalise the matrices of one shape together (``bmm``: the same
            operations as Muon's per matrix, whose bfloat16 products may round differently
            in the order of their float32 sums); ``False``: one matrix at a time with
            Muon's own calls. ``None`` (the default): ``True``, but ``False`` with
            ``curvature='identity'``, which is then ``torch.optim.Muon`` bit for bit.
        factor_rows: Rows each call of a block keeps for its factors (a random subset,
            ``docs/conventions.md``, "Row-subsampled factor statistics"; ``None``: all).
        max_input_dim: ``'input'``: an input wider than this is split into equal diagonal
            blocks of at most this width (``A`` replaced by its block diagonal; ``None``:
            dense).
        max_basis_dim: ``'eigen'``: sides wider than this keep the identity basis (as
            EKFAC's one-sided bases; ``None``: every side rotated).
        seed: Seed of the row generator (``seed + rank``).
        layer_kinds: The block kinds whose weights take the Muon step.
        skip_layers: Module or class names (regular expressions) left to AdamW.
        cross_attention: As for :class:`kaisa.EKFAC`.
        kfac_approx: Linear blocks on sequences: ``'expand'`` or ``'reduce'``.
        factor_dtype: Factor dtype (``None``: the activations', at least float32).
        inv_dtype: Dtype of ``M``, the bases and the moments (``None``: the parameters'
            working dtype).
        accumulation_steps: Micro-batches (backward passes) per step.
        grad_scaler: The ``torch.amp.GradScaler`` used with ``scaler.step(opt)``.
        grad_worker_fraction: KAISA's strategy.
        assignment_strategy: Cost model for placing the refreshes.
        colocate_factors: Whether the A and G refreshes of a block share a rank.
        symmetry_aware: Send symmetric factors as triangles.
        allreduce_bucket_cap_mb: Fusion bucket capacity.
        collective_timeout: Seconds a kaisa collective may wait.
        loglevel: Logging level of the informational messages.
        distributed: The distributed settings as one :class:`~kaisa.DistributedConfig`.

    Raises:
        ValueError: For invalid arguments (naming them).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        curvature: MuonCurvature | str = MuonCurvature.EIGEN,
        param_groups: Iterable[dict[str, Any]] | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        factor_update_steps: Schedule[int] = 1,
        refresh_steps: Schedule[int] = 10,
        factor_decay: Schedule[float] = 0.95,
        ridge: float = 0.2,
        beta2: float = 0.95,
        adam_eps: float = 1e-8,
        basis_refresh: BasisRefresh | str = BasisRefresh.EIGH,
        eigh_every: int = 10,
        ns_dtype: torch.dtype = torch.bfloat16,
        batch_matrices: bool | None = None,
        factor_rows: int | None = None,
        max_input_dim: int | None = None,
        max_basis_dim: int | None = None,
        seed: int = 0,
        layer_kinds: str | tuple[str, ...] = MUON_KINDS,
        skip_layers: str | list[str] | None = None,
        cross_attention: str | list[str] | None = None,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        accumulation_steps: int = 1,
        grad_scaler: Any = None,
        grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        symmetry_aware: bool = False,
        allreduce_bucket_cap_mb: float = 25.0,
        collective_timeout: float | None = None,
        loglevel: int = logging.DEBUG,
        distributed: DistributedConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module (KFACMuon(model, lr=...)), got "
                             f"{type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        self.config = config = KFACMuonConfig.of(
            curvature=curvature, ridge=ridge, beta2=beta2, adam_eps=adam_eps,
            ns_dtype=ns_dtype, factor_rows=factor_rows, seed=seed, refresh_steps=refresh_steps,
            max_input_dim=max_input_dim, max_basis_dim=max_basis_dim,
            inv_dtype=inv_dtype, weight_dtype=params[0].dtype if params else torch.float32,
            layer_kinds=layer_kinds, factor_update_steps=factor_update_steps,
            factor_decay=factor_decay, basis_refresh=basis_refresh, eigh_every=eigh_every,
            skip_layers=skip_layers, cross_attention=cross_attention, kfac_approx=kfac_approx,
            factor_dtype=factor_dtype, accumulation_steps=accumulation_steps,
            grad_scaler=grad_scaler, grad_worker_fraction=grad_worker_fraction,
            assignment_strategy=assignment_strategy, colocate_factors=colocate_factors,
            symmetry_aware=symmetry_aware, allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            collective_timeout=collective_timeout, loglevel=loglevel, distributed=distributed,
        )
        self.mode = config.curvature
        if batch_matrices is not None and not isinstance(batch_matrices, bool):
            raise ValueError(f"batch_matrices must be a bool or None, got {batch_matrices!r}")
        self.batch_matrices = (self.mode is not MuonCurvature.IDENTITY
                               if batch_matrices is None else batch_matrices)
        self._method = (EigenAdamMethod() if self.mode is MuonCurvature.EIGEN
                        else InputMuonMethod(config.ridge, config.max_input_dim))
        self.row_generator = torch.Generator().manual_seed(config.seed + rank())
        self.curvature = KFACCurvature(model, config.kfac, stacklevel=2,
                                       settings=config.settings(), method=self._method,
                                       factor_rows=config.factor_rows,
                                       row_generator=self.row_generator, bias_columns=False,
                                       max_dense_dim=config.max_basis_dim)
        # One-sided: Newton-Muon needs the inputs' A alone; identity records nothing.
        self.curvature.recorder.output_gradients = self.mode is MuonCurvature.EIGEN
        muon = {id(b.weight) for b in self.curvature.blocks.values()}
        self._muon = muon
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                    "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        adamw = {"lr": adamw_lr, "betas": tuple(adamw_betas), "eps": adamw_eps,
                 "weight_decay": adamw_weight_decay}
        super().__init__(_groups(params, param_groups, muon, adamw), defaults)
        for i, group in enumerate(self.param_groups):
            if group["use_muon"]:
                check_muon_group(group, f" of param group {i}")
            else:
                check_adam_group(group, f" of param group {i}")
        self._schedules = Schedules({"factor_update_steps": factor_update_steps,
                                     "refresh_steps": refresh_steps,
                                     "factor_decay": factor_decay})
        #: Steps taken (:meth:`step` calls, overflowed ones included).
        self.steps = 0
        #: Refreshes so far (counts ``eigh_every``).
        self.refreshes = 0
        self._arm()

    # ------------------------------------------------------------------ step
    def _curvature_phases(self) -> None:
        """Factors when due, then ``M`` or the bases when due (``refresh_steps``)."""
        steps, schedules = self.steps, self._schedules
        if self.mode is MuonCurvature.IDENTITY:
            return
        if steps % schedules.integer("factor_update_steps", steps) == 0:
            self.curvature.update_factors(schedules.real("factor_decay", steps),
                                          zero_start=True)
        if steps % schedules.integer("refresh_steps", steps) == 0:
            self._refresh()

    def _refresh(self) -> None:
        """``M`` of each block this rank preconditions (``'input'``), or the bases."""
        if self.mode is MuonCurvature.EIGEN:
            warm = warm_refresh(self.refreshes, self.config.kfac.basis_refresh,
                                self.config.kfac.eigh_every, cuda=self.curvature.on_cuda)
            self.curvature.update_decompositions(0.0, warm_start=warm)
        elif self.curvature.engine.owned_factors:  # FSDP2: A on its owner, M sent from it
            self.curvature.update_decompositions(0.0)
        else:
            with self.curvature.timed("decompositions"):
                by_size: dict[tuple[int, torch.dtype], list[tuple[Any, torch.Tensor]]] = {}
                for name, block in self.curvature.blocks.items():
                    a = block.a
                    if a is not None and self.curvature.is_grad_worker(name):
                        by_size.setdefault((a.shape[-1], a.dtype), []).append((block, a))
                dtype = self.config.kfac.inv_dtype
                for members in by_size.values():
                    stack = torch.cat([a for _, a in members])
                    parts = input_parts(stack.shape[-1], self.config.max_input_dim)
                    inverse = input_inverse(stack, self.config.ridge, dtype,
                                            name=f"A of {members[0][0].name}", parts=parts)
                    sizes = [a.shape[0] for _, a in members]
                    for (block, _), part in zip(members, torch.split(inverse, sizes),
                                                strict=True):
                        block.decomposition["a_inv"] = part
        self.refreshes += 1

    def _direction(self, state: State, grad: torch.Tensor, group: dict[str, Any],
                   count: float, diagonal: frozenset[Side] = frozenset()) -> torch.Tensor:
        """``O`` of one block or of a stack of one shape (conventions, steps 1-3)."""
        if self.mode is MuonCurvature.EIGEN:
            assert isinstance(self._method, EigenAdamMethod)
            step = AdamStep(-1.0, float(group["momentum"]), self.config.beta2,
                            self.config.adam_eps, count)
            u = self._method.adam_step(state, grad, step, dtype=self.config.kfac.inv_dtype,
                                       diagonal=diagonal)
        else:
            p = grad if "a_inv" not in state else self._method.precondition(state, grad, 0.0)
            assert p is not None
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            u = momentum_update(state["momentum_buffer"], p, float(group["momentum"]),
                                bool(group["nesterov"]))
        o = orthogonalize(u, tuple(group["ns_coefficients"]), int(group["ns_steps"]),
                          float(group["eps"]), self.config.ns_dtype)
        return o.to(grad.dtype)

    def _update(self) -> None:
        """The Muon step of every block with a gradient, AdamW's of the rest."""
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        blocks = [b for b in self.curvature.blocks.values() if b.weight.grad is not None]
        counts: dict[str, float] = {}
        if self.mode is MuonCurvature.EIGEN and blocks:
            steps: dict[int, torch.Tensor] = {}  # once per weight (experts share one)
            for b in blocks:
                state = self.state[b.weight]
                if "step" not in state:
                    state["step"] = step_count()
                steps.setdefault(id(b.weight), state["step"])
            torch._foreach_add_(list(steps.values()), 1)
            values = dict(zip(steps, torch.stack(list(steps.values())).tolist(), strict=True))
            counts = {b.name: values[id(b.weight)] for b in blocks}

        def group(name: str) -> dict[str, Any]:
            return group_of[id(self.curvature.blocks[name].weight)]

        def key(name: str) -> tuple[int, float]:
            return id(group(name)), counts.get(name, 0.0)

        results = self.curvature.transform_grouped(
            lambda block, grad: self._direction(block.decomposition, grad, group(block.name),
                                                counts.get(block.name, 0.0),
                                                block.diagonal_sides),
            lambda g, grad: self._direction(g.stacked, grad, group(g.blocks[0].name),
                                            counts.get(g.blocks[0].name, 0.0)),
            uniform=lambda g: self.batch_matrices and len({key(b.name) for b in g.blocks}) == 1)
        with phase("update"):
            scaled: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            decay: dict[float, list[torch.Tensor]] = {}

            def add(p: torch.Tensor, target: torch.Tensor, part: torch.Tensor, rows: int,
                    cols: int) -> None:  # target: p, or the rows of it this rank holds
                g = group_of[id(p)]
                if g["weight_decay"] != 0:
                    decay.setdefault(1 - g["lr"] * g["weight_decay"], []).append(target)
                dst, src = scaled.setdefault(
                    -adjusted_lr(g["lr"], g["adjust_lr_fn"], rows, cols), ([], []))
                dst.append(target)
                src.append(part)

            for stacked, _, update in results.groups:
                dst, src = stacked.destinations(update, params=True)
                for p, part in zip(dst, src, strict=True):
                    add(p, p, part, *update.shape[-2:])
            for entry in results.single:
                block = entry.block
                rows, cols = entry.direction.shape[-2:] if not block.sharded() else \
                    block.dims[::-1]
                for p, part, sl in zip(block.parameters(), block.parts(entry.direction),
                                       block.row_slices(), strict=True):
                    add(p, rows_of(p, p, sl), part, rows, cols)
            for factor, ps in decay.items():
                torch._foreach_mul_(ps, factor)
            for alpha, (dst, src) in scaled.items():
                torch._foreach_add_(dst, src, alpha=alpha)
        with phase("first_order"):
            for g in self.param_groups:
                if not g["use_muon"]:
                    adamw_update([p for p in g["params"] if id(p) not in self._muon],
                                 self.state, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                 weight_decay=g["weight_decay"])

    def _arm(self) -> None:
        """Whether the coming forward passes record statistics (and how they fold)."""
        if self.mode is MuonCurvature.IDENTITY:
            return

        def plan() -> ArmPlan:
            s = self.steps
            record = s % self._schedules.integer("factor_update_steps", s) == 0
            return record, self._schedules.real("factor_decay", s) if record else None

        # input mode: A in the forward hook, folded in step() (no backward hook)
        self.curvature.arm_when_used(plan, fold=self.mode is MuonCurvature.EIGEN,
                                     zero_start=True)


def _groups(
    params: Sequence[torch.Tensor], given: Iterable[dict[str, Any]] | None, muon: set[int],
    adamw: dict[str, Any],
) -> list[dict[str, Any]]:
    """The param groups, each marked ``use_muon``; AdamW's filled from ``adamw``."""
    if given is None:
        groups: list[dict[str, Any]] = [
            {"params": [p for p in params if id(p) in muon]},
            {"params": [p for p in params if id(p) not in muon]}]
        groups = [g for g in groups if g["params"]]
    else:
        groups = partition_groups(params, given)
    for i, g in enumerate(groups):
        kinds = {id(p) in muon for p in g["params"]}
        if len(kinds) > 1:
            raise ValueError(f"param group {i} mixes block weights (Muon) with other "
                             "parameters (AdamW): give them separate groups")
        g["use_muon"] = kinds == {True}
        if not g["use_muon"]:
            for k, v in adamw.items():
                g.setdefault(k, v)
            extra = [k for k in g if k in _MUON_KEYS and k not in adamw]
            if extra:
                raise ValueError(f"param group {i} holds AdamW parameters but sets Muon's "
                                 f"{extra}")
    return groups
