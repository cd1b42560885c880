"""kaisa.KFAC: fixed mode equals preconditioner + SGD, the quadratic model, MC Fisher, LM."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.kfac.losses import Loss
from kaisa.kfac.optimizer import lm_damping

pytestmark = pytest.mark.usefixtures("float64")


def _mlp(out: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, out))


def _batch(n: int = 6, out: int = 2, classes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    y = torch.randint(0, out, (n,), generator=g) if classes else torch.randn(n, out, generator=g)
    return x, y


# --------------------------------------------------------------------------- fixed mode


@pytest.mark.parametrize("with_closure", [True, False])
def test_fixed_empirical_mode_equals_preconditioner_plus_sgd(with_closure: bool) -> None:
    kw = dict(factor_update_steps=1, inv_update_steps=2, inv_dtype=torch.float64)
    reference, model = _mlp(), _mlp()
    pre = kaisa.KFACPreconditioner(reference, damping=0.003, lr=0.1, **kw)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = kaisa.KFAC(model, loss="mse", curvature="empirical", lr=0.1, momentum=0.9,
                     damping=0.003, **kw)
    for step in range(5):
        x, y = _batch()
        x = x + step
        sgd.zero_grad()
        F.mse_loss(reference(x), y).backward()
        pre.step()
        sgd.step()
        if with_closure:
            opt.step(lambda x=x, y=y: (model(x), y))
        else:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fixed_lr_follows_an_lr_scheduler() -> None:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", curvature="empirical", lr=0.5, momentum=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    x, y = _batch()
    opt.step(lambda: (model(x), y))
    sched.step()
    assert opt._current("lr") == pytest.approx(0.05)
    assert opt.last["lr"] == pytest.approx(0.5)
    opt.step(lambda: (model(x), y))
    assert opt.last["lr"] == pytest.approx(0.05)


# --------------------------------------------------------------------------- quadratic model


def _flat_jacobian(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    params = dict(model.named_parameters())
    names = list(params)

    def f(*flat: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(model, dict(zip(names, flat)), (x,))
        return out.reshape(-1)

    jac = torch.autograd.functional.jacobian(f, tuple(params.values()))
    return torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1), f(*params.values())


def _explicit_hessian(loss: Loss, outputs: torch.Tensor) -> torch.Tensor:
    k = outputs.numel()
    if loss.kind is kaisa.kfac.losses.LossKind.MSE:
        return 2.0 * loss.scale(outputs) * torch.eye(k)
    p = torch.softmax(outputs, dim=-1)
    blocks = [torch.diag(pi) - torch.outer(pi, pi) for pi in p]
    return torch.block_diag(*blocks) * loss.scale(outputs)


@pytest.mark.parametrize("kind", ["mse", "cross_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_quadratic_model_coefficients_are_exact(kind: str, reduction: str) -> None:
    model = _mlp(out=3)
    opt = kaisa.KFAC(model, loss=kind, reduction=reduction, damping=0.02, weight_decay=0.01)
    x, _ = _batch(out=3, classes=kind == "cross_entropy")
    outputs = model(x)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    vectors = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
    raw = [torch.randn(p.shape, generator=g) for p in params]
    quad, lin, sq = opt.quadratic_model(outputs, params, raw, vectors)
    jac, _ = _flat_jacobian(model, x)
    hess = _explicit_hessian(opt.loss, outputs.detach())
    ggn = jac.T @ hess @ jac
    flat = [torch.cat([v.reshape(-1) for v in vec]) for vec in vectors]
    graw = torch.cat([r.reshape(-1) for r in raw])
    for i in range(2):
        assert lin[i] == pytest.approx(float(graw @ flat[i]), rel=1e-12)
        for j in range(2):
            want = flat[i] @ ggn @ flat[j] + (0.02 + 0.01) * flat[i] @ flat[j]
            assert quad[i, j] == pytest.approx(float(want), rel=1e-10)
            assert sq[i, j] == pytest.approx(float(flat[i] @ flat[j]), rel=1e-12)


def _objective_parts(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss,
                     wd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat gradient of loss + wd/2 |theta|^2 and the explicit Gauss-Newton matrix."""
    model.zero_grad()
    value = loss(model(x), y)
    value.backward()
    params = list(model.parameters())
    grad = torch.cat([(p.grad + wd * p.detach()).reshape(-1) for p in params])
    jac, outputs = _flat_jacobian(model, x)
    hess = _explicit_hessian(loss, outputs.detach().reshape(x.shape[0], -1))
    return grad, jac.T @ hess @ jac


@pytest.mark.parametrize("kind", ["mse", "cross_entropy"])
def test_chosen_lr_and_momentum_minimise_the_quadratic_model(kind: str) -> None:
    """Optimality: the update d satisfies v.(g + (C + (lambda + wd) I) d) = 0 for each
    vector v of the model (the direction, and the previous update)."""
    model = _mlp(out=3)
    wd = 0.01
    opt = kaisa.KFAC(model, loss=kind, damping=0.05, weight_decay=wd, adaptive_damping=False,
                     curvature="empirical", inv_dtype=torch.float64, max_momentum=None)
    x, y = _batch(out=3, classes=kind == "cross_entropy")
    previous: torch.Tensor | None = None
    for _ in range(3):
        before = copy.deepcopy(model)
        opt.step(lambda: (model(x), y))
        velocity = torch.cat([opt.state[p]["velocity"].reshape(-1) for p in model.parameters()])
        grad, ggn = _objective_parts(before, x, y, opt.loss, wd)
        curvature = ggn + (0.05 + wd) * torch.eye(ggn.shape[0])
        residual = grad + curvature @ velocity
        alpha, mu = -opt.last["lr"], opt.last["momentum"]
        direction = velocity if previous is None else (velocity - mu * previous) / alpha
        scale = grad.abs().max() * direction.abs().max()
        tol = 1e-9 * float(scale) * len(grad)
        assert abs(float((direction @ residual).detach())) < tol
        if previous is not None:
            assert abs(float((previous @ residual).detach())) < tol
        else:
            assert mu == 0.0
        assert opt.last["lr"] > 0
        # the LM rule's prediction: the undamped model (weight decay in, damping out)
        undamped = ggn + wd * torch.eye(ggn.shape[0])
        predicted = grad @ velocity + 0.5 * velocity @ undamped @ velocity
        assert opt.last["predicted_change"] == pytest.approx(float(predicted.detach()), rel=1e-8)
        previous = velocity


def test_lm_rule() -> None:
    assert lm_damping(1.0, 0.9, 0.5, 1e-8, 1e3) == 0.5  # the model predicted well: shrink
    assert lm_damping(1.0, 0.1, 0.5, 1e-8, 1e3) == 2.0  # badly: grow
    assert lm_damping(1.0, 0.5, 0.5, 1e-8, 1e3) == 1.0  # in between: keep
    assert lm_damping(1.0, math.nan, 0.5, 1e-8, 1e3) == 2.0
    assert lm_damping(1e-8, 0.9, 0.5, 1e-8, 1e3) == 1e-8  # clamped
    assert lm_damping(800.0, -1.0, 0.5, 1e-8, 1e3) == 1e3


def test_adaptive_damping_moves_with_rho() -> None:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", damping=1.0, damping_interval=1, damping_decay=0.5,
                     inv_dtype=torch.float64)
    x, y = _batch()
    opt.step(lambda: (model(x), y))
    rho = opt.last["rho"]
    assert math.isfinite(rho)
    want = 0.5 if rho > 0.75 else 2.0 if rho < 0.25 else 1.0
    assert opt.damping == pytest.approx(want)


# --------------------------------------------------------------------------- MC Fisher


@pytest.mark.parametrize("kind", ["mse", "cross_entropy"])
def test_mc_fisher_g_matches_the_type2_fisher_in_expectation(kind: str) -> None:
    """One Linear layer: E[G_mc] = c * sum_i H_i (the exact type-2 Fisher's G)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    samples = 400
    opt = kaisa.KFAC(model, loss=kind, mc_samples=samples, factor_decay=1e-12,
                     inv_dtype=torch.float64, seed=0)
    x, y = _batch(n=32, out=4, classes=kind == "cross_entropy")
    outputs = model(x)
    opt.step(lambda: (model(x), y))
    layer = opt.preconditioner.layers[""]
    assert layer.g is not None
    got = layer.g[0]
    loss = Loss.of(kind)
    c, n = loss.scale(outputs), loss.examples(outputs)
    if kind == "mse":
        want = c * n * 2.0 * torch.eye(4)  # H_i = 2 I per example, G = c sum_i H_i
    else:
        p = torch.softmax(outputs.detach(), dim=-1)
        want = c * sum(torch.diag(pi) - torch.outer(pi, pi) for pi in p)
    err = (got - want).abs().max() / want.abs().max()
    assert float(err) < 0.08, (got, want)  # ~1/sqrt(32 * 400) relative noise per entry


# --------------------------------------------------------------------------- resume


def test_state_dict_resume_is_bit_exact() -> None:
    def run(model: nn.Module, opt: kaisa.KFAC, steps: range) -> None:
        for step in steps:
            x, y = _batch()
            opt.step(lambda x=x, y=y, step=step: (model(x + 0.1 * step), y))

    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", damping_interval=2, inv_dtype=torch.float64)
    run(model, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, range(3, 6))

    other = _mlp()
    other.load_state_dict(saved_model)
    resumed = kaisa.KFAC(other, loss="mse", damping_interval=2, inv_dtype=torch.float64, seed=7)
    resumed.load_state_dict(saved_opt)
    run(other, resumed, range(3, 6))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed.damping == opt.damping


def test_invalid_arguments_name_them() -> None:
    for kwargs, name in [
        ({"loss": "hinge"}, "loss"),
        ({"loss": "mse", "lr": "fast"}, "lr"),
        ({"loss": "mse", "lr": 0.1}, "momentum='adaptive' needs lr='adaptive'"),
        ({"loss": "mse", "damping": 0.0}, "damping"),
        ({"loss": "mse", "mc_samples": 0}, "mc_samples"),
        ({"loss": "mse", "kl_clip": 0.01}, "kl_clip"),
    ]:
        with pytest.raises(ValueError, match=name):
            kaisa.KFAC(_mlp(), **kwargs)  # type: ignore[arg-type]
    opt = kaisa.KFAC(_mlp(), loss="mse")
    with pytest.raises(ValueError, match="closure"):
        opt.step()


def test_non_finite_loss_takes_no_step_and_is_returned() -> None:
    model = _mlp(out=3)
    opt = kaisa.KFAC(model, loss="cross_entropy")
    x, y = _batch(out=3, classes=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(lambda: (model(x) * float("nan"), y))  # e.g. diverged logits
    assert loss is not None and not torch.isfinite(loss)
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the abandoned step's statistics do not leak into the next step's factors
    opt.step(lambda: (model(x), y))
    fresh_model = _mlp(out=3)
    fresh = kaisa.KFAC(fresh_model, loss="cross_entropy")
    fresh.step(lambda: (fresh_model(x), y))
    for la, lb in zip(opt.preconditioner.layers.values(), fresh.preconditioner.layers.values(),
                      strict=True):
        assert torch.equal(la.a_factor, lb.a_factor)


def test_mc_pass_that_builds_the_linearization_records_the_same_factors() -> None:
    # adaptive mode: one create_graph pass records G and builds J^T; fixed mode: a plain
    # Monte-Carlo backward. Same seed, same batch: the same running factors.
    x, y = _batch(n=7, out=3)
    factors = []
    for lr in ("adaptive", 0.1):
        model = _mlp(out=3)
        opt = kaisa.KFAC(model, loss="mse", lr=lr, momentum=0.0 if lr == 0.1 else "adaptive",
                         inv_dtype=torch.float64, seed=3)
        opt.step(lambda model=model: (model(x), y))  # same parameters: same factors
        factors.append([(la.a_factor, la.g_factor) for la in opt.preconditioner.layers.values()])
    for (a1, g1), (a2, g2) in zip(*factors, strict=True):
        torch.testing.assert_close(a1, a2, rtol=0, atol=0)
        torch.testing.assert_close(g1, g2, rtol=1e-14, atol=0)



@pytest.mark.parametrize("curvature", ["mc", "type2"])
def test_g_passes_differentiate_only_the_hooked_outputs(curvature: str) -> None:
    # G's backward passes ask for the gradients of the outputs the forward hooked, not the
    # parameters': the weight gradients are computed once (the loss's pass), and every
    # factor, direction and update equals the passes over the parameters bit for bit.
    from kaisa.train.models.gpt import gpt

    def build() -> nn.Module:
        torch.manual_seed(0)
        return gpt(d_model=8, n_layers=1, n_heads=2, context=5, vocab_size=3)

    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 3, (2, 5), generator=g), torch.randint(0, 3, (2, 5), generator=g)
    runs = []
    for keep in (True, False):
        model = build()
        opt = kaisa.KFAC(model, loss="cross_entropy", curvature=curvature, mc_samples=2,
                         layer_kinds="all", inv_dtype=torch.float64, seed=1)
        computed: list[torch.Tensor] = []
        model.get_parameter("blocks.0.linear1.weight").register_hook(computed.append)
        for _ in range(2):
            opt.curvature.resolve_arm()  # the step's plan sets keep_outputs: then override it
            opt.curvature.recorder.keep_outputs = keep  # False: the passes over the parameters
            computed.clear()
            opt.step(lambda model=model: (model(x), y))
            assert not opt.curvature.recorder.kept_outputs  # nothing kept past the step
        passes = 2 if curvature == "mc" else 3  # samples, or the classes (type-2 columns)
        assert len(computed) == (1 if keep else 1 + passes)
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = o1.curvature.state_dict(), o2.curvature.state_dict()
    assert s1.keys() == s2.keys()
    for name, state in s1.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, s2[name][key]), (name, key)


def test_upstream_edges_are_those_no_other_precedes() -> None:
    from torch.autograd.graph import get_gradient_edge

    from kaisa.kfac.fisher import upstream

    w = torch.randn(3, 3, requires_grad=True)
    h = torch.ones(2, 3) @ w
    a, b = h.split([1, 2], dim=1)  # parts of one node: kept together
    c = (a * 2 + b.sum()) @ w[:1]
    side = torch.ones(2, 3) @ w.T  # a branch no other edge precedes
    edges = [get_gradient_edge(t) for t in (c, a, b, side)]
    assert upstream(edges) == [edges[1], edges[2], edges[3]]
    assert upstream([edges[0], get_gradient_edge(h)]) == [get_gradient_edge(h)]
    assert upstream([edges[0]]) == [edges[0]]


# --------------------------------------------------------------------------- mixed precision


def _scaler(scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1_000_000)


@pytest.mark.parametrize("lr", ["adaptive", 0.05])
def test_grad_scaler_with_a_power_of_two_scale_changes_nothing(lr: object) -> None:
    # scaling by 2^k and unscaling is exact: the trajectory equals the unscaled one
    momentum = "adaptive" if lr == "adaptive" else 0.9
    models = [_mlp(out=3), _mlp(out=3)]
    opts = [
        kaisa.KFAC(m, loss="mse", lr=lr, momentum=momentum, inv_dtype=torch.float64,
                   grad_scaler=scaler)
        for m, scaler in zip(models, (None, _scaler(2.0**12)), strict=True)
    ]
    for step in range(4):
        x, y = _batch(out=3)
        for m, opt in zip(models, opts, strict=True):
            opt.step(lambda m=m, x=x, y=y, step=step: (m(x + 0.1 * step), y))
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_grad_scaler_without_closure_is_driven_by_kfac() -> None:
    models = [_mlp(), _mlp()]
    scaler = _scaler(2.0**8)
    opts = [
        kaisa.KFAC(m, loss="mse", curvature="empirical", lr=0.1, momentum=0.9,
                   grad_scaler=sc)
        for m, sc in zip(models, (None, scaler), strict=True)
    ]
    for _ in range(3):
        x, y = _batch()
        for m, opt, sc in zip(models, opts, (None, scaler), strict=True):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            (loss if sc is None else sc.scale(loss)).backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    # the torch pattern scaler.step(opt) would unscale twice: a clear error instead
    x, y = _batch()
    scaler.scale(F.mse_loss(models[1](x), y)).backward()
    with pytest.raises(ValueError, match="drives its grad_scaler"):
        scaler.step(opts[1])


def test_grad_scaler_overflow_skips_the_update_and_backs_off() -> None:
    torch.set_default_dtype(torch.float32)
    model = _mlp(out=3)
    scaler = _scaler(2.0**127)  # gradients overflow float32
    opt = kaisa.KFAC(model, loss="mse", grad_scaler=scaler)
    x, y = _batch(out=3)
    y = 100.0 * y  # a loss of ~1e4: scaled by 2^127 it overflows
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(lambda: (model(x), y))
    assert opt.last["overflow"] == 1.0 and opt.steps == 1
    assert scaler.get_scale() == 2.0**126
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    for layer in opt.preconditioner.layers.values():  # a non-finite G is never folded in
        assert bool(torch.isfinite(layer.g_factor).all())
    for _ in range(3):  # still a large scale, but finite gradients: updates resume
        scaler.update(2.0**10)
        opt.step(lambda: (model(x), y))
    assert "overflow" not in opt.last
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_autocast_closure_trains(half: torch.dtype) -> None:
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
    scaler = _scaler(2.0**10) if half is torch.float16 else None
    opt = kaisa.KFAC(model, loss="mse", grad_scaler=scaler, damping=1e-2)
    x = torch.randn(64, 6)

    def closure() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=half):
            out = model(x)
        assert out.dtype == half
        return out, x

    first = float(opt.step(closure))  # type: ignore[arg-type]
    for _ in range(30):
        last = float(opt.step(closure))  # type: ignore[arg-type]
    assert last < 0.5 * first
    assert opt.last["lr"] > 0 and math.isfinite(opt.last["predicted_change"])
