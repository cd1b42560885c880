"""The validated configuration of :class:`kaisa.KFACMuon`: Muon's arguments, AdamW's, the core's.

:class:`MuonCurvature` names the three directions (``docs/conventions.md``, "KFACMuon");
:class:`KFACMuonConfig` checks Muon's and the curvature's arguments and builds the nested
:class:`~kaisa.core.config.KFACConfig`, whose KFACMuon-specific values are decided here:
``inv_update_steps`` is ``refresh_steps``; ``compute_method`` is ``'eigen'`` (EKFAC's
eigenbasis Adam) for ``'eigen'`` and ``'inverse'`` otherwise (the product computes ``M``
itself); no damping, KL clip or core ``lr``; ``inv_dtype`` defaults to the parameters'
working dtype.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

from kaisa.core.config import KFACConfig
from kaisa.ekfac.config import check_adam_group, check_factor_rows
from kaisa.muon.newton_schulz import check_adjust_lr_fn
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import BasisRefresh, ComputeMethod, parse_enum

__all__ = ["MUON_KINDS", "KFACMuonConfig", "MuonCurvature", "check_muon_group"]

#: The kinds :class:`kaisa.KFACMuon` registers by default (weight matrices, not embeddings).
MUON_KINDS = ("linear", "conv2d", "conv1d", "attention")
_ALLOWED_KINDS = frozenset(MUON_KINDS)


class MuonCurvature(enum.Enum):
    """What precedes Muon's orthogonalisation (``docs/conventions.md``, "KFACMuon")."""

    #: ``P = g``: ``torch.optim.Muon`` itself (nothing recorded, no factors).
    IDENTITY = "identity"
    #: Newton-Muon: ``P = g (A / k + ridge I)^-1``, one-sided (no output-gradient hooks).
    INPUT = "input"
    #: EKFAC's Adam step in the Kronecker eigenbasis, orthogonalised.
    EIGEN = "eigen"


def check_muon_group(group: dict[str, Any], where: str = "") -> None:
    """Raises ``ValueError`` unless a Muon group's values are ``torch.optim.Muon``'s."""
    for name in ("lr", "weight_decay", "momentum", "eps"):
        value = group[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0
        ):
            raise ValueError(f"{name}{where} must be a finite number >= 0, got {value!r}")
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"momentum{where} must be in [0, 1), got {group['momentum']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"ns_steps{where} must be an int in [0, 100), got {steps!r}")
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, tuple | list) or len(coefficients) != 3 or not all(
        isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c)
        for c in coefficients
    ):
        raise ValueError(f"ns_coefficients{where} must be three finite numbers, got "
                         f"{coefficients!r}")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov{where} must be a bool, got {group['nesterov']!r}")
    check_adjust_lr_fn(group["adjust_lr_fn"])


@dataclass(frozen=True, kw_only=True)
class KFACMuonConfig:
    """Every :class:`kaisa.KFACMuon` argument but the model and the param groups, validated.

    Attributes:
        curvature: The direction before the orthogonalisation.
        ridge: ``'input'``'s ridge, relative to ``A``'s mean eigenvalue.
        beta2: ``'eigen'``'s second-moment decay.
        adam_eps: ``'eigen'``'s Adam ``eps``.
        ns_dtype: Dtype of the Newton-Schulz iteration.
        factor_rows: Rows each call keeps for its factors (``None``: every row).
        max_input_dim: ``'input'``: the widest diagonal block of ``A`` (``None``: dense).
        max_basis_dim: ``'eigen'``: sides wider than this keep the identity basis.
        seed: Seed of the row generator.
        kfac: The curvature core's configuration.
    """

    curvature: MuonCurvature
    ridge: float
    beta2: float
    adam_eps: float
    ns_dtype: torch.dtype
    factor_rows: int | None
    max_input_dim: int | None
    max_basis_dim: int | None
    seed: int
    kfac: KFACConfig

    @classmethod
    def of(
        cls, *, curvature: MuonCurvature | str, ridge: float, beta2: float, adam_eps: float,
        ns_dtype: torch.dtype, factor_rows: int | None, seed: int, refresh_steps: Any,
        max_input_dim: int | None = None, max_basis_dim: int | None = None,
        inv_dtype: torch.dtype | None, weight_dtype: torch.dtype,
        layer_kinds: str | tuple[str, ...], **core: Any,
    ) -> KFACMuonConfig:
        """Validates the arguments (a ``ValueError`` naming the first bad one)."""
        mode = parse_enum(MuonCurvature, curvature, "curvature")
        if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not (
            math.isfinite(ridge) and ridge > 0
        ):
            raise ValueError(f"ridge must be a finite number > 0, got {ridge!r}")
        check_adam_group({"lr": 0.0, "betas": (0.0, beta2), "eps": adam_eps, "weight_decay": 0.0},
                         " (beta2, adam_eps)")
        if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
            raise ValueError(f"ns_dtype must be a floating-point torch.dtype, got {ns_dtype!r}")
        check_factor_rows(factor_rows)
        check_factor_rows(max_input_dim, "max_input_dim")
        check_factor_rows(max_basis_dim, "max_basis_dim")
        if max_input_dim is not None and mode is not MuonCurvature.INPUT:
            raise ValueError("max_input_dim applies to curvature='input' only")
        if max_basis_dim is not None and mode is not MuonCurvature.EIGEN:
            raise ValueError("max_basis_dim applies to curvature='eigen' only")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        kinds = KFACConfig(layer_kinds=layer_kinds).layer_kinds  # type: ignore[arg-type]
        if layer_kinds == "all":
            kinds = tuple(k for k in kinds if k in _ALLOWED_KINDS)
        wrong = [k for k in kinds if k not in _ALLOWED_KINDS]
        if wrong or not kinds:
            raise ValueError(f"layer_kinds of KFACMuon must be among {MUON_KINDS} (weight "
                             f"matrices; embeddings and norms take AdamW), got {layer_kinds!r}")
        if mode is not MuonCurvature.EIGEN:  # checked, but only the eigenbases use it
            parse_enum(BasisRefresh, core.pop("basis_refresh", BasisRefresh.EIGH),
                       "basis_refresh")
        kfac = KFACConfig(
            inv_update_steps=refresh_steps,
            compute_method=ComputeMethod.EIGEN if mode is MuonCurvature.EIGEN
            else ComputeMethod.INVERSE,
            compute_eigenvalue_outer_product=False,
            kl_clip=None,
            inv_dtype=working_dtype(weight_dtype) if inv_dtype is None else inv_dtype,
            layer_kinds=kinds,
            **core,
        )
        return cls(curvature=mode, ridge=float(ridge), beta2=float(beta2),
                   adam_eps=float(adam_eps), ns_dtype=ns_dtype, factor_rows=factor_rows,
                   max_input_dim=max_input_dim, max_basis_dim=max_basis_dim, seed=seed,
                   kfac=kfac)

    def settings(self) -> dict[str, object]:
        """The settings every rank must share, beyond the core's."""
        return {"curvature": self.curvature.value, "ridge": self.ridge, "beta2": self.beta2,
                "adam_eps": self.adam_eps, "ns_dtype": str(self.ns_dtype),
                "factor_rows": self.factor_rows, "max_input_dim": self.max_input_dim,
                "max_basis_dim": self.max_basis_dim, "seed": self.seed}
