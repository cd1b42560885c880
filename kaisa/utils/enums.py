"""Enumerations accepted by kaisa's constructors (and the factor side of a block).

Every enum argument also accepts its name or value as a string, case-insensitively
(``'eigen'``, ``'COMM_OPT'``, ``'comm-opt'``).
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import TypeVar

__all__ = [
    "AssignmentStrategy",
    "BasisRefresh",
    "ComputeMethod",
    "DistributedStrategy",
    "FactorStorage",
    "KFACApprox",
    "LossKind",
    "Reduction",
    "Side",
    "parse_enum",
    "parse_grad_worker_fraction",
]


class BasisRefresh(enum.Enum):
    """How a decomposition step computes eigenbases (``docs/conventions.md``, "EKFAC").

    ``EIGH``: a full eigendecomposition every time. ``QR``: one subspace-iteration step
    warm-started from the previous basis (SOAP's refresh), with a full one on a block's
    first decomposition, every ``eigh_every``-th decomposition step and when the warm
    start fails. ``AUTO``: ``QR`` where the model is on a CUDA device, ``EIGH`` elsewhere.
    """

    EIGH = "eigh"
    QR = "qr"
    AUTO = "auto"


class ComputeMethod(enum.Enum):
    """How the second-order information of a layer is computed."""

    EIGEN = "eigen"
    INVERSE = "inverse"
    #: Beyond the reference: damped inverses with factored Tikhonov damping, ``pi``-adjusted
    #: (Martens & Grosse 2015, section 6.3; kfac-jax's default for dense layers).
    PI_INVERSE = "pi_inverse"


class KFACApprox(enum.Enum):
    """How a Linear block on sequences builds its factors (Eschenhagen et al., 2023).

    ``EXPAND``: every position is a row (``M = N * R``); ``REDUCE``: one row per example,
    the inputs averaged and the output gradients summed over the shared dimensions.
    """

    EXPAND = "expand"
    REDUCE = "reduce"


class FactorStorage(enum.Enum):
    """How running factors are kept.

    ``DENSE``: ``(groups, n, n)``; ``PACKED``: the upper triangles ``(groups, n(n+1)/2)``,
    about half the bytes, unpacked for the decomposition and for readers of the factors
    (``docs/conventions.md``, "Packed factors").
    """

    DENSE = "dense"
    PACKED = "packed"


class DistributedStrategy(enum.Enum):
    """KAISA's grad-worker-fraction presets.

    ``COMM_OPT`` makes every rank a gradient worker (fraction 1), ``MEM_OPT`` makes one
    rank per layer a gradient worker (fraction 1/world) and ``HYBRID_OPT`` sits between
    them (fraction 1/2).
    """

    COMM_OPT = "comm_opt"
    MEM_OPT = "mem_opt"
    HYBRID_OPT = "hybrid_opt"


class AssignmentStrategy(enum.Enum):
    """Cost model used to place decompositions on ranks."""

    COMPUTE = "compute"
    MEMORY = "memory"


class LossKind(enum.Enum):
    """The declared loss."""

    MSE = "mse"
    CROSS_ENTROPY = "cross_entropy"


class Reduction(enum.Enum):
    """How the loss is reduced over examples (``torch.nn.functional``'s names)."""

    MEAN = "mean"
    SUM = "sum"


class Side(enum.Enum):
    """Which Kronecker factor of a block: ``A`` (inputs) or ``G`` (output gradients)."""

    A = "A"
    G = "G"


E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: E | str, argument: str) -> E:
    """Convert ``value`` to a member of ``cls``.

    Args:
        cls: the enum class.
        value: a member of ``cls`` or a string naming one (by name or value, any case,
            ``-`` and ``_`` interchangeable).
        argument: the argument name used in the error message.

    Returns:
        The enum member.

    Raises:
        ValueError: if ``value`` names no member.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        for member in cls:
            if key in (member.name.lower(), str(member.value).lower()):
                return member
    choices = ", ".join(repr(str(m.value)) for m in cls)
    raise ValueError(f"{argument}={value!r} is not valid; expected one of {choices}")


def parse_grad_worker_fraction(value: object) -> DistributedStrategy | float | str:
    """The one parser of ``grad_worker_fraction`` (constructors, the app, the engine).

    Args:
        value: A :class:`DistributedStrategy`, its name or value (any case), ``'auto'``
            or a number in ``(0, 1]``.

    Returns:
        The strategy, the float, or ``'auto'``.

    Raises:
        ValueError: For anything else (naming the argument).
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(
            f"grad_worker_fraction must be a DistributedStrategy or float, got {value!r}"
        )
    if isinstance(value, numbers.Real):
        if not (math.isfinite(float(value)) and 0.0 < float(value) <= 1.0):
            raise ValueError(f"grad_worker_fraction must be in (0, 1], got {value!r}")
        return float(value)
    if isinstance(value, (str, DistributedStrategy)):
        return parse_enum(DistributedStrategy, value, "grad_worker_fraction")
    raise ValueError(
        f"grad_worker_fraction must be a DistributedStrategy, float or 'auto', got "
        f"{type(value).__name__}"
    )
