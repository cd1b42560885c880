"""A compact reference SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo
using Adam"), for the benchmarks only (not part of kaisa).

For a 2-D parameter with gradient ``G`` (m x n), SOAP keeps Shampoo's statistics
``L <- b L + (1 - b) G G^T`` and ``R <- b R + (1 - b) G^T G`` and runs Adam in their
eigenbasis ``Q_L, Q_R``: the gradient is rotated, ``G' = Q_L^T G Q_R``, Adam's second
moment is kept in the rotated coordinates, the first moment in the original ones
(rotated when used), and the normalised step is rotated back. The basis is refreshed
every ``precondition_frequency`` steps by one power iteration and a QR decomposition
(``Q <- qr(L Q)``, columns ordered by the estimated eigenvalues, the second moment
permuted with them), as in the authors' implementation; the first basis comes from
``eigh``. As there, the first step only initialises the statistics (no update).
Parameters that are not 2-D get plain Adam, unless ``flatten`` (per group) is set: then a
parameter of more than 2 dims (a convolution's ``(out, in, kh, kw)`` filters) is
preconditioned as the matrix ``(shape[0], -1)``, as Muon's recipe and K-FAC's convolution
blocks see it (the authors' code instead keeps one basis per dimension, optionally after
merging dimensions). Weight decay is decoupled (AdamW).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _eigenbasis(matrix: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric ``matrix``, eigenvalues descending."""
    vectors: torch.Tensor = torch.linalg.eigh(
        matrix + 1e-30 * torch.eye(len(matrix), dtype=matrix.dtype)).eigenvectors
    return vectors.flip(1)


class SOAP(torch.optim.Optimizer):
    """Adam in the eigenbasis of Shampoo's preconditioner (2-D parameters)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
        flatten: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, shampoo_beta=betas[1] if shampoo_beta is None else shampoo_beta,
            eps=eps, weight_decay=weight_decay, precondition_frequency=precondition_frequency,
            flatten=flatten,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim == 2 or (p.ndim > 2 and group["flatten"]):
                    self._soap(p, group, beta1, beta2)
                else:
                    self._adam(p, group, beta1, beta2)
        return loss

    def _adam(self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["m"] = torch.zeros_like(p)
            state["v"] = torch.zeros_like(p)
        state["step"] += 1
        t, grad = state["step"], p.grad
        state["m"].lerp_(grad, 1 - beta1)
        state["v"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["v"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - beta1**t))

    def _soap(self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        state = self.state[p]
        assert p.grad is not None
        grad = p.grad.reshape(p.shape[0], -1)
        shampoo_beta = group["shampoo_beta"]
        if not state:  # first step: statistics and basis only, no update
            state["step"] = 0
            state["m"] = torch.zeros_like(grad)
            state["v"] = torch.zeros_like(grad)
            state["L"] = grad @ grad.T * (1 - shampoo_beta)
            state["R"] = grad.T @ grad * (1 - shampoo_beta)
            state["QL"] = _eigenbasis(state["L"])
            state["QR"] = _eigenbasis(state["R"])
            return
        state["step"] += 1
        t = state["step"]
        ql, qr = state["QL"], state["QR"]
        rotated = ql.T @ grad @ qr
        state["m"].lerp_(grad, 1 - beta1)
        state["v"].mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
        m_rotated = ql.T @ state["m"] @ qr
        denom = (state["v"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
        direction = ql @ (m_rotated / denom) @ qr.T
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(direction.view_as(p), alpha=-group["lr"] / (1 - beta1**t))
        state["L"].mul_(shampoo_beta).addmm_(grad, grad.T, alpha=1 - shampoo_beta)
        state["R"].mul_(shampoo_beta).addmm_(grad.T, grad, alpha=1 - shampoo_beta)
        if t % group["precondition_frequency"] == 0:
            state["QL"], order_l = self._refresh(state["L"], ql)
            state["QR"], order_r = self._refresh(state["R"], qr)
            state["v"] = state["v"][order_l][:, order_r]

    @staticmethod
    def _refresh(stat: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One power iteration + QR; columns sorted by estimated eigenvalue (descending)."""
        estimates = torch.diag(basis.T @ stat @ basis)
        order = torch.argsort(estimates, descending=True)
        basis, _ = torch.linalg.qr(stat @ basis[:, order])
        return basis, order
