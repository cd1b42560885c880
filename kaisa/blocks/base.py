"""Curvature blocks: one interface for every layer kind, and the state of one block.

A :class:`CurvatureBlock` wraps one registered module. It says which parameters it
covers (:meth:`CurvatureBlock.parameters`; a block may cover some rows of a parameter,
:attr:`CurvatureBlock.rows`), where the recorder observes it
(:meth:`CurvatureBlock.call_sites`: its module by default), records its statistics from the hooks
(:meth:`~CurvatureBlock.compute_a_batch`, :meth:`~CurvatureBlock.compute_g_batch`; a module
called several times in one forward pass adds one batch factor per call), states its
factor shapes (:meth:`~CurvatureBlock.factor_shape`, :attr:`~CurvatureBlock.dims`,
:attr:`~CurvatureBlock.groups`: what placement and the memory model need), and turns the
parameters' gradients into the matrix the second-order method preconditions and back
(:meth:`~CurvatureBlock.gradient_matrix`, :meth:`~CurvatureBlock.split`). It holds three
separate pieces of state (:mod:`kaisa.blocks.state`): ``block.stats``
(:class:`~kaisa.blocks.state.BatchStatistics`, what the hooks record in a step),
``block.factors`` (:class:`~kaisa.blocks.state.RunningFactors`, the running averages) and
``block.decomposition`` (the second-order method's ``dict`` of tensors, see
:mod:`kaisa.methods`; the block never interprets it).

A block *kind* (:mod:`kaisa.blocks.linear`, :mod:`kaisa.blocks.conv2d`) says how the
batch factors are computed from its module's inputs and output gradients; a diagonal
kind (:mod:`kaisa.blocks.scale_shift`) also records, lays out and preconditions its own
statistics. A kind makes the blocks of one module with :meth:`CurvatureBlock.build` (one
block by default; :mod:`kaisa.blocks.attention` makes several).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kaisa.blocks.callsites import CallSite
from kaisa.blocks.state import BatchStatistics, BlockOptions, RunningFactors, tensor_bytes
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import KFACApprox, Side
from kaisa.utils.finite import all_finite
from kaisa.utils.shards import held_parts, is_sharded, rows_of

if TYPE_CHECKING:
    from kaisa.methods import SecondOrderMethod

__all__ = ["BatchStatistics", "BlockOptions", "CurvatureBlock", "KFACLayer", "RunningFactors"]

_FACTOR_KEYS = ("A", "G", "skipped_a", "skipped_g")


class CurvatureBlock:
    """The curvature block of one registered module and its K-FAC state.

    Subclasses (block kinds) implement :meth:`compute_a_batch` and
    :meth:`compute_g_batch` and may override :meth:`supports`, :meth:`build` (several
    blocks per module), :meth:`call_sites` (where the recorder observes the block) and
    :meth:`record_input` / :meth:`record_output_grad` (statistics that depend on the
    call site, or are not Kronecker factors).

    Attributes:
        name: The block's name (the module's, or the module's plus a suffix).
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
    #: The kind's name in :meth:`kaisa.core.curvature.KFACCurvature.coverage`.
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
    #: Whether a bias is part of the block (its column in the gradient matrix, the ones
    #: column of ``A``); :meth:`drop_bias_column` leaves the bias to a first-order rule.
    bias_column: bool = True
    #: What to suggest when the block's hooks never fired in a step that recorded.
    silent_hint: ClassVar[str] = (
        "is its weight used functionally, without calling the module?")
    #: The weight is stored ``(in, out)``: the gradient matrix's weight columns are its
    #: transpose (:mod:`kaisa.blocks.transposed`; the grouped step reads this).
    transposed: ClassVar[bool] = False
    #: The rows of each parameter (as :meth:`parameters` lists them) the block covers;
    #: ``None``: every row of every parameter (the common case).
    rows: tuple[slice | None, ...] | None = None

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
        self.has_bias = self.bias is not None
        self.stats = BatchStatistics()
        self.decomposition: dict[str, torch.Tensor] = {}
        self.method: SecondOrderMethod | None = None
        self.setup()
        self.factors = RunningFactors(diagonal_sides=self.diagonal_sides)

    def setup(self) -> None:
        """What a kind derives from its module at construction (default: nothing)."""

    def drop_bias_column(self) -> None:
        """Makes the block its weight alone (before any statistics): no bias column.

        :attr:`bias` is then ``None``, ``A`` has no column of ones, the gradient matrix is
        the weight's and the bias (if the module has one) is not covered by the block.
        """
        self.bias_column = False
        self.has_bias = False
        if self.rows is not None:  # the bias's entry goes with it
            rows = self.rows[:1]
            self.rows = None if rows[0] is None else rows

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """Whether ``module`` is of this kind (by default: an instance of :attr:`module_type`)."""
        return isinstance(module, cls.module_type)

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """Why ``module`` cannot be registered, or ``None`` when it can."""
        return None

    @classmethod
    def build(
        cls, name: str, module: nn.Module, options: BlockOptions
    ) -> dict[str, CurvatureBlock]:
        """The blocks of ``module`` by name: one named ``name`` (none without a weight)."""
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            return {}  # no affine parameters (a norm with elementwise_affine=False)
        return {name: cls(name=name, module=module, factor_dtype=options.factor_dtype,
                          kfac_approx=options.kfac_approx)}

    def call_sites(self) -> tuple[CallSite, ...]:
        """Where the recorder observes the block, in order: by default its module's calls.

        The recorder gives :meth:`record_input` and :meth:`record_output_grad` the index
        of the site each observation came from (see :mod:`kaisa.blocks.callsites`).
        """
        return (CallSite(self.module),)

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
        """The module's bias parameter, if any (``None`` without a bias column)."""
        if not self.bias_column:
            return None
        b = getattr(self.module, "bias", None)
        return b if isinstance(b, torch.Tensor) else None

    @property
    def dims(self) -> tuple[int, int]:
        """``(a_dim, g_dim)`` of one Kronecker block (diagonal kinds: their own layout)."""
        a_dim = math.prod(self.weight.shape[1:]) + int(self.has_bias)
        return a_dim, self._out_rows() // self.groups

    def _out_rows(self) -> int:
        """Rows of the weight the block covers (output features)."""
        out = self.weight.shape[0]
        rows = None if self.rows is None else self.rows[0]
        return out if rows is None else len(range(out)[rows])

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
        """Running A factors ``(groups, n, n)`` (``(groups, n)`` when diagonal).

        Packed factors (``factor_storage='packed'``) are unpacked: a new tensor each read.
        """
        return self.factors.dense(Side.A)

    @property
    def g(self) -> torch.Tensor | None:
        """Running G factors ``(groups, m, m)`` (``(groups, m)`` when diagonal).

        Packed factors (``factor_storage='packed'``) are unpacked: a new tensor each read.
        """
        return self.factors.dense(Side.G)

    @property
    def a_factor(self) -> torch.Tensor | None:
        """Running A factor: ``(n, n)``, or ``(groups, n, n)`` for grouped convolutions.

        A diagonal factor is its diagonal: ``(n,)``, or ``(groups, n)``.
        """
        return self._view(self.a)

    @property
    def g_factor(self) -> torch.Tensor | None:
        """Running G factor: ``(m, m)``, or ``(groups, m, m)`` for grouped convolutions.

        A diagonal factor is its diagonal: ``(m,)``, or ``(groups, m)``.
        """
        return self._view(self.g)

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

    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        """What an observation records: the batch A factor, or ``x`` for later.

        ``site`` is the index in :meth:`call_sites` of the site ``x`` was observed at.
        ``x`` is kept for later when factors are computed in ``step()`` (``in_hook``
        false), and while the core folds the block's statistics where they are computed
        (:attr:`~kaisa.blocks.state.BatchStatistics.folding`): then its A factor is
        computed with the micro-batch's fold, in the backward pass, so the batch factor
        exists only there (``x`` is the tensor autograd keeps for the weight's gradient).
        """
        if in_hook and not self.stats.folding:
            self.stats.add_a(self.compute_a_batch(x))
        else:
            self.stats.saved_inputs.append((x, site))

    def compute_saved(self) -> None:
        """Turns the kept inputs and output gradients into batch factors (clears them)."""
        stats = self.stats
        folding, stats.folding = stats.folding, False
        try:
            for x, site in stats.saved_inputs:
                self.record_input(x, in_hook=True, site=site)
            for d, divisor, site in stats.saved_grads:
                self.record_output_grad(d, divisor, in_hook=True, inputs=None, site=site)
        finally:
            stats.folding = folding
        stats.saved_inputs.clear()
        stats.saved_grads.clear()

    def record_output_grad(
        self, d: torch.Tensor, divisor: float | torch.Tensor, *, in_hook: bool,
        inputs: torch.Tensor | None, site: int = 0,
    ) -> None:
        """What the output-gradient hook records: the batch G factor, or ``d`` for later.

        ``inputs`` are the inputs of the observation whose output ``d`` belongs to (kinds
        whose statistics pair them, like scale-and-shift blocks, use them; ``None`` when
        saved gradients are turned into factors), ``site`` its call site's index.
        """
        if in_hook:
            self.stats.add_g(self.compute_g_batch(d, divisor))
        else:
            self.stats.saved_grads.append((d, divisor, site))

    def combine(
        self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The batch factors to fold from what :attr:`stats` gave, averaged over ranks.

        The identity, except for kinds that record several uses apart (a tied weight).
        """
        return a_batch, g_batch

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
        if self.rows is not None:
            grads = [g if g is None or r is None else g[r]
                     for g, r in zip(grads, self.rows, strict=True)]
        weight_grad = grads[0]
        if weight_grad is None:
            return None
        out = weight_grad.shape[0]
        g = weight_grad.reshape(out, -1)
        if self.bias is not None:
            bgrad = grads[1]
            if bgrad is None:
                bgrad = torch.zeros(out, dtype=g.dtype, device=g.device)
            g = torch.cat([g, bgrad.reshape(out, 1)], dim=1)
        return g.reshape(self.groups, out // self.groups, -1)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`gradient_matrix`: one tensor per parameter (views).

        Each has the shape of the rows of its parameter the block covers
        (:meth:`row_slices`).
        """
        shape, bias = self.weight.shape, self.bias
        if self.rows is not None:
            shape = torch.Size((self._out_rows(), *shape[1:]))
        mat = matrix.reshape(shape[0], -1)
        if bias is None:
            return [mat.reshape(shape)]
        bias_shape = bias.shape if self.rows is None else shape[:1]
        return [mat[:, :-1].reshape(shape), mat[:, -1].reshape(bias_shape)]

    def row_slices(self) -> tuple[slice | None, ...]:
        """:attr:`rows` with one entry per parameter (``None``: all its rows)."""
        return self.rows if self.rows is not None else (None,) * len(self.parameters())

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copies a ``(groups, out/groups, n)`` matrix into the parameters' ``.grad``.

        For a block whose parameters FSDP2 shards (:meth:`sharded`), ``matrix`` is the
        rows this rank holds, flat (:func:`kaisa.utils.shards.take_held`), as the core's entries
        carry them.
        """
        assert self.weight.grad is not None
        for p, part, rows in zip(self.parameters(), self.parts(matrix), self.row_slices(),
                                 strict=True):
            if p.grad is not None:
                rows_of(p.grad, p, rows).copy_(part)

    def parts(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per parameter, what :func:`kaisa.utils.shards.rows_of` this rank writes.

        :meth:`split` of a full matrix; for a sharded block, of the held rows
        (:func:`kaisa.utils.shards.take_held`): the rows of each parameter this rank's shard holds.
        """
        if self.sharded():
            return held_parts(matrix, self.parameters(), self.row_slices())
        return self.split(matrix)

    def sharded(self) -> bool:
        """Whether FSDP2 shards the block's parameters (``DTensor`` objects)."""
        return is_sharded(self.weight)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Running factors, skip counts and the decomposition state, as tensors."""
        f = self.factors
        state: dict[str, Any] = {
            "A": self.a, "G": self.g, "skipped_a": f.skipped_a, "skipped_g": f.skipped_g,
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

        packed = self.factors.packed
        self.factors = RunningFactors(None, None, get("skipped_a"), get("skipped_g"),
                                      diagonal_sides=self.diagonal_sides, packed=packed)
        a, g = get("A"), get("G")
        self.factors.a = None if a is None else self.factors.stored(Side.A, a)
        self.factors.g = None if g is None else self.factors.stored(Side.G, g)
        self.decomposition = {
            key: t.to(device).clone()
            for key, t in state.items()
            if key not in _FACTOR_KEYS and isinstance(t, torch.Tensor)
        }

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer: ``factors``, ``decompositions`` and ``buffers``."""
        return {
            "factors": tensor_bytes(self.factors.a, self.factors.g),
            "decompositions": tensor_bytes(*self.decomposition.values()),
            "buffers": self.stats.nbytes(),
        }

    def __repr__(self) -> str:
        kind = type(self.module).__name__
        return f"{type(self).__name__}({self.name!r}, {kind}, groups={self.groups})"


#: kfac-pytorch's name of the per-layer object (public API).
KFACLayer = CurvatureBlock


#: Decomposition entries readable as layer attributes (every method's state keys).
_DECOMPOSITION_NAMES = frozenset({"qa", "da", "qg", "dg", "dgda", "a_inv", "g_inv"})
