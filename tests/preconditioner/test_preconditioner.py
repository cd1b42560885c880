"""Behaviour of KFACPreconditioner: arguments, robustness, checkpoints, training."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import ops


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2, padding=1),
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
    )


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


def _train(model, pre, opt, steps, start=0):
    for i in range(start, start + steps):
        x, y = _batch(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(damping=-1.0), "damping"),
        (dict(damping=0.0), "damping"),
        (dict(factor_decay=0.0), "factor_decay"),
        (dict(factor_decay=1.5), "factor_decay"),
        (dict(kl_clip=0.0), "kl_clip"),
        (dict(kl_clip=-1.0), "kl_clip"),
        (dict(lr=-0.1), "lr"),
        (dict(factor_update_steps=0), "factor_update_steps"),
        (dict(inv_update_steps=1.5), "inv_update_steps"),
        (dict(accumulation_steps=0), "accumulation_steps"),
        (dict(allreduce_bucket_cap_mb=-1.0), "allreduce_bucket_cap_mb"),
        (dict(compute_method="cholesky"), "compute_method"),
        (dict(assignment_strategy="random"), "assignment_strategy"),
        (dict(grad_worker_fraction=0.0), "grad_worker_fraction"),
        (dict(grad_worker_fraction=1.5), "grad_worker_fraction"),
        (dict(grad_worker_fraction="most"), "grad_worker_fraction"),
        (dict(inv_dtype=torch.int32), "inv_dtype"),
        (dict(factor_dtype="float32"), "factor_dtype"),
        (dict(skip_layers=3), "skip_layers"),
        (dict(skip_layers=["("]), "skip_layers"),
        (dict(grad_scaler=3), "grad_scaler"),
        (dict(symmetry_aware="yes"), "symmetry_aware"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        kaisa.KFACPreconditioner(_model(), **kwargs)


def test_model_without_supported_layers():
    with pytest.raises(ValueError, match="no supported layer"):
        kaisa.KFACPreconditioner(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match="no supported layer"):
        kaisa.KFACPreconditioner(_model(), skip_layers=["Linear", "Conv2d"])


def test_callable_hyperparameter_checked_when_evaluated():
    pre = kaisa.KFACPreconditioner(_model(), damping=lambda s: -1.0)
    with pytest.raises(ValueError, match="damping"):
        _ = pre.damping


def test_enum_strings_case_insensitive():
    pre = kaisa.KFACPreconditioner(
        _model(), compute_method="INVERSE", assignment_strategy="Memory",
        grad_worker_fraction="mem_opt",
    )
    assert pre.compute_method is kaisa.ComputeMethod.INVERSE
    assert pre.assignment_strategy is kaisa.AssignmentStrategy.MEMORY
    assert pre.distributed_strategy is kaisa.DistributedStrategy.MEM_OPT


def test_callable_hyperparameters_follow_steps():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(model, damping=lambda s: 0.01 * (s + 1), lr=lambda s: 0.5)
    assert pre.damping == pytest.approx(0.01)
    _train(model, pre, opt, 2)
    assert pre.steps == 2
    assert pre.damping == pytest.approx(0.03)
    assert pre.lr == 0.5


# ---------------------------------------------------------------- registration
def test_skip_layers_frozen_and_padding_mode():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(2, 2, 3, padding=1),
        nn.Flatten(),
        nn.Linear(2 * 5 * 5, 4),
        nn.Linear(4, 3),
    )
    model[1].weight.requires_grad_(False)
    with pytest.warns(RuntimeWarning, match="padding_mode"):
        pre = kaisa.KFACPreconditioner(model, skip_layers="^4$")
    assert list(pre.layers) == ["3"]
    pre = kaisa.KFACPreconditioner(nn.Sequential(nn.Linear(2, 2), nn.Conv2d(1, 1, 1)),
                                   skip_layers=["Conv2d"])
    assert list(pre.layers) == ["0"]
    layer = pre.layers["0"]
    assert layer.module is not None and layer.a_factor is None and layer.g_factor is None


def test_repr_is_readable():
    text = repr(kaisa.KFACPreconditioner(_model(), damping=lambda s: 0.1))
    assert "KFACPreconditioner(" in text and "layers=3" in text and "damping=<callable>" in text


# ---------------------------------------------------------------- checkpoints
def test_resume_is_bit_identical():
    def fresh():
        model = _model(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = kaisa.KFACPreconditioner(model, inv_update_steps=4, factor_update_steps=1,
                                       lr=0.05)
        return model, opt, pre

    model, opt, pre = fresh()
    _train(model, pre, opt, 6)
    reference = [p.detach().clone() for p in model.parameters()]

    model, opt, pre = fresh()
    _train(model, pre, opt, 3)
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "k": pre.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model, opt, pre = fresh()
    model.load_state_dict(saved["m"])
    opt.load_state_dict(saved["o"])
    pre.load_state_dict(saved["k"])
    assert pre.steps == 3
    _train(model, pre, opt, 3, start=3)
    for a, b in zip(reference, model.parameters()):
        assert torch.equal(a, b)


def test_state_dict_without_factors_and_recompute():
    model, opt = _model(2), None
    pre = kaisa.KFACPreconditioner(model, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, pre, opt, 2)
    sd = pre.state_dict(include_factors=False)
    assert "layers" not in sd and sd["steps"] == 2 and sd["damping"] == 0.01
    full = pre.state_dict()
    for state in full["layers"].values():
        for key in ("qa", "da", "qg", "dg", "dgda"):
            state[key] = None
    pre2 = kaisa.KFACPreconditioner(_model(2), damping=0.01)
    pre2.load_state_dict(full, compute_inverses=True)
    for la in pre2.layers.values():
        assert la.has_decomposition()
    with pytest.raises(ValueError, match="do not match"):
        kaisa.KFACPreconditioner(nn.Linear(2, 2)).load_state_dict(full)


def test_memory_usage_counts_state():
    model = _model()
    pre = kaisa.KFACPreconditioner(model)
    assert pre.memory_usage()["total"] == 0
    _train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    usage = pre.memory_usage()
    expected = sum(
        t.numel() * t.element_size()
        for la in pre.layers.values() for t in (la.a, la.g)
    )
    assert usage["factors"] == expected
    assert usage["decompositions"] > 0
    assert usage["total"] == usage["factors"] + usage["decompositions"] + usage["buffers"]


# ---------------------------------------------------------------- numerics
def test_non_finite_factor_is_skipped_and_grads_stay_finite():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3).float()
    pre = kaisa.KFACPreconditioner(lin)
    lin(torch.randn(8, 4)).square().sum().backward()
    pre.step()
    a_before = pre.layers[""].a_factor.clone()
    lin.zero_grad()
    x = torch.randn(8, 4)
    x[0, 0] = 1e25  # x^T x overflows float32; the forward and grads stay finite
    (lin(x) * 1e-20).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in lin.parameters())
    pre.step()
    assert pre.skipped_factor_updates == 1
    assert torch.equal(pre.layers[""].a_factor, a_before)
    assert all(torch.isfinite(p.grad).all() for p in lin.parameters())


def test_failing_eigh_retries_then_keeps_previous(monkeypatch, caplog):
    model = _model()
    pre = kaisa.KFACPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, pre, opt, 1)
    q_before = {n: la.qa.clone() for n, la in pre.layers.items()}
    real = ops.eigh
    calls = []

    def float32_fails(a):
        calls.append(a.dtype)
        if a.dtype != torch.float64:
            raise torch.linalg.LinAlgError("forced failure")
        return real(a)

    monkeypatch.setattr(ops, "eigh", float32_fails)
    with caplog.at_level(logging.WARNING, logger="kaisa"):
        _train(model, pre, opt, 1, start=1)
    assert torch.float64 in calls and "retried in float64" in caplog.text
    for n, la in pre.layers.items():
        assert la.qa.dtype == torch.float32 and not torch.equal(la.qa, q_before[n])

    def always_fails(a):
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(ops, "eigh", always_fails)
    q_before = {n: la.qa.clone() for n, la in pre.layers.items()}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kaisa"):
        _train(model, pre, opt, 1, start=2)
    assert "keeping the previous" in caplog.text
    for n, la in pre.layers.items():
        assert torch.equal(la.qa, q_before[n])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_failing_first_decomposition_leaves_grads_untouched(monkeypatch):
    model = _model()
    pre = kaisa.KFACPreconditioner(model)

    def always_fails(a):
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(ops, "eigh", always_fails)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    pre.step()
    for a, p in zip(raw, model.parameters()):
        assert torch.equal(a, p.grad)


def test_inverse_method_nan_factor_falls_back(monkeypatch):
    model = _model()
    pre = kaisa.KFACPreconditioner(model, compute_method="inverse")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, pre, opt, 2)
    assert all(la.a_inv is not None for la in pre.layers.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_layer_used_functionally_warns_once_and_is_left_unpreconditioned():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.side = nn.Linear(8, 8)  # its weight is used, the module never called
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(F.linear(self.embed(x), self.side.weight, self.side.bias))
            return self.head(h)

    torch.manual_seed(0)
    net = Net()
    pre = kaisa.KFACPreconditioner(net)
    assert "side" in pre.layers
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(5, 4)).square().mean().backward()
            raw = net.side.weight.grad.clone()
            pre.step()
            assert torch.equal(raw, net.side.weight.grad)
            opt.step()
    named = [w for w in caught if "'side'" in str(w.message)]
    assert len(named) == 1 and "did not fire" in str(named[0].message)
    assert pre.layers["head"].has_decomposition()


def test_keyword_only_call_does_not_break_step():
    lin = nn.Linear(3, 2)
    pre = kaisa.KFACPreconditioner(lin)
    lin(input=torch.randn(4, 3)).sum().backward()
    raw = lin.weight.grad.clone()
    pre.step()
    assert torch.equal(raw, lin.weight.grad) and pre.layers[""].a_factor is None


def test_bf16_autocast_factors_are_float32():
    model = _model()
    pre = kaisa.KFACPreconditioner(model)
    x, y = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    pre.step()
    for la in pre.layers.values():
        assert la.a.dtype == torch.float32 and la.g.dtype == torch.float32
        assert torch.isfinite(la.a).all() and torch.isfinite(la.g).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_torch_amp_grad_scaler_matches_unscaled():
    results = []
    for use_scaler in (False, True):
        model = _model(4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if use_scaler else None
        pre = kaisa.KFACPreconditioner(model, grad_scaler=scaler)
        x, y = _batch(1)
        loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        pre.step()
        results.append([la.g_factor.clone() for la in pre.layers.values()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)


def test_factor_dtype_and_inv_dtype():
    model = _model()
    pre = kaisa.KFACPreconditioner(model, factor_dtype=torch.float64, inv_dtype=torch.float64)
    _train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    for la in pre.layers.values():
        assert la.a.dtype == torch.float64 and la.qa.dtype == torch.float64
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------- backends
@pytest.mark.skipif(not ops.extension_available(), reason="kaisa._C extension not built")
def test_extension_and_reference_backends_agree():
    params = []
    for backend in ("torch", "ext"):
        with ops.use_backend(backend):
            model = _model(5).double()
            pre = kaisa.KFACPreconditioner(model, inv_dtype=torch.float64)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(3):
                x, y = _batch(i)
                opt.zero_grad()
                F.cross_entropy(model(x.double()), y).backward()
                pre.step()
                opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- training
def test_kfac_beats_sgd_on_digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    losses = {}
    for use_kfac in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = kaisa.KFACPreconditioner(model, lr=0.1, damping=0.01) if use_kfac else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(60):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            if pre is not None:
                pre.step()
            opt.step()
        with torch.no_grad():
            losses[use_kfac] = F.cross_entropy(model(x), y).item()
    assert losses[True] < losses[False], losses


def test_training_steps_agree_across_backends_and_devices(device: torch.device) -> None:
    """The same steps on the ext and torch backends give the same parameters."""
    results = {}
    for backend in ("torch", "ext") if kaisa.ops.extension_available() else ("torch",):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5)
        ).to(device=device, dtype=torch.float64)
        x = torch.randn(8, 3, 6, 6, device=device, dtype=torch.float64)
        y = torch.randint(0, 5, (8,), device=device)
        with kaisa.ops.use_backend(backend):
            pre = kaisa.KFACPreconditioner(model, inv_dtype=torch.float64, inv_update_steps=2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                pre.step()
                opt.step()
        results[backend] = [p.detach().cpu() for p in model.parameters()]
    for a, b in zip(results["torch"], results.get("ext", results["torch"]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_reset_timings_keeps_counting_every_phase() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = kaisa.KFACPreconditioner(model)
    x = torch.randn(8, 4)
    for reset in (False, True):
        if reset:
            pre.reset_timings()
            assert all(v == 0.0 for v in pre.timings.values())
        model(x).square().sum().backward()
        pre.step()
        for phase in ("factors", "communication", "decompositions", "preconditioning"):
            assert pre.timings[phase] > 0.0, (phase, reset)  # the engine's and hooks' too
