"""A compact reference KL-Shampoo (Lin, Lowe, Dangel, Eschenhagen, Xu and Grosse,
"Understanding and Improving Shampoo and SOAP via Kullback-Leibler Minimization",
ICLR 2026, arXiv:2509.03378), for the benchmarks only (not part of kaisa).

Shampoo's Kronecker factors of a matrix parameter with gradient ``G`` (``m x n``) seen as
the covariance ``S_a (x) S_b`` of a matrix Gaussian fitted to ``E[g g^T]`` by minimising
``KL(E[g g^T], S_a (x) S_b)``: the two factors are coupled, each estimated from the gradient
whitened by the other one,

    S_a <- beta2 S_a + (1 - beta2) / n * G S_b^{-1} G^T
    S_b <- beta2 S_b + (1 - beta2) / m * G^T S_a^{-1} G

(Shampoo's ``G G^T`` and ``G^T G`` are the one-sided solutions with the other factor held at
the identity), and the step is Shampoo's with the power ``-1/2`` on each side and no
grafting to Adam:

    M <- beta1 M + (1 - beta1) G,    W <- W (1 - lr wd) - lr S_a^{-1/2} Mhat S_b^{-1/2},

``Mhat = M / (1 - beta1^t)``. As in the paper's practical scheme, the inverses and roots
come from eigenbases ``S = Q diag(d) Q^T`` refreshed every ``precondition_frequency`` steps
(here by ``eigh``), and between refreshes the eigenvalues are re-estimated every step in
the fixed bases from the same KL update:

    Gt = Q_a^T G Q_b,
    d_a <- beta2 d_a + (1 - beta2) / n * (Gt^2) (1 / (d_b + eps)),
    d_b <- beta2 d_b + (1 - beta2) / m * (Gt^2)^T (1 / (d_a + eps)),

with ``S^{-1}`` in the factor updates taken as ``Q diag(1 / (d + eps)) Q^T`` (the old
``d_a``, ``d_b`` in both), and the step ``Q_a ((Q_a^T Mhat Q_b) / sqrt((d_a + eps)
(d_b + eps)^T)) Q_b^T``. The factors are updated before the step (the step uses the
current gradient, as Adam's second moment does). Before the first update the factors are
isotropic at the first gradient's scale, ``S_a = sigma I``, ``S_b = sigma I``, ``sigma =
||G||_F / sqrt(m n)`` (the KL fit to an i.i.d. gradient of variance ``sigma^2``), with
identity bases: the one-sided fits ``G G^T``, ``G^T G`` of a single gradient are nearly
singular, and ``S_a^{-1/2} G S_b^{-1/2}`` of them is ``U diag(1/s) V^T`` (``G = U diag(s)
V^T``), which explodes on the small singular values (measured: an update RMS of 130 on the
first step of a small GPT). Parameters that
are not 2-D get plain Adam (``betas``, ``eps``) unless ``flatten`` is set: then a
parameter of more than 2 dims is preconditioned as the matrix ``(shape[0], -1)``. Weight
decay is decoupled (AdamW's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric ``matrix``."""
    values, vectors = torch.linalg.eigh(0.5 * (matrix + matrix.T))
    return values.clamp_min(0.0), vectors


class KLShampoo(torch.optim.Optimizer):
    """Shampoo with factors fitted by KL minimisation, no Adam grafting (module docstring).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        betas: ``(beta1, beta2)``: the momentum's and the factors' running-average decay
            (also Adam's betas on the parameters that are not matrices).
        eps: Added to every eigenvalue (and Adam's denominator).
        weight_decay: Decoupled weight decay.
        precondition_frequency: Steps between eigenbasis refreshes.
        flatten: Precondition parameters of more than 2 dims as ``(shape[0], -1)``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
        flatten: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, flatten=flatten)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step; ``closure`` (optional) re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim == 2 or (p.ndim > 2 and group["flatten"]):
                    self._kl_shampoo(p, group)
                else:
                    self._adam(p, group)
        return loss

    def _adam(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
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

    def _kl_shampoo(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        state = self.state[p]
        assert p.grad is not None
        grad = p.grad.reshape(p.shape[0], -1)
        m, n = grad.shape
        if not state:
            sigma = max(float(grad.norm()) / (m * n) ** 0.5, 1e-30)
            state["step"] = 0
            state["M"] = torch.zeros_like(grad)
            for side, size in (("a", m), ("b", n)):
                state[f"S{side}"] = sigma * torch.eye(size, dtype=grad.dtype)
                state[f"d{side}"] = torch.full((size,), sigma, dtype=grad.dtype)
                state[f"Q{side}"] = torch.eye(size, dtype=grad.dtype)
        qa, qb, da, db = state["Qa"], state["Qb"], state["da"], state["db"]
        wa, wb = 1.0 / (da + eps), 1.0 / (db + eps)
        gqb, gqa = grad @ qb, grad.T @ qa
        state["Sa"].mul_(beta2).addmm_(gqb * wb, gqb.T, alpha=(1 - beta2) / n)
        state["Sb"].mul_(beta2).addmm_(gqa * wa, gqa.T, alpha=(1 - beta2) / m)
        rotated_sq = (qa.T @ gqb).square()
        state["da"] = beta2 * da + (1 - beta2) / n * (rotated_sq @ wb)
        state["db"] = beta2 * db + (1 - beta2) / m * (rotated_sq.T @ wa)
        state["step"] += 1
        t = state["step"]
        if t > 1 and (t - 1) % group["precondition_frequency"] == 0:
            state["da"], state["Qa"] = _eigh(state["Sa"])
            state["db"], state["Qb"] = _eigh(state["Sb"])
        qa, qb = state["Qa"], state["Qb"]
        state["M"].lerp_(grad, 1 - beta1)
        scale = (state["da"] + eps).rsqrt()[:, None] * (state["db"] + eps).rsqrt()[None, :]
        direction = qa @ ((qa.T @ state["M"] @ qb) * scale) @ qb.T
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(direction.view_as(p), alpha=-group["lr"] / (1 - beta1**t))
