"""Per-layer K-FAC state: recorded statistics, running factors, decompositions.

A :class:`KFACLayer` wraps one registered ``nn.Linear`` or ``nn.Conv2d``. All factors are
stored batched as ``(groups, n, n)`` (one group unless the convolution is grouped); the
public :attr:`KFACLayer.a_factor` / :attr:`KFACLayer.g_factor` drop the group dimension
when there is a single group. The preconditioner orchestrates when these methods run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kaisa import factors, ops
from kaisa.linalg import EigenResult

__all__ = ["Conv2dLayer", "KFACLayer", "LinearLayer"]

_DECOMPOSITION_KEYS = ("qa", "da", "qg", "dg", "dgda", "a_inv", "g_inv")


class KFACLayer:
    """K-FAC state of one module.

    Attributes:
        name: the module's name in the model.
        module: the wrapped module.
        groups: number of independent Kronecker blocks.
        has_bias: whether the gradient matrix has a bias column.
        factor_dtype: dtype of the factors, ``None`` to follow the activations (>= fp32).
    """

    def __init__(self, *, name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> None:
        self.name = name
        self.module = module
        self.factor_dtype = factor_dtype
        self.groups = 1
        self.has_bias = getattr(module, "bias", None) is not None
        # running factors (groups, n, n)
        self.a: torch.Tensor | None = None
        self.g: torch.Tensor | None = None
        # per-batch accumulation (sum over micro-batches and its count)
        self.a_sum: torch.Tensor | None = None
        self.g_sum: torch.Tensor | None = None
        self.a_count = 0
        self.g_count = 0
        # raw statistics kept when factors are not computed in the hooks
        self.saved_inputs: list[torch.Tensor] = []
        self.saved_grads: list[torch.Tensor] = []
        # decompositions
        self.qa: torch.Tensor | None = None
        self.da: torch.Tensor | None = None
        self.qg: torch.Tensor | None = None
        self.dg: torch.Tensor | None = None
        self.dgda: torch.Tensor | None = None
        self.a_inv: torch.Tensor | None = None
        self.g_inv: torch.Tensor | None = None
        # non-finite per-batch factors not folded in (0-d tensors, no host sync)
        self.skipped_a: torch.Tensor | None = None
        self.skipped_g: torch.Tensor | None = None
        self.hooks_fired = False

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

    # ------------------------------------------------------------------ public views
    @property
    def a_factor(self) -> torch.Tensor | None:
        """Running A factor: ``(n, n)``, or ``(groups, n, n)`` for grouped convolutions."""
        return self._view(self.a)

    @property
    def g_factor(self) -> torch.Tensor | None:
        """Running G factor: ``(m, m)``, or ``(groups, m, m)`` for grouped convolutions."""
        return self._view(self.g)

    def _view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.groups > 1:
            return t
        return t[0]

    @property
    def skipped_updates(self) -> int:
        """How many non-finite per-batch factors were not folded in (syncs the device)."""
        return sum(int(t.item()) for t in (self.skipped_a, self.skipped_g) if t is not None)

    def has_decomposition(self) -> bool:
        """Whether the layer can be preconditioned (eigen or inverse results present)."""
        return (self.qa is not None and self.qg is not None) or (
            self.a_inv is not None and self.g_inv is not None
        )

    # ------------------------------------------------------------------ statistics
    def dtype_for(self, t: torch.Tensor) -> torch.dtype:
        """Factor dtype for activations ``t``: ``factor_dtype`` or ``t``'s, at least fp32."""
        if self.factor_dtype is not None:
            return self.factor_dtype
        return torch.promote_types(t.dtype, torch.float32)

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The per-batch A factor of input ``x`` (``(groups, n, n)``)."""
        raise NotImplementedError

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """The per-batch G factor of output gradient ``grad_output``."""
        raise NotImplementedError

    def accumulate_a(self, a_batch: torch.Tensor) -> None:
        """Add one micro-batch A factor."""
        self.a_sum = a_batch if self.a_sum is None else self.a_sum.add_(a_batch)
        self.a_count += 1

    def accumulate_g(self, g_batch: torch.Tensor) -> None:
        """Add one micro-batch G factor."""
        self.g_sum = g_batch if self.g_sum is None else self.g_sum.add_(g_batch)
        self.g_count += 1

    def take_batch_factors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Mean per-batch factors over the recorded micro-batches; clears the accumulators."""
        a = None if self.a_sum is None else self.a_sum / self.a_count
        g = None if self.g_sum is None else self.g_sum / self.g_count
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        return a, g

    def fold(self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None, rho: float) -> None:
        """Running average ``F <- rho*F + (1-rho)*F_batch``; a non-finite batch is skipped.

        No host synchronisation: the skip is a ``torch.where`` and the count a tensor.
        """
        if a_batch is not None:
            self.a, self.skipped_a = _fold(self.a, a_batch, rho, self.skipped_a)
        if g_batch is not None:
            self.g, self.skipped_g = _fold(self.g, g_batch, rho, self.skipped_g)

    # ------------------------------------------------------------------ gradients
    def grad_matrix(self) -> torch.Tensor | None:
        """``[W.grad | b.grad]`` as ``(groups, out/groups, n)``; ``None`` without a gradient."""
        weight = self.weight
        if weight.grad is None:
            return None
        out = weight.shape[0]
        g = weight.grad.reshape(out, -1)
        if self.bias is not None:
            bgrad = self.bias.grad
            if bgrad is None:
                bgrad = torch.zeros(out, dtype=g.dtype, device=g.device)
            g = torch.cat([g, bgrad.reshape(out, 1)], dim=1)
        return g.reshape(self.groups, out // self.groups, -1)

    def write_grad(self, precond: torch.Tensor) -> None:
        """Copy a preconditioned ``(groups, out/groups, n)`` matrix into the ``.grad``s."""
        weight = self.weight
        assert weight.grad is not None
        out = weight.shape[0]
        mat = precond.reshape(out, -1)
        bias = self.bias
        if bias is not None:
            if bias.grad is not None:
                bias.grad.copy_(mat[:, -1].reshape(bias.grad.shape))
            mat = mat[:, :-1]
        weight.grad.copy_(mat.reshape(weight.grad.shape))

    # ------------------------------------------------------------------ decompositions
    def set_eigen(
        self,
        a: EigenResult | None,
        g: EigenResult | None,
        *,
        damping: float | None,
    ) -> None:
        """Store new eigendecompositions (a failed one, ``None``, keeps the previous).

        Args:
            a: decomposition of the A factors.
            g: decomposition of the G factors.
            damping: when given, also store ``1/(dG dA^T + damping)``.
        """
        if a is not None:
            self.qa, self.da = a.eigenvectors, a.eigenvalues
        if g is not None:
            self.qg, self.dg = g.eigenvectors, g.eigenvalues
        changed = a is not None or g is not None or self.dgda is None
        if damping is not None and changed and self.da is not None and self.dg is not None:
            outer = self.dg.unsqueeze(-1) * self.da.unsqueeze(-2)
            self.dgda = 1.0 / (outer + damping)

    def set_inverses(self, a_inv: torch.Tensor | None, g_inv: torch.Tensor | None) -> None:
        """Store new damped inverses (``None`` keeps the previous)."""
        if a_inv is not None:
            self.a_inv = a_inv
        if g_inv is not None:
            self.g_inv = g_inv

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor | None:
        """Preconditioned gradient, or ``None`` when no decomposition exists yet.

        Args:
            grad: the gradient matrix ``(groups, m, n)``.
            damping: the current damping (used by the eigen method without the outer
                product).
        """
        if self.qa is not None and self.qg is not None:
            dtype = self.qa.dtype
            if self.dgda is not None:
                out = ops.eigen_precondition(grad.to(dtype), self.qa, self.qg, dgda=self.dgda)
            else:
                out = ops.eigen_precondition(
                    grad.to(dtype), self.qa, self.qg, da=self.da, dg=self.dg, damping=damping
                )
            return out.to(grad.dtype)
        if self.a_inv is not None and self.g_inv is not None:
            dtype = self.a_inv.dtype
            return (self.g_inv @ grad.to(dtype) @ self.a_inv).to(grad.dtype)
        return None

    def clear_decompositions(self) -> None:
        """Drop every decomposition (e.g. when a rank stops owning the layer)."""
        for key in _DECOMPOSITION_KEYS:
            setattr(self, key, None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_decompositions: bool = True) -> dict[str, Any]:
        """Factors (and decompositions) of this layer, as tensors."""
        state: dict[str, Any] = {"A": self.a, "G": self.g}
        if include_decompositions:
            for key in _DECOMPOSITION_KEYS:
                state[key] = getattr(self, key)
        state["skipped_a"] = self.skipped_a
        state["skipped_g"] = self.skipped_g
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, moving tensors to the module's device."""
        device = self.weight.device

        def get(key: str) -> torch.Tensor | None:
            t = state.get(key)
            return None if t is None else t.to(device).clone()

        self.a, self.g = get("A"), get("G")
        for key in _DECOMPOSITION_KEYS:
            setattr(self, key, get(key))
        self.skipped_a, self.skipped_g = get("skipped_a"), get("skipped_g")

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer: ``factors``, ``decompositions`` and ``buffers``."""
        def size(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        return {
            "factors": size(self.a, self.g),
            "decompositions": size(*(getattr(self, k) for k in _DECOMPOSITION_KEYS)),
            "buffers": size(self.a_sum, self.g_sum, *self.saved_inputs, *self.saved_grads),
        }

    def __repr__(self) -> str:
        kind = type(self.module).__name__
        return f"{type(self).__name__}({self.name!r}, {kind}, groups={self.groups})"


class LinearLayer(KFACLayer):
    """An ``nn.Linear`` (any number of leading input dimensions)."""

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``Xb^T Xb / M``."""
        return factors.linear_a_factor(x, bias=self.has_bias, dtype=self.dtype_for(x))

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``D^T D / M``."""
        return factors.linear_g_factor(
            grad_output, dtype=self.dtype_for(grad_output), loss_scale=loss_scale
        )


class Conv2dLayer(KFACLayer):
    """An ``nn.Conv2d`` with zeros padding; groups become independent blocks."""

    def __init__(self, *, name: str, module: nn.Conv2d, factor_dtype: torch.dtype | None) -> None:
        super().__init__(name=name, module=module, factor_dtype=factor_dtype)
        self.geometry = factors.ConvGeometry.of(module)
        self.groups = self.geometry.groups

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``(Pb/S)^T (Pb/S) / (N*S)`` per group."""
        return factors.conv_a_factor(
            x, self.geometry, bias=self.has_bias, dtype=self.dtype_for(x)
        )

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``(D/S)^T (D/S) / (N*S)`` per group."""
        return factors.conv_g_factor(
            grad_output, groups=self.groups, dtype=self.dtype_for(grad_output),
            loss_scale=loss_scale,
        )


def _fold(
    running: torch.Tensor | None,
    batch: torch.Tensor,
    rho: float,
    skipped: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if running is None:
        eye = torch.eye(batch.shape[-1], dtype=batch.dtype, device=batch.device)
        running = eye.expand_as(batch).clone()
    if skipped is None:
        skipped = torch.zeros((), dtype=torch.int64, device=batch.device)
    finite = torch.isfinite(batch.sum())  # one reduction: any NaN/Inf makes it non-finite
    updated = running * rho + batch * (1.0 - rho)
    running = torch.where(finite, updated, running)
    skipped = skipped + (~finite).to(skipped.dtype)
    return running, skipped
