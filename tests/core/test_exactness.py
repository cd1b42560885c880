"""Float64 exactness of factors and preconditioning against explicit math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from tests.support.cases import CONV_MODULE_CASES, conv_module_id
from tests.support.explicit import (
    conv_a_batch,
    conv_g_batch,
    explicit_pad,
    grad_blocks,
    kron_solve,
    linear_a_batch,
    linear_g_batch,
    one_step_grads,
)

pytestmark = pytest.mark.usefixtures("float64", "each_backend")

RHO = 0.7
DAMPING = 0.003



def _pre(model: nn.Module, **kw) -> kaisa.KFACPreconditioner:
    base = dict(factor_decay=RHO, damping=DAMPING, kl_clip=None, inv_dtype=torch.float64)
    base.update(kw)
    return kaisa.KFACPreconditioner(model, **base)


def _running(batch: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(batch.shape[-1]).expand_as(batch)
    return RHO * eye + (1 - RHO) * batch


def _squeeze(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.shape[0] == 1 else t


def test_same_padding_rule_matches_torch():
    # the explicit helper must agree with torch's own 'same' convolution
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, (4, 2), dilation=(1, 3), padding="same")
    x = torch.randn(2, 2, 7, 6)
    ref = F.conv2d(F.pad(x, explicit_pad(conv)), conv.weight, conv.bias, dilation=conv.dilation)
    torch.testing.assert_close(conv(x), ref)


@pytest.mark.parametrize("case", CONV_MODULE_CASES, ids=conv_module_id)
@pytest.mark.parametrize("method", ["eigen", "inverse", "pi_inverse"])
def test_conv2d_factors_and_preconditioning(case, method):
    torch.manual_seed(1)
    conv = nn.Conv2d(**case)
    x = torch.randn(3, case["in_channels"], 7, 8)
    r = torch.randn_like(conv(x))
    pre = _pre(conv, compute_method=method)
    one_step_grads(conv, x, r)
    grad = grad_blocks(conv).clone()
    pre.step()
    layer = pre.layers[""]
    a = _running(conv_a_batch(conv, x))
    g = _running(conv_g_batch(conv, r))
    torch.testing.assert_close(layer.a_factor, _squeeze(a))
    torch.testing.assert_close(layer.g_factor, _squeeze(g))
    got = grad_blocks(conv)
    for k in range(conv.groups):
        if method == "eigen":
            want = kron_solve(g[k], a[k], grad[k], DAMPING)
        else:
            eye_g, eye_a = torch.eye(g.shape[-1]), torch.eye(a.shape[-1])
            damp_a = damp_g = DAMPING
            if method == "pi_inverse":  # pi-adjusted factored damping, per group
                pi = (torch.diagonal(a[k]).mean() / torch.diagonal(g[k]).mean()).sqrt()
                damp_a, damp_g = pi * DAMPING**0.5, DAMPING**0.5 / pi
            want = torch.linalg.solve(g[k] + damp_g * eye_g, grad[k]) @ torch.linalg.inv(
                a[k] + damp_a * eye_a
            )
        torch.testing.assert_close(got[k], want)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5), (2, 2, 3, 5)])
def test_linear_factors_any_leading_dims(bias, shape):
    torch.manual_seed(2)
    lin = nn.Linear(5, 4, bias=bias)
    x = torch.randn(*shape)
    r = torch.randn(*shape[:-1], 4)
    pre = _pre(lin)
    one_step_grads(lin, x, r)
    grad = grad_blocks(lin).clone()
    pre.step()
    a = _running(linear_a_batch(lin, x))
    g = _running(linear_g_batch(r))
    torch.testing.assert_close(pre.layers[""].a_factor, a[0])
    torch.testing.assert_close(pre.layers[""].g_factor, g[0])
    torch.testing.assert_close(grad_blocks(lin)[0], kron_solve(g[0], a[0], grad[0], DAMPING))


def test_linear_non_contiguous_input():
    torch.manual_seed(3)
    lin = nn.Linear(5, 3)
    x = torch.randn(5, 4, 6).transpose(0, 2)  # (6, 4, 5), non-contiguous
    assert not x.is_contiguous()
    r = torch.randn(6, 4, 3)
    pre = _pre(lin)
    one_step_grads(lin, x, r)
    pre.step()
    torch.testing.assert_close(pre.layers[""].a_factor, _running(linear_a_batch(lin, x))[0])


def test_eigen_without_outer_product_uses_current_damping():
    torch.manual_seed(4)
    lin = nn.Linear(4, 3)
    sched = {0: 0.01, 1: 0.2}
    pre = _pre(lin, damping=lambda s: sched[s], compute_eigenvalue_outer_product=False,
               inv_update_steps=5)
    x, r = torch.randn(8, 4), torch.randn(8, 3)
    for step in range(2):
        lin.zero_grad()
        one_step_grads(lin, x, r)
        grad = grad_blocks(lin).clone()
        layer = pre.layers[""]
        pre.step()  # step 1: decomposition from step 0, damping of step 1
        a = layer.qa[0] @ torch.diag(layer.da[0]) @ layer.qa[0].T
        g = layer.qg[0] @ torch.diag(layer.dg[0]) @ layer.qg[0].T
        torch.testing.assert_close(grad_blocks(lin)[0], kron_solve(g, a, grad[0], sched[step]))


def test_outer_product_keeps_decomposition_damping():
    torch.manual_seed(5)
    lin = nn.Linear(4, 3)
    sched = {0: 0.01, 1: 0.2}
    pre = _pre(lin, damping=lambda s: sched[s], compute_eigenvalue_outer_product=True,
               inv_update_steps=5)
    x, r = torch.randn(8, 4), torch.randn(8, 3)
    for _ in range(2):
        lin.zero_grad()
        one_step_grads(lin, x, r)
        grad = grad_blocks(lin).clone()
        pre.step()
        layer = pre.layers[""]
        a = layer.qa[0] @ torch.diag(layer.da[0]) @ layer.qa[0].T
        g = layer.qg[0] @ torch.diag(layer.dg[0]) @ layer.qg[0].T
        torch.testing.assert_close(grad_blocks(lin)[0], kron_solve(g, a, grad[0], sched[0]))


def _two_layer():
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("kl_clip", [1e-6, 1e-3, 10.0])
def test_kl_clip_formula(kl_clip):
    lr = 0.3
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    grads, preconds = [], []
    for clip in (None, kl_clip):
        model = _two_layer()
        pre = _pre(model, kl_clip=clip, lr=lr)
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        pre.step()
        preconds.append([p.grad.clone() for p in model.parameters()])
    vg = sum((p * g).sum() for p, g in zip(preconds[0], grads[0])) * lr**2
    nu = min(1.0, float(torch.sqrt(kl_clip / vg.abs())))
    for p_clip, p in zip(preconds[1], preconds[0]):
        torch.testing.assert_close(p_clip, p * nu)
    if kl_clip == 10.0:
        assert nu == 1.0
    else:
        assert nu < 1.0


def test_kl_clip_zero_gradient_gives_nu_one():
    model = _two_layer()
    pre = _pre(model, kl_clip=1e-3)
    x = torch.randn(8, 5)
    (model(x).sum() * 0.0).backward()
    pre.step()
    for p in model.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p.grad))


def test_decoupled_update_steps():
    torch.manual_seed(7)
    lin = nn.Linear(4, 3)
    pre = _pre(lin, factor_update_steps=2, inv_update_steps=3)
    layer = pre.layers[""]
    history = []
    for _ in range(7):
        lin.zero_grad()
        one_step_grads(lin, torch.randn(8, 4), torch.randn(8, 3))
        pre.step()
        history.append((layer.a.clone(), layer.qa.clone()))
    a_changed = [not torch.equal(history[i][0], history[i - 1][0]) for i in range(1, 7)]
    q_changed = [not torch.equal(history[i][1], history[i - 1][1]) for i in range(1, 7)]
    # steps 1..6: factors fold on even steps, decompositions on multiples of 3
    assert a_changed == [False, True, False, True, False, True]
    assert q_changed == [False, False, True, False, False, True]
    assert pre.steps == 7


def test_accumulation_mean_of_micro_batches():
    torch.manual_seed(8)
    lin = nn.Linear(4, 3)
    pre = _pre(lin, accumulation_steps=3)
    xs = [torch.randn(5, 4) for _ in range(3)]
    rs = [torch.randn(5, 3) for _ in range(3)]
    for x, r in zip(xs, rs):
        one_step_grads(lin, x, r)
    pre.step()
    a = sum(linear_a_batch(lin, x) for x in xs) / 3
    g = sum(linear_g_batch(r) for r in rs) / 3
    torch.testing.assert_close(pre.layers[""].a_factor, _running(a)[0])
    torch.testing.assert_close(pre.layers[""].g_factor, _running(g)[0])


def test_update_factors_in_hook_false_is_identical():
    outs = []
    for in_hook in (True, False):
        torch.manual_seed(9)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
        pre = _pre(model, update_factors_in_hook=in_hook, accumulation_steps=2)
        for _ in range(2):
            for _ in range(2):
                model(torch.randn(3, 2, 6, 6)).square().sum().backward()
            pre.step()
            model.zero_grad()
        outs.append([la.a_factor.clone() for la in pre.layers.values()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_grad_scaler_callable_divides_output_gradient():
    torch.manual_seed(10)
    scale = 1024.0
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    results = []
    for scaler in (None, lambda: scale):
        model = _two_layer()
        pre = _pre(model, grad_scaler=scaler)
        loss = F.mse_loss(model(x), y)
        (loss * (scale if scaler else 1.0)).backward()
        if scaler:
            for p in model.parameters():
                p.grad.div_(scale)
        pre.step()
        results.append(
            ([la.g_factor.clone() for la in pre.layers.values()],
             [p.grad.clone() for p in model.parameters()])
        )
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_hooks_only_in_training_mode_and_with_grad():
    lin = nn.Linear(4, 3)
    pre = _pre(lin)
    lin.eval()
    lin(torch.randn(2, 4)).sum().backward()
    lin.train()
    with torch.no_grad():
        lin(torch.randn(2, 4))
    pre.step()
    assert pre.layers[""].a_factor is None
