"""Second-order methods: how a layer's Kronecker factors are inverted and applied.

Adding a method (e.g. eigenvalue-corrected K-FAC) is one new module implementing
:class:`~kaisa.methods.base.SecondOrderMethod` plus one line in :data:`METHODS` (and its
:class:`~kaisa.utils.enums.ComputeMethod` member). The decomposition ladder they share
(:mod:`kaisa.methods.linalg`: eigendecompositions and damped inverses batched by size,
the float64 retry and the keep-previous fallback, warm-started eigenbases) is here too.
"""

from __future__ import annotations

from collections.abc import Callable

from kaisa.methods.base import DENSE, Batch, Damping, Diagonal, Payload, SecondOrderMethod, State
from kaisa.methods.eigen import EigenMethod
from kaisa.methods.eigen_adam import EigenAdamMethod
from kaisa.methods.inverse import InverseMethod, PiInverseMethod
from kaisa.utils.enums import ComputeMethod

__all__ = [
    "DENSE",
    "METHODS",
    "Batch",
    "Damping",
    "Diagonal",
    "EigenAdamMethod",
    "EigenMethod",
    "InverseMethod",
    "Payload",
    "PiInverseMethod",
    "SecondOrderMethod",
    "State",
    "make_method",
]

#: Method factories by compute method; each takes ``outer_product`` (ignored where moot).
METHODS: dict[ComputeMethod, Callable[[bool], SecondOrderMethod]] = {
    ComputeMethod.EIGEN: lambda outer_product: EigenMethod(outer_product=outer_product),
    ComputeMethod.INVERSE: lambda outer_product: InverseMethod(),
    ComputeMethod.PI_INVERSE: lambda outer_product: PiInverseMethod(),
}


def make_method(kind: ComputeMethod, *, outer_product: bool = True) -> SecondOrderMethod:
    """Builds the method object for ``kind``.

    Args:
        kind: The compute method.
        outer_product: Eigen only: precompute the damped eigenvalue outer product.

    Returns:
        The method.
    """
    return METHODS[kind](outer_product)
