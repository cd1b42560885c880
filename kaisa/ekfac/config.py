"""The validated configuration of :class:`kaisa.EKFAC`: AdamW's arguments and the core's.

:class:`EKFACConfig` holds the Adam hyperparameters (the defaults of the param groups,
checked like ``torch.optim.AdamW``'s), the basis refresh, and a nested
:class:`~kaisa.core.config.KFACConfig` for the curvature core, whose EKFAC-specific values are
decided here, in one place:

* ``inv_update_steps`` is ``basis_update_steps``; ``compute_method`` is ``'eigen'``
  (EKFAC's :class:`~kaisa.methods.EigenAdamMethod`), without the eigenvalue outer product;
  ``damping``, ``kl_clip`` and ``lr`` of the core are unused (no damping: Adam's ``eps``
  plays its part);
* ``inv_dtype``: the dtype of the bases and the moments, by default the parameters'
  working dtype (float64 stays float64, else float32);
* ``layer_kinds``: the Kronecker kinds (Linear, Conv2d, Conv1d, Embedding, attention by default;
  ``'all'`` means all of them); a diagonal kind (``'scale_shift'``) registers nothing, its
  eigenbasis being the identity: its parameters take AdamW's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kaisa.core.config import KFACConfig
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import BasisRefresh, ComputeMethod

__all__ = [
    "KRONECKER_KINDS", "BasisRefresh", "EKFACConfig", "check_adam_group", "check_factor_rows",
]

#: The kinds :class:`kaisa.EKFAC` registers by default.
KRONECKER_KINDS = ("linear", "conv2d", "conv1d", "embedding", "attention")


def check_adam_group(group: dict[str, Any], where: str = "") -> None:
    """Raises ``ValueError`` unless ``lr``, ``betas``, ``eps``, ``weight_decay`` are AdamW's.

    ``lr``, ``eps`` and ``weight_decay`` finite numbers ``>= 0``; ``betas`` two numbers in
    ``[0, 1)``.
    """
    for name in ("lr", "eps", "weight_decay"):
        value = group[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0
        ):
            raise ValueError(f"{name}{where} must be a finite number >= 0, got {value!r}")
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2 or not all(
        not isinstance(b, bool) and isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas
    ):
        raise ValueError(f"betas{where} must be two numbers in [0, 1), got {betas!r}")


def check_factor_rows(value: object, name: str = "factor_rows") -> None:
    """Raises ``ValueError`` unless ``value`` is ``None`` or an int ``>= 1`` (not a bool)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EKFACConfig:
    """Every :class:`kaisa.EKFAC` argument except the model and its param groups, validated.

    Attributes:
        lr: Default learning rate of the param groups.
        betas: Default ``(beta1, beta2)``.
        eps: Default ``eps``.
        weight_decay: Default decoupled weight decay.
        factor_rows: Rows each call of a Linear, attention or embedding block keeps for its
            factors (a random subset), ``None`` for every row.
        seed: Seed of the row generator (``seed + rank`` on each rank).
        max_basis_dim: Sides of Linear and attention blocks larger than this keep the
            identity basis (``None``: every side rotated).
        kfac: The curvature core's configuration.
    """

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    factor_rows: int | None
    seed: int
    max_basis_dim: int | None
    kfac: KFACConfig

    @classmethod
    def of(
        cls,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        basis_update_steps: Any,
        inv_dtype: torch.dtype | None,
        layer_kinds: str | tuple[str, ...],
        weight_dtype: torch.dtype,
        factor_rows: int | None = None,
        seed: int = 0,
        max_basis_dim: int | None = None,
        **core: Any,
    ) -> EKFACConfig:
        """Validates the arguments (a ``ValueError`` naming the first bad one).

        Args:
            lr: See :class:`kaisa.EKFAC`.
            betas: See :class:`kaisa.EKFAC`.
            eps: See :class:`kaisa.EKFAC`.
            weight_decay: See :class:`kaisa.EKFAC`.
            basis_update_steps: Steps between refreshes (the core's ``inv_update_steps``).
            inv_dtype: Dtype of the bases and moments, ``None`` for ``weight_dtype``'s
                working dtype.
            layer_kinds: The kinds to register (diagonal kinds dropped).
            weight_dtype: The parameters' dtype.
            factor_rows: ``None`` or an int ``>= 1`` (needs ``update_factors_in_hook``).
            seed: An int (not a bool).
            max_basis_dim: ``None`` or an int ``>= 1``.
            **core: The other :class:`~kaisa.core.config.KFACConfig` keywords (among them
                ``basis_refresh`` and ``eigh_every``).
        """
        check_adam_group({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        check_factor_rows(factor_rows)
        check_factor_rows(max_basis_dim, "max_basis_dim")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        if factor_rows is not None and not core.get("update_factors_in_hook", True):
            raise ValueError("factor_rows needs update_factors_in_hook=True (the row subsets "
                             "are drawn in the hooks)")
        kfac = KFACConfig(
            inv_update_steps=basis_update_steps,
            compute_method=ComputeMethod.EIGEN,
            compute_eigenvalue_outer_product=False,
            kl_clip=None,
            inv_dtype=working_dtype(weight_dtype) if inv_dtype is None else inv_dtype,
            layer_kinds=_kronecker_kinds(layer_kinds),
            **core,
        )
        return cls(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                   weight_decay=float(weight_decay),
                   factor_rows=factor_rows, seed=seed,
                   max_basis_dim=max_basis_dim, kfac=kfac)

    def settings(self) -> dict[str, object]:
        """The settings every rank must share, beyond the core's."""
        return {"betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "lr": self.lr, "factor_rows": self.factor_rows,
                "seed": self.seed, "max_basis_dim": self.max_basis_dim}

    @property
    def basis_refresh(self) -> BasisRefresh:
        """How bases are refreshed (the core's ``basis_refresh``)."""
        return self.kfac.basis_refresh

    @property
    def eigh_every(self) -> int:
        """With ``'qr'``, every how many refreshes one is a full ``eigh`` (the core's)."""
        return self.kfac.eigh_every


def _kronecker_kinds(value: object) -> tuple[str, ...]:
    """``layer_kinds`` as :class:`~kaisa.KFACConfig` parses it, without diagonal kinds."""
    from kaisa.blocks import BLOCK_KINDS

    parsed = KFACConfig(layer_kinds=value).layer_kinds  # type: ignore[arg-type]
    diagonal = {kind.kind for kind in BLOCK_KINDS if kind.diagonal}
    kinds = tuple(k for k in parsed if k not in diagonal)
    if not kinds:
        raise ValueError(f"layer_kinds={value!r} has no Kronecker kind; EKFAC needs one of "
                         f"{KRONECKER_KINDS}")
    return kinds
