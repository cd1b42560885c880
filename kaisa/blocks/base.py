"""Curvature blocks: one interface for every layer kind, and the state of one block.

A :class:`CurvatureBlock` wraps one registered module. It says which parameters it
covers (:meth:`CurvatureBlock.parameters`), records its statistics from the hooks
(:meth:`~CurvatureBlock.compute_a_batch`, :meth:`~CurvatureBlock.compute_g_batch`; a module
called several times in one forward pass adds one batch factor per call), states its
factor shapes (:meth:`~CurvatureBlock.factor_shape`, :attr:`~CurvatureBlock.dims`,
:attr:`~CurvatureBlock.groups`: what placement and the memory model need), and turns the
parameters' gradients into the matrix the second-order method preconditions and back
(:meth:`~CurvatureBlock.gradient_matrix`, :meth:`~CurvatureBlock.split`). It holds three
separate pieces of state:

* :class:`BatchStatistics` (``layer.stats``): what the hooks record during a step — the
  per-micro-batch factor sums, or the raw inputs / output gradients when factors are
  computed in ``step()``;
* :class:`RunningFactors` (``layer.factors``): the running averages ``A`` and ``G``
  (``(groups, n, n)``, starting from the identity; a *diagonal side*
  (:attr:`CurvatureBlock.diagonal_sides`) is kept as its diagonal ``(groups, n)``,
  starting from ones) and the count of non-finite batch factors that were skipped;
* ``layer.decomposition``: the second-order method's state (a ``dict`` of tensors, see
  :mod:`kaisa.methods`); the layer never interprets it.

A block *kind* (:mod:`kaisa.blocks.linear`, :mod:`kaisa.blocks.conv2d`) says how the
batch factors are computed from its module's inputs and output gradients; a diagonal
kind (:mod:`kaisa.blocks.scale_shift`) also records, lays out and preconditions its own
statistics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kaisa.dtypes import working_dtype
from kaisa.enums import KFACApprox, Side
from kaisa.finite import all_finite

if TYPE_CHECKING:
    from kaisa.methods import SecondOrderMethod

__all__ = ["BatchStatistics", "CurvatureBlock", "KFACLayer", "RunningFactors"]

_FACTOR_KEYS = ("A", "G", "skipped_a", "skipped_g")


@dataclass
class BatchStatistics:
    """What the hooks recorded in the current step (cleared when taken)."""

    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    a_count: int = 0
    g_count: int = 0
    saved_inputs: list[torch.Tensor] = field(default_factory=list)
    #: Output gradients with the divisor each is unscaled by.
    saved_grads: list[tuple[torch.Tensor, float | torch.Tensor]] = field(default_factory=list)

    def add_a(self, a_batch: torch.Tensor) -> None:
        """Adds one micro-batch A factor."""
        self.a_sum = a_batch if self.a_sum is None else self.a_sum.add_(a_batch)
        self.a_count += 1

    def add_g(self, g_batch: torch.Tensor) -> None:
        """Adds one micro-batch G factor."""
        self.g_sum = g_batch if self.g_sum is None else self.g_sum.add_(g_batch)
        self.g_count += 1

    @property
    def has_factors(self) -> bool:
        """Whether any batch factor was recorded."""
        return self.a_sum is not None or self.g_sum is not None

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Mean batch factors over the recorded micro-batches; clears them."""
        a = None if self.a_sum is None else self.a_sum / self.a_count
        g = None if self.g_sum is None else self.g_sum / self.g_count
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        return a, g

    def nbytes(self) -> int:
        """Bytes held."""
        return _size(self.a_sum, self.g_sum, *self.saved_inputs,
                     *(d for d, _ in self.saved_grads))

    def clear(self) -> None:
        """Forgets everything recorded."""
        self.take()
        self.saved_inputs.clear()
        self.saved_grads.clear()


@dataclass
class RunningFactors:
    """Running factors ``F <- rho F + (1 - rho) F_batch`` and the skipped-batch counts."""

    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    skipped_a: torch.Tensor | None = None  # 0-d counts: no host synchronisation
    skipped_g: torch.Tensor | None = None
    #: Sides kept as diagonals (start from ones, not the identity).
    diagonal_sides: frozenset[Side] = frozenset()

    def fold(self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None, rho: float,
             *, zero_start: bool = False) -> None:
        """Folds batch factors in; a non-finite batch is skipped (and counted).

        A factor that does not exist yet starts from the identity (ones when diagonal),
        or from zero with ``zero_start``.
        """
        diagonal = self.diagonal_sides
        if a_batch is not None:
            self.a, self.skipped_a = _fold(self.a, a_batch, rho, self.skipped_a,
                                           Side.A in diagonal, zero_start)
        if g_batch is not None:
            self.g, self.skipped_g = _fold(self.g, g_batch, rho, self.skipped_g,
                                           Side.G in diagonal, zero_start)

    @property
    def skipped(self) -> int:
        """Non-finite batch factors not folded in (synchronises the device)."""
        return sum(int(t.item()) for t in (self.skipped_a, self.skipped_g) if t is not None)


class CurvatureBlock:
    """The curvature block of one registered module and its K-FAC state.

    Subclasses (block kinds) implement :meth:`compute_a_batch` and
    :meth:`compute_g_batch` and may override :meth:`supports`.

    Attributes:
        name: The module's name in the model.
        module: The wrapped module.
        groups: Number of independent Kronecker blocks.
        has_bias: Whether the gradient matrix has a bias column.
        factor_dtype: Dtype of the factors, ``None`` to follow the activations (>= fp32).
        kfac_approx: Expand or reduce over shared dimensions (kinds that have them).
        stats: The statistics recorded in the current step.
        factors: The running factors.
        decomposition: The second-order method's state (see :mod:`kaisa.methods`).
        method: The second-order method that owns ``decomposition`` (set by the
            curvature core).
    """

    #: The module type this kind handles (set by each block kind).
    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Module
    #: The kind's name in :meth:`kaisa.curvature.KFACCurvature.coverage`.
    kind: ClassVar[str] = "block"
    #: Diagonal curvature (no Kronecker factors, no decomposition): preconditioned on
    #: every rank by :meth:`precondition_diagonal`.
    diagonal: ClassVar[bool] = False
    #: The sides of the Kronecker block whose factor is diagonal: such a factor is
    #: recorded, averaged over ranks, running-averaged (from ones), decomposed, sent and
    #: checkpointed as its diagonal ``(groups, n)``, never as an ``n x n`` matrix, and the
    #: second-order method applies it without eigenvectors (``docs/conventions.md``). A
    #: kind declares it (an instance may set its own in :meth:`setup`, e.g. dense or
    #: diagonal by size). Read it through :meth:`is_diagonal`.
    diagonal_sides: frozenset[Side] = frozenset()
    #: Whether the kind registers a module whose weight another module also uses (tied):
    #: ``False`` leaves such a weight to the other module's block (see
    #: :func:`kaisa.blocks.register_blocks`).
    covers_tied: ClassVar[bool] = True

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        factor_dtype: torch.dtype | None,
        kfac_approx: KFACApprox = KFACApprox.EXPAND,
    ) -> None:
        self.name = name
        self.module = module
        self.factor_dtype = factor_dtype
        self.kfac_approx = kfac_approx
        self.groups = 1
        self.has_bias = getattr(module, "bias", None) is not None
        self.stats = BatchStatistics()
        self.decomposition: dict[str, torch.Tensor] = {}
        self.method: SecondOrderMethod | None = None
        self.setup()
        self.factors = RunningFactors(diagonal_sides=self.diagonal_sides)

    def setup(self) -> None:
        """What a kind derives from its module at construction (default: nothing)."""

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """Why ``module`` cannot be registered, or ``None`` when it can."""
        return None

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The parameters the block covers: the weight, then the bias if any."""
        bias = self.bias
        return (self.weight,) if bias is None else (self.weight, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The module's weight parameter."""
        w = self.module.weight
        assert isinstance(w, torch.Tensor)
        return w

    @property
    def bias(self) -> torch.Tensor | None:
        """The module's bias parameter, if any."""
        b = getattr(self.module, "bias", None)
        return b if isinstance(b, torch.Tensor) else None

    @property
    def dims(self) -> tuple[int, int]:
        """``(a_dim, g_dim)`` of one Kronecker block (diagonal kinds: their own layout)."""
        weight = self.weight
        return weight[0].numel() + int(self.has_bias), weight.shape[0] // self.groups

    def is_diagonal(self, side: Side) -> bool:
        """Whether the ``side`` factor is kept as its diagonal."""
        return side in self.diagonal_sides

    def factor_shape(self, side: Side) -> tuple[int, ...]:
        """``(groups, n, n)`` of the ``side`` factor, ``(groups, n)`` for a diagonal one."""
        n = self.dims[0 if side is Side.A else 1]
        return (self.groups, n) if self.is_diagonal(side) else (self.groups, n, n)

    # ------------------------------------------------------------------ public views
    @property
    def a(self) -> torch.Tensor | None:
        """Running A factors ``(groups, n, n)`` (``(groups, n)`` when diagonal)."""
        return self.factors.a

    @property
    def g(self) -> torch.Tensor | None:
        """Running G factors ``(groups, m, m)`` (``(groups, m)`` when diagonal)."""
        return self.factors.g

    @property
    def a_factor(self) -> torch.Tensor | None:
        """Running A factor: ``(n, n)``, or ``(groups, n, n)`` for grouped convolutions.

        A diagonal factor is its diagonal: ``(n,)``, or ``(groups, n)``.
        """
        return self._view(self.factors.a)

    @property
    def g_factor(self) -> torch.Tensor | None:
        """Running G factor: ``(m, m)``, or ``(groups, m, m)`` for grouped convolutions.

        A diagonal factor is its diagonal: ``(m,)``, or ``(groups, m)``.
        """
        return self._view(self.factors.g)

    def _view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.groups > 1:
            return t
        return t[0]

    def has_decomposition(self) -> bool:
        """Whether the layer holds what its method needs to precondition."""
        return self.method is not None and self.method.ready(
            self.decomposition, diagonal=self.diagonal_sides)

    def __getattr__(self, key: str) -> Any:
        # Decomposition entries read as attributes (``layer.qa``, ``layer.a_inv``, ...);
        # ``None`` when the method stores no such entry.
        if key in _DECOMPOSITION_NAMES:
            return self.__dict__["decomposition"].get(key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    # ------------------------------------------------------------------ statistics
    def dtype_for(self, t: torch.Tensor) -> torch.dtype:
        """Factor dtype for activations ``t``: ``factor_dtype`` or ``t``'s, at least fp32."""
        if self.factor_dtype is not None:
            return self.factor_dtype
        return working_dtype(t.dtype)

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The per-batch A factor of input ``x`` (``(groups, n, n)``)."""
        raise NotImplementedError

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """The per-batch G factor of output gradient ``grad_output``."""
        raise NotImplementedError

    def record_input(self, x: torch.Tensor, *, in_hook: bool) -> None:
        """What the forward hook records: the batch A factor, or ``x`` for later."""
        if in_hook:
            self.stats.add_a(self.compute_a_batch(x))
        else:
            self.stats.saved_inputs.append(x)

    def record_output_grad(
        self, d: torch.Tensor, divisor: float | torch.Tensor, *, in_hook: bool,
        inputs: torch.Tensor,
    ) -> None:
        """What the output-gradient hook records: the batch G factor, or ``d`` for later.

        ``inputs`` are the inputs of the forward call whose output ``d`` belongs to
        (kinds whose statistics pair them, like scale-and-shift blocks, use them).
        """
        if in_hook:
            self.stats.add_g(self.compute_g_batch(d, divisor))
        else:
            self.stats.saved_grads.append((d, divisor))

    def precondition_diagonal(self, grad: torch.Tensor, damping: float) -> torch.Tensor | None:
        """``grad / (F + damping)`` for a diagonal block (``None`` before statistics)."""
        raise NotImplementedError(f"{type(self).__name__} has Kronecker factors")

    # ------------------------------------------------------------------ gradients
    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """``[dW | db]`` as ``(groups, out/groups, n)``, the form the method preconditions.

        Args:
            grads: One gradient per :meth:`parameters` entry (``None``: zero bias
                gradient); by default the parameters' ``.grad``.

        Returns:
            The matrix, or ``None`` when the weight has no gradient.
        """
        if grads is None:
            grads = [p.grad for p in self.parameters()]
        weight_grad = grads[0]
        if weight_grad is None:
            return None
        out = self.weight.shape[0]
        g = weight_grad.reshape(out, -1)
        if self.bias is not None:
            bgrad = grads[1]
            if bgrad is None:
                bgrad = torch.zeros(out, dtype=g.dtype, device=g.device)
            g = torch.cat([g, bgrad.reshape(out, 1)], dim=1)
        return g.reshape(self.groups, out // self.groups, -1)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`gradient_matrix`: one tensor per parameter (views)."""
        weight = self.weight
        mat = matrix.reshape(weight.shape[0], -1)
        bias = self.bias
        if bias is None:
            return [mat.reshape(weight.shape)]
        return [mat[:, :-1].reshape(weight.shape), mat[:, -1].reshape(bias.shape)]

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copies a ``(groups, out/groups, n)`` matrix into the parameters' ``.grad``."""
        assert self.weight.grad is not None
        for p, part in zip(self.parameters(), self.split(matrix), strict=True):
            if p.grad is not None:
                p.grad.copy_(part)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Running factors, skip counts and the decomposition state, as tensors."""
        f = self.factors
        state: dict[str, Any] = {
            "A": f.a, "G": f.g, "skipped_a": f.skipped_a, "skipped_g": f.skipped_g,
        }
        state.update(self.decomposition)
        return state

    def check_state_dict(self, state: object) -> None:
        """Raises ``ValueError`` unless ``state`` is a :meth:`state_dict` of this block.

        Every tensor must have this block's shape and be finite (a NaN running factor
        would never be replaced); the decomposition entries must be the method's.
        """
        where = f"state_dict layer {self.name!r}"
        if not isinstance(state, Mapping):
            raise ValueError(f"{where} is a {type(state).__name__}, not a dict of tensors")
        a_dim, g_dim = self.dims
        shapes: dict[str, tuple[int, ...]] = {
            "A": self.factor_shape(Side.A), "G": self.factor_shape(Side.G)}
        if self.method is not None:
            shapes.update(self.method.state_shapes(self.groups, a_dim, g_dim,
                                                   diagonal=self.diagonal_sides))
        unknown = sorted(str(k) for k in state if k not in shapes and k not in _FACTOR_KEYS)
        if unknown:
            raise ValueError(f"{where} has unexpected entries {unknown} (expected some of "
                             f"{sorted(shapes)}; saved with another compute_method?)")
        for key in ("skipped_a", "skipped_g"):
            count = state.get(key)
            if count is not None and not (
                isinstance(count, torch.Tensor) and count.numel() == 1
                and not count.is_floating_point() and int(count) >= 0
            ):
                raise ValueError(f"{where}: {key} must be a count >= 0, got {count!r}")
        for key, shape in shapes.items():
            t = state.get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"{where}: {key} must be a floating-point tensor, got "
                                 f"{type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: {key} has shape {tuple(t.shape)}, this layer's is "
                                 f"{shape} (a checkpoint of another model?)")
            if not bool(all_finite(t)):
                raise ValueError(f"{where}: {key} is not finite")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, moving tensors to the module's device.

        Check it with :meth:`check_state_dict` first.
        """
        device = self.weight.device

        def get(key: str) -> torch.Tensor | None:
            t = state.get(key)
            return None if t is None else t.to(device).clone()

        self.factors = RunningFactors(get("A"), get("G"), get("skipped_a"), get("skipped_g"),
                                      diagonal_sides=self.diagonal_sides)
        self.decomposition = {
            key: t.to(device).clone()
            for key, t in state.items()
            if key not in _FACTOR_KEYS and isinstance(t, torch.Tensor)
        }

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer: ``factors``, ``decompositions`` and ``buffers``."""
        return {
            "factors": _size(self.factors.a, self.factors.g),
            "decompositions": _size(*self.decomposition.values()),
            "buffers": self.stats.nbytes(),
        }

    def __repr__(self) -> str:
        kind = type(self.module).__name__
        return f"{type(self).__name__}({self.name!r}, {kind}, groups={self.groups})"


#: kfac-pytorch's name of the per-layer object (public API).
KFACLayer = CurvatureBlock


#: Decomposition entries readable as layer attributes (every method's state keys).
_DECOMPOSITION_NAMES = frozenset({"qa", "da", "qg", "dg", "dgda", "a_inv", "g_inv"})


def _size(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _fold(
    running: torch.Tensor | None,
    batch: torch.Tensor,
    rho: float,
    skipped: torch.Tensor | None,
    diagonal: bool = False,
    zero_start: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if running is None and zero_start:
        running = torch.zeros_like(batch)
    elif running is None and diagonal:
        running = torch.ones_like(batch)
    elif running is None:
        eye = torch.eye(batch.shape[-1], dtype=batch.dtype, device=batch.device)
        running = eye.expand_as(batch).clone()
    if skipped is None:
        skipped = torch.zeros((), dtype=torch.int64, device=batch.device)
    finite = all_finite(batch)
    updated = running * rho + batch * (1.0 - rho)
    running = torch.where(finite, updated, running)
    skipped = skipped + (~finite).to(skipped.dtype)
    return running, skipped
