"""The influence conventions against their anchor, Kronfluence 1.0.1 (float64).

``docs/conventions.md``, "Influence", transcribed in plain torch below (one batch of every
example: the formulas do not depend on the batch size once the Fisher labels are fixed),
equals Kronfluence's EK-FAC on a 64-32-10 MLP over 200 digits with 20 queries: the
covariances, ``Λ`` in Kronfluence's bases, the damping, and the pairwise and
self-influence scores, to 1e-6 relative (measured: about 1e-15). With the empirical
Fisher and the heuristic damping, and with fixed Fisher labels and an absolute damping.
``kaisa.influence`` will be held to the same anchor. Skipped where Kronfluence is not
installed (CI installs it: ``pip install --no-deps kronfluence==1.0.1``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.slow

F64 = torch.float64


def _digits() -> tuple[nn.Module, TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=F64) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(F64)
    return model, TensorDataset(x[:200], y[:200]), TensorDataset(x[200:220], y[200:220])


def _rows(model: nn.Module, x: torch.Tensor,
          loss: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per Linear: ``a`` (inputs with the ones column last) and ``g`` (output gradients
    of the summed loss), one row per example."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            def hook(m: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                out.retain_grad()
                seen[name] = (args[0].detach(), out)

            handles.append(module.register_forward_hook(hook))
    loss(model(x.clone().requires_grad_(True))).backward()
    for handle in handles:
        handle.remove()
    rows = {}
    for name, (a, out) in seen.items():
        ones = torch.ones(a.shape[0], 1, dtype=a.dtype)
        assert out.grad is not None
        rows[name] = (torch.cat([a, ones], dim=1), out.grad.detach())
    return rows


def _summed(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: F.cross_entropy(logits, labels, reduction="sum")


def _grads(rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-example gradients ``G_n = g a^T`` ``(n, d_out, d_in + 1)``."""
    return torch.einsum("no,ni->noi", rows[1], rows[0])


def _lambda(grads: torch.Tensor, qs: torch.Tensor, qa: torch.Tensor) -> torch.Tensor:
    """Step 3: ``(1/N) sum_n (QS^T G_n QA)^2``."""
    return ((qs.T @ grads @ qa) ** 2).mean(0)


def _precondition(grads: torch.Tensor, qs: torch.Tensor, qa: torch.Tensor,
                  lam: torch.Tensor, damping: float) -> torch.Tensor:
    """Step 5: ``QS ((QS^T G QA) / (Λ + λ)) QA^T``."""
    return qs @ ((qs.T @ grads @ qa) / (lam + damping)) @ qa.T


def conventions_ekfac(model: nn.Module, train: TensorDataset, query: TensorDataset, *,
                      damping: float | None, factor_labels: torch.Tensor,
                      lambda_labels: torch.Tensor) -> dict[str, Any]:
    """The conventions' steps 1-7, for Linear blocks, in float64."""
    x, y = train.tensors
    factor_pass = _rows(model, x, _summed(factor_labels))
    lambda_pass = _rows(model, x, _summed(lambda_labels))
    train_pass = _rows(model, x, _summed(y))
    query_pass = _rows(model, query.tensors[0], _summed(query.tensors[1]))
    factors: dict[str, dict[str, Any]] = {}
    pairwise = torch.zeros(len(query), len(train), dtype=F64)
    self_scores = torch.zeros(len(train), dtype=F64)
    for name, (a, g) in factor_pass.items():
        cov_a, cov_s = a.T @ a / a.shape[0], g.T @ g / g.shape[0]  # 1
        qa = torch.linalg.eigh((cov_a + cov_a.T) / 2).eigenvectors  # 2
        qs = torch.linalg.eigh((cov_s + cov_s.T) / 2).eigenvectors
        g_lambda = _grads(lambda_pass[name])
        lam = _lambda(g_lambda, qs, qa)
        lam_d = damping if damping is not None else float(0.1 * lam.mean())  # 4
        g_train, g_query = _grads(train_pass[name]), _grads(query_pass[name])
        pairwise += torch.einsum("qoi,toi->qt", _precondition(g_query, qs, qa, lam, lam_d),
                                 g_train)  # 6
        self_scores += (_precondition(g_train, qs, qa, lam, lam_d) * g_train).sum((1, 2))  # 7
        factors[name] = {"A": cov_a, "S": cov_s, "G_lambda": g_lambda, "damping": lam_d}
    return {"factors": factors, "pairwise": pairwise, "self": self_scores}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("fisher", "damping"), [("empirical", None), ("fixed", 1e-3)])
def test_the_conventions_equal_kronfluence(fisher: str, damping: float | None,
                                           tmp_path: Path) -> None:
    pytest.importorskip("kronfluence", reason="kronfluence 1.0.1 is not installed")
    from tests.support.kronfluence import kronfluence_ekfac

    model, train, query = _digits()
    labels = train.tensors[1]
    if fisher == "fixed":  # labels drawn once from the model: the Fisher labels of both passes
        with torch.no_grad():
            probs = F.softmax(model(train.tensors[0]), dim=-1)
        labels = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3))[:, 0]
    theirs = kronfluence_ekfac(model, train, query, damping=damping, batch_size=64,
                               workdir=str(tmp_path), empirical=fisher == "empirical",
                               fixed_labels=None if fisher == "empirical" else labels)
    ours = conventions_ekfac(model.eval(), train, query, damping=damping,
                             factor_labels=labels, lambda_labels=labels)
    assert set(ours["factors"]) == set(theirs["factors"]) == {"0", "2"}
    for name, want in theirs["factors"].items():
        have = ours["factors"][name]
        assert _rel(have["A"], want["A"]) < 1e-6 and _rel(have["S"], want["S"]) < 1e-6
        in_their_bases = _lambda(have["G_lambda"], want["QS"], want["QA"])
        assert _rel(in_their_bases, want["lambda"]) < 1e-6, name
        assert abs(have["damping"] - want["damping"]) <= 1e-6 * want["damping"], name
    assert theirs["pairwise"].shape == (20, 200) and theirs["self"].shape == (200,)
    assert _rel(ours["pairwise"], theirs["pairwise"]) < 1e-6
    assert _rel(ours["self"], theirs["self"]) < 1e-6
    assert bool((theirs["self"] > 0).all())  # a positive definite preconditioner
