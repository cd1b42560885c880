"""bench/convergence/gpt.py's anchors (KL-Shampoo, Muon's grid, ``--wide``) and EKFAC's lr-transfer rules."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.bench import load_bench


def test_bench_gpt_anchor_configs_smoke(tmp_path: Path) -> None:
    module = load_bench("gpt")
    out = tmp_path / "gpt.json"
    only = ("adamw@0.003,klshampoo@0.01,muon@0.02,muon@0.1,ekfac-graft@0.003,"
            "ekfac-rms-b95@0.003")
    payload = module.main(["--tiny", "--steps", "3", "--only", only, "--out", str(out),
                           "--text-bytes", "60000", "--no-plot"])
    assert json.loads(out.read_text())["summary"] == payload["summary"]
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == only.split(",")
    assert len({r["curve"][0]["val_loss"] for r in results.values()}) == 1
    finals = {name: r["final_val_loss"] for name, r in results.items()}
    assert all(0 < loss < 10 for loss in finals.values()), finals
    assert finals["muon@0.02"] != finals["muon@0.1"]  # the lr reaches Muon
    for name in ("ekfac-graft@0.003", "ekfac-rms-b95@0.003"):
        assert results[name]["mean_adam_over_ekfac_update_norm"] > 0
    assert finals["ekfac-rms-b95@0.003"] != finals["ekfac-graft@0.003"]
    assert set(module.ANCHOR_CONFIGS) >= {"klshampoo@0.01", "muon@0.05"}


def test_bench_gpt_wide_settings(tmp_path: Path) -> None:
    out = tmp_path / "wide.json"
    payload = load_bench("gpt").main(
        ["--wide", "--steps", "1", "--eval-windows", "4", "--text-bytes", "60000",
         "--only", "adamw@0.003", "--out", str(out), "--no-plot"])
    settings = payload["settings"]
    assert (settings["d_model"], settings["layers"], settings["heads"], settings["context"],
            settings["batch"]) == (256, 6, 8, 128, 16)
    assert len(payload["results"][0]["curve"]) == 2


def _kl_shampoo_on(grads: list[torch.Tensor], **kwargs: float) -> dict[str, torch.Tensor]:
    """KL-Shampoo's state after steps on the given gradients of a zero-lr matrix."""
    weight = nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float64))
    opt = load_bench("kl_shampoo").KLShampoo([weight], lr=0.0, **kwargs)
    for grad in grads:
        weight.grad = grad
        opt.step()
    return opt.state[weight]


def test_kl_shampoo_eigenvalue_estimates_match_the_factors_between_refreshes() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 3, dtype=torch.float64) * (1 + k) for k in range(14)]
    state = _kl_shampoo_on(grads, precondition_frequency=10)  # one refresh, at step 11
    for side in ("a", "b"):
        q = state[f"Q{side}"]
        projected = torch.diagonal(q.T @ state[f"S{side}"] @ q)
        torch.testing.assert_close(state[f"d{side}"], projected, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(state["Qa"], torch.eye(5, dtype=torch.float64))


def test_kl_shampoo_fits_a_kronecker_covariance_with_its_scale() -> None:
    """Gradients ``A^{1/2} Z B^{1/2}`` (``Z`` i.i.d.): ``S_a (x) S_b -> A (x) B``."""
    torch.manual_seed(1)
    a_root = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.3], [0.0, 0.0, 0.4]],
                          dtype=torch.float64)
    b_root = torch.tensor([[2.0, 0.0], [1.0, 0.5]], dtype=torch.float64)
    a, b = a_root @ a_root.T, b_root.T @ b_root
    grads = [a_root @ torch.randn(3, 2, dtype=torch.float64) @ b_root for _ in range(6000)]
    state = _kl_shampoo_on(grads, betas=(0.9, 0.999), precondition_frequency=1)
    fitted, true = torch.kron(state["Sa"], state["Sb"]), torch.kron(a, b)
    assert float((fitted - true).norm() / true.norm()) < 0.1
    # Shampoo's one-sided factors have the shape but not the scale: E[G G^T] = A tr(B)
    one_sided = torch.kron(a * torch.trace(b), b * torch.trace(a))
    assert float((one_sided - true).norm() / true.norm()) > 1.0


def test_scaled_ekfac_graft_matches_adams_update_norm() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = load_bench("ekfac_transfer").ScaledEKFAC(model, rule="graft", lr=0.01,
                                                   weight_decay=0.0)
    adam_model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    adam_model.load_state_dict(model.state_dict())
    adam = torch.optim.Adam(adam_model.parameters(), lr=0.01)
    x = torch.randn(32, 6, dtype=torch.float64)
    for _ in range(3):  # the same gradients for both: measured on the Adam copy's weights
        adam_model.zero_grad()
        adam_model(x).square().sum().backward()
        grads = [p.grad.clone() for p in adam_model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(x).square().sum().backward()  # the hooks' factors
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        before = [p.detach().clone() for p in model.parameters()]
        adam_before = [p.detach().clone() for p in adam_model.parameters()]
        opt.step()
        adam.step()
        for p, q, p0, q0 in zip(model.parameters(), adam_model.parameters(), before,
                                adam_before, strict=True):
            step, adam_step = p.detach() - p0, q.detach() - q0
            torch.testing.assert_close(step.norm(), adam_step.norm(), rtol=1e-10, atol=0)
            if p.ndim == 2 and _ > 0:
                cosine = float((step * adam_step).sum() / (step.norm() * adam_step.norm()))
                assert cosine < 0.999999  # EKFAC's direction, not Adam's
    with pytest.raises(ValueError, match="rule"):
        load_bench("ekfac_transfer").ScaledEKFAC(model, rule="trust")
