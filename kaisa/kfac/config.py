"""The validated configuration of :class:`kaisa.KFAC`: its own arguments and the core's.

:class:`KFACOptimizerConfig` holds the optimizer's arguments (loss, curvature source,
step-size and damping rules) and a nested :class:`~kaisa.core.config.KFACConfig` for the
curvature core (the keyword arguments KFAC passes through). The defaults of the nested
configuration depend on the mode, and are decided here, in one place:

* ``kl_clip``: ``None`` with the adaptive lr (the quadratic model bounds the step; giving
  one is an error), else kfac-pytorch's 0.001;
* ``compute_method``: ``'pi_inverse'`` with the adaptive lr (two Cholesky inverses per
  block), else ``'eigen'`` (then the fixed mode equals ``KFACPreconditioner`` + SGD);
* ``compute_eigenvalue_outer_product``: off when the damping adapts (a stored
  ``1 / (dG dA^T + damping)`` would keep a stale damping), else kfac-pytorch's default;
* ``layer_kinds``: the Kronecker kinds (Linear, Conv2d, Conv1d, attention projections;
  ``KFACPreconditioner`` registers kfac-pytorch's Linear and Conv2d only, for parity). The
  diagonal ``'scale_shift'`` blocks and the ``'embedding'`` blocks (with the tied
  embedding/head block) are opt-in (``layer_kinds='all'``): on the byte GPT at the default
  damping each made the adaptive step diverge, while AdamW on those parameters did not;
* ``grad_scaler``: KFAC's own, so backward passes outside KFAC (without a closure) are
  unscaled by it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kaisa.core.config import KFACConfig
from kaisa.distributed.config import DistributedConfig
from kaisa.kfac.amp import LossScaling
from kaisa.kfac.losses import Loss, LossKind, Reduction
from kaisa.utils.enums import parse_enum

__all__ = [
    "ADAPTIVE",
    "Curvature",
    "FirstOrder",
    "JacobianMethod",
    "KFACOptimizerConfig",
    "StepSize",
    "TYPE2_MAX_COLUMNS",
    "default_first_order",
]

ADAPTIVE = "adaptive"
#: A fixed step size: a number or a callable of the step.
StepSize = float | Callable[[int], float]
#: Builds the optimizer of the parameters no curvature block covers.
FirstOrder = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class Curvature(enum.Enum):
    """Where the G factors come from (``docs/conventions.md`` defines each).

    ``EMPIRICAL``: the true loss's backward pass. ``MC``: ``mc_samples`` passes at targets
    sampled from the model's predictive distribution. ``TYPE2``: their expectation (where
    each row of a block's output gradient depends on one position), one pass per column
    of the loss Hessian's square root: as many as the outputs' last dimension, at most
    :data:`TYPE2_MAX_COLUMNS`.
    """

    EMPIRICAL = "empirical"
    MC = "mc"
    TYPE2 = "type2"


#: The most backward passes (output columns) ``curvature='type2'`` runs per factor step:
#: beyond it ``'mc'`` with as many samples costs the same (``docs/conventions.md``).
TYPE2_MAX_COLUMNS = 128


class JacobianMethod(enum.Enum):
    """How the quadratic model gets its Jacobian-vector products ``J v``.

    ``FORWARD``: forward-mode AD over a replayed forward pass of the closure (one per
    vector; works with every attention kernel). ``DOUBLE_BACKWARD``: the double-backward
    trick over the training graph (no extra forward, but fused attention kernels have no
    double backward).
    """

    FORWARD = "forward"
    DOUBLE_BACKWARD = "double_backward"


@dataclass(frozen=True, kw_only=True)
class KFACOptimizerConfig:
    """Every :class:`~kaisa.KFAC` argument except the model, validated.

    Build it with :meth:`of` (the constructor's arguments). Attributes are those
    arguments (see :class:`~kaisa.KFAC`), plus:

    Attributes:
        kfac: The curvature core's configuration.
        adaptive_lr: ``lr == 'adaptive'``.
        adaptive_momentum: ``momentum == 'adaptive'``.
        adaptive_damping: The LM rule runs (it needs the adaptive lr).
        fisher_scaled: G factors are scaled to the Fisher of the declared loss (sampled
            targets, the type-2 Fisher, or the adaptive mode); the fixed empirical mode
            keeps kfac-pytorch's convention.
        omega: The LM factor ``damping_decay ** damping_interval``.
        scaling: The loss scaling that drives ``grad_scaler`` (validated once, here).
    """

    loss: Loss
    curvature: Curvature
    jvp: JacobianMethod
    mc_samples: int
    lr: StepSize | str
    momentum: StepSize | str
    damping: float
    adaptive_damping: bool
    damping_interval: int
    damping_decay: float
    min_damping: float
    max_damping: float
    weight_decay: float
    seed: int
    grad_scaler: Any
    first_order: FirstOrder | None
    max_momentum: float | None
    kfac: KFACConfig
    adaptive_lr: bool = field(init=False)
    adaptive_momentum: bool = field(init=False)
    fisher_scaled: bool = field(init=False)
    omega: float = field(init=False)
    scaling: LossScaling = field(init=False, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        *,
        loss: LossKind | str,
        reduction: Reduction | str,
        curvature: Curvature | str,
        jvp: JacobianMethod | str,
        preconditioner: dict[str, Any],
        distributed: DistributedConfig | None = None,
        **arguments: Any,
    ) -> KFACOptimizerConfig:
        """Parses and validates the constructor's arguments.

        Args:
            loss: The loss name.
            reduction: Its reduction.
            curvature: ``'mc'``, ``'type2'`` or ``'empirical'``.
            jvp: ``'forward'`` or ``'double_backward'``.
            preconditioner: The keyword arguments for the core (``KFACConfig`` fields).
            distributed: The distributed settings (the core's ``distributed``).
            **arguments: The other :class:`~kaisa.KFAC` arguments.

        Raises:
            ValueError: Naming the invalid argument.
        """
        for reserved in ("damping", "lr"):
            if reserved in preconditioner:
                raise ValueError(f"{reserved} is set by KFAC, not a preconditioner argument")
        adaptive = _is_adaptive("lr", arguments["lr"])
        if adaptive and preconditioner.get("kl_clip") is not None:
            raise ValueError("kl_clip is for fixed lr; the quadratic model bounds the step")
        core = {
            "kl_clip": None if adaptive else 0.001,
            "compute_method": "pi_inverse" if adaptive else "eigen",
            "compute_eigenvalue_outer_product": not (adaptive and arguments["adaptive_damping"]),
            "layer_kinds": ("linear", "conv2d", "conv1d", "attention"),
            **preconditioner,
            "grad_scaler": arguments["grad_scaler"],
            "distributed": distributed,
        }
        return cls(
            loss=Loss.of(loss, reduction),
            curvature=parse_enum(Curvature, curvature, "curvature"),
            jvp=parse_enum(JacobianMethod, jvp, "jvp"),
            kfac=KFACConfig(**core),
            **arguments,
        )

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: derived fields once
        set_(self, "scaling", LossScaling(self.grad_scaler))
        _check_positive_int("mc_samples", self.mc_samples)
        _check_positive_int("damping_interval", self.damping_interval)
        adaptive_lr = _is_adaptive("lr", self.lr)
        adaptive_momentum = _is_adaptive("momentum", self.momentum)
        if adaptive_momentum and not adaptive_lr:
            raise ValueError("momentum='adaptive' needs lr='adaptive'")
        for name in ("damping", "min_damping", "max_damping", "damping_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a finite number > 0.0, got {value!r}")
        if not self.damping_decay < 1:
            raise ValueError(f"damping_decay must be < 1, got {self.damping_decay!r}")
        if not self.min_damping <= self.damping <= self.max_damping:
            raise ValueError("damping must lie in [min_damping, max_damping]")
        if self.max_momentum is not None and (
            isinstance(self.max_momentum, bool) or not isinstance(self.max_momentum, int | float)
            or not (math.isfinite(self.max_momentum) and self.max_momentum >= 0)
        ):
            raise ValueError(f"max_momentum must be None or a number >= 0, got "
                             f"{self.max_momentum!r}")
        if self.first_order is not None and not callable(self.first_order):
            raise ValueError(
                "first_order must be a callable building a torch.optim.Optimizer from a "
                f"list of parameters, got {self.first_order!r}"
            )
        if isinstance(self.weight_decay, bool) or not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("damping", "min_damping", "max_damping", "weight_decay"):
            set_(self, name, float(getattr(self, name)))
        set_(self, "adaptive_lr", adaptive_lr)
        set_(self, "adaptive_momentum", adaptive_momentum)
        # The LM rule compares with the quadratic model's prediction: adaptive lr only.
        set_(self, "adaptive_damping", bool(self.adaptive_damping) and adaptive_lr)
        set_(self, "fisher_scaled", self.curvature is not Curvature.EMPIRICAL or adaptive_lr)
        set_(self, "omega", self.damping_decay**self.damping_interval)

    def settings(self) -> dict[str, object]:
        """KFAC's own settings every rank must share (the core adds :attr:`kfac`'s).

        ``lr`` and ``momentum`` given as callables count with their value at step 0, a
        ``first_order`` rule with its name; the grad scaler with its type.
        """
        out: dict[str, object] = {"loss": (self.loss.kind, self.loss.reduction)}
        for name in ("curvature", "jvp", "mc_samples", "lr", "momentum", "damping",
                     "adaptive_damping", "damping_interval", "damping_decay", "min_damping",
                     "max_damping", "weight_decay", "seed", "first_order", "max_momentum"):
            value = getattr(self, name)
            out[name] = value(0) if name in ("lr", "momentum") and callable(value) else value
        scaler = self.grad_scaler
        out["grad_scaler"] = None if scaler is None else type(scaler).__qualname__
        return out

    def first_order_rule(self) -> FirstOrder | None:
        """The first-order rule of uncovered parameters; ``None``: the fixed SGD step."""
        if self.first_order is not None:
            return self.first_order
        return default_first_order if self.adaptive_lr else None

    def fixed(self, name: str) -> float:
        """The param-group default of a fixed ``lr``/``momentum``.

        NaN when adaptive or scheduled by a callable.
        """
        value = getattr(self, name)
        adaptive = self.adaptive_lr if name == "lr" else self.adaptive_momentum
        return math.nan if adaptive or callable(value) else float(value)


def default_first_order(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``torch.optim.AdamW(params, lr=1e-3)`` (torch's betas, eps and weight decay)."""
    return torch.optim.AdamW(params, lr=1e-3)


def _is_adaptive(name: str, value: object) -> bool:
    if isinstance(value, str):
        if value.strip().lower() != ADAPTIVE:
            raise ValueError(f"{name} must be a number, a callable or 'adaptive', got {value!r}")
        return True
    if callable(value):
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, a callable or 'adaptive', got {value!r}")
    return False


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
