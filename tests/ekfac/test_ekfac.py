"""kaisa.EKFAC against the explicit math of docs/conventions.md ("EKFAC"), in float64.

The model has every Kronecker kind EKFAC registers by default with both kinds of sides
(an embedding, whose A side is diagonal; a Conv1d and a Linear with biases; a Linear
without) and parameters no Kronecker block covers (a LayerNorm, a free scale).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.methods import EigenAdamMethod, EigenMethod, linalg
from kaisa.utils.enums import Side

pytestmark = pytest.mark.usefixtures("float64")

VOCAB, CLASSES = 11, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.conv = nn.Conv1d(6, 5, 3, padding=1)
        self.norm = nn.LayerNorm(5)
        self.fc = nn.Linear(5, 4)
        self.head = nn.Linear(4, CLASSES, bias=False)
        self.scale = nn.Parameter(torch.ones(CLASSES))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.emb(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(torch.tanh(self.fc(self.norm(h)))) * self.scale


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (n, 7), generator=gen),
            torch.randint(0, CLASSES, (n, 7), generator=gen))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).reshape(-1, CLASSES), targets.reshape(-1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int, *,
           identity: bool = False) -> None:
    if identity:  # no factors, hence no basis: every block keeps the identity
        opt.curvature.recording = False  # type: ignore[attr-defined]
    opt.zero_grad()
    _loss(model, _batch(step)).backward()
    opt.step()


def _decay_groups(model: Net) -> list[dict[str, Any]]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return [{"params": matrices, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim != 2], "weight_decay": 0.0}]


HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6)


# --------------------------------------------------------------------------- AdamW


def test_identity_basis_is_adamw_bit_for_bit() -> None:
    ours, reference = _net(), _net()
    opt = kaisa.EKFAC(ours, **HYPER, param_groups=_decay_groups(ours))
    adamw = torch.optim.AdamW(_decay_groups(reference), **HYPER, foreach=False)
    assert set(opt.coverage().values()) == {"embedding", "conv1d", "linear", "first-order"}
    for step in range(6):
        _train(ours, opt, step, identity=True)
        _train(reference, adamw, step)
        for p, q in zip(ours.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), step
    for block in opt.curvature.blocks.values():  # the blocks took EKFAC's path
        assert "exp_avg" in block.decomposition and "qg" not in block.decomposition
    start = [p.detach() for p in _net().parameters()]
    assert min(float((p.detach() - q).abs().max()) for p, q in zip(ours.parameters(), start,
                                                          strict=True)) > 1e-3  # moved


def test_lr_scheduler_drives_the_param_groups() -> None:
    ours, reference = _net(), _net()
    opt = kaisa.EKFAC(ours, **HYPER, weight_decay=0.05)
    adamw = torch.optim.AdamW(reference.parameters(), **HYPER, weight_decay=0.05, foreach=False)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, adamw)]
    for step in range(4):
        _train(ours, opt, step, identity=True)
        _train(reference, adamw, step)
        for schedule in schedules:
            schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-2 / 5)
    for p, q in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


# --------------------------------------------------------------------------- the eigenbasis


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen))
    return q * torch.sign(torch.diagonal(r))


def _matrix(name: str, model: Net) -> torch.Tensor:
    """The gradient matrix of block ``name``, written out per kind."""
    module = getattr(model, name)
    if name == "emb":
        return module.weight.grad.T
    g = module.weight.grad.reshape(module.weight.shape[0], -1)
    return g if module.bias is None else torch.cat([g, module.bias.grad[:, None]], dim=1)


def _apply(name: str, model: Net, update: torch.Tensor, lr: float, wd: float) -> list[torch.Tensor]:
    """The block's parameters after ``p (1 - lr wd) - lr u``."""
    module = getattr(model, name)
    w = module.weight.detach()
    if name == "emb":
        return [w * (1 - lr * wd) - lr * update.T]
    out = [w * (1 - lr * wd) - lr * update[:, : w[0].numel()].reshape(w.shape)]
    if module.bias is not None:
        out.append(module.bias.detach() * (1 - lr * wd) - lr * update[:, -1])
    return out


def test_fixed_basis_is_adam_on_the_rotated_gradients_across_a_refresh() -> None:
    """With bases installed by hand (and changed by hand at step 3), EKFAC equals Adam on
    ``QG^T g QA``: ``m`` as SOAP keeps it (in the original coordinates, projected every
    step), ``v`` in the basis, projected with the squared change of basis at the refresh."""
    lr, (b1, b2), eps, wd = 2e-2, (0.9, 0.99), 1e-8, 0.05
    model = _net()
    opt = kaisa.EKFAC(model, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    method, blocks, gen = opt.curvature._method, opt.curvature.blocks, torch.Generator().manual_seed(3)

    def bases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for name, block in blocks.items():
            a_dim, g_dim = block.dims
            qa = None if block.is_diagonal(Side.A) else _orthogonal(a_dim, gen)
            out[name] = (_orthogonal(g_dim, gen), qa)
        return out

    def install(new: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        for name, (qg, qa) in new.items():
            a_dim, g_dim = blocks[name].dims
            a = [torch.ones(1, a_dim)] if qa is None else [qa[None], torch.ones(1, a_dim)]
            method.install(blocks[name].decomposition, a, [qg[None], torch.ones(1, g_dim)],
                           damping=0.0, diagonal=blocks[name].diagonal_sides)

    current = bases()
    install(current)
    big_m = {n: torch.zeros(b.dims[1], b.dims[0]) for n, b in blocks.items()}  # original coords
    v = {n: torch.zeros(b.dims[1], b.dims[0]) for n, b in blocks.items()}
    for step in range(1, 7):
        if step == 4:  # a refresh: v projected, m unchanged in the original coordinates
            new = bases()
            for name, (qg, qa) in new.items():
                rg = current[name][0].T @ qg
                ra = torch.eye(blocks[name].dims[0]) if qa is None else \
                    current[name][1].T @ qa  # type: ignore[union-attr]
                v[name] = (rg * rg).T @ v[name] @ (ra * ra)
            install(new)
            current = new
        opt.curvature.recording = False  # the bases stay as installed
        opt.zero_grad()
        _loss(model, _batch(step)).backward()
        expected = {}
        for name, (qg, qa) in current.items():
            g = _matrix(name, model)
            big_m[name] = b1 * big_m[name] + (1 - b1) * g
            r = qg.T @ g if qa is None else qg.T @ g @ qa
            v[name] = b2 * v[name] + (1 - b2) * r * r
            m_rot = qg.T @ big_m[name] if qa is None else qg.T @ big_m[name] @ qa
            adam = (m_rot / (1 - b1**step)) / ((v[name] / (1 - b2**step)).sqrt() + eps)
            update = qg @ adam if qa is None else qg @ adam @ qa.T
            expected[name] = _apply(name, model, update, lr, wd)
        opt.step()
        for name, params in expected.items():
            for got, want in zip(blocks[name].parameters(), params, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14,
                                           msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")


def _state(n_a: int, n_g: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"qa": _orthogonal(n_a, gen)[None], "da": torch.ones(1, n_a),
            "qg": _orthogonal(n_g, gen)[None], "dg": torch.ones(1, n_g),
            "exp_avg": torch.randn(1, n_g, n_a, generator=gen),
            "exp_avg_sq": torch.rand(1, n_g, n_a, generator=gen)}


def test_refresh_rotates_m_exactly_and_projects_v() -> None:
    method, gen = EigenAdamMethod(), torch.Generator().manual_seed(5)
    state = _state(4, 3, gen)
    old = {k: t.clone() for k, t in state.items()}
    qa, qg = _orthogonal(4, gen)[None], _orthogonal(3, gen)[None]
    method.install(state, [qa, torch.ones(1, 4)], [qg, torch.ones(1, 3)], damping=0.0)
    ra, rg = old["qa"][0].T @ qa[0], old["qg"][0].T @ qg[0]
    torch.testing.assert_close(state["exp_avg"][0], rg.T @ old["exp_avg"][0] @ ra,
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["exp_avg_sq"][0],
                               (rg * rg).T @ old["exp_avg_sq"][0] @ (ra * ra),
                               rtol=1e-12, atol=1e-14)
    # m is the same vector in the original coordinates
    torch.testing.assert_close(qg[0] @ state["exp_avg"][0] @ qa[0].T,
                               old["qg"][0] @ old["exp_avg"][0] @ old["qa"][0].T,
                               rtol=1e-12, atol=1e-14)
    assert torch.equal(state["qa"], qa) and torch.equal(state["qg"], qg)


def test_refresh_that_reorders_and_flips_columns_permutes_v_as_soap() -> None:
    method, gen = EigenAdamMethod(), torch.Generator().manual_seed(6)
    state = _state(4, 3, gen)
    v, m = state["exp_avg_sq"].clone(), state["exp_avg"].clone()
    perm_a, perm_g = torch.tensor([2, 0, 3, 1]), torch.tensor([1, 2, 0])
    qa = state["qa"][..., perm_a] * torch.tensor([1.0, -1.0, 1.0, -1.0])
    qg = state["qg"][..., perm_g] * torch.tensor([-1.0, 1.0, 1.0])
    method.install(state, [qa, torch.ones(1, 4)], [qg, torch.ones(1, 3)], damping=0.0)
    torch.testing.assert_close(state["exp_avg_sq"], v[:, perm_g][:, :, perm_a], rtol=1e-12,
                               atol=1e-15)
    signs = torch.tensor([-1.0, 1.0, 1.0])[:, None] * torch.tensor([1.0, -1.0, 1.0, -1.0])
    torch.testing.assert_close(state["exp_avg"], m[:, perm_g][:, :, perm_a] * signs,
                               rtol=1e-12, atol=1e-15)


def test_first_basis_rotates_from_the_identity_and_a_resent_basis_changes_nothing() -> None:
    method, gen = EigenAdamMethod(), torch.Generator().manual_seed(7)
    m, v = torch.randn(1, 3, 4, generator=gen), torch.rand(1, 3, 4, generator=gen)
    state = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    qg = _orthogonal(3, gen)[None]
    # only G arrives (A failed): A stays the identity
    method.install(state, None, [qg, torch.ones(1, 3)], damping=0.0)
    torch.testing.assert_close(state["exp_avg"], qg.mT @ m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["exp_avg_sq"], (qg * qg).mT @ v, rtol=1e-12, atol=1e-14)
    before = {k: t.clone() for k, t in state.items()}
    method.install(state, None, [qg.clone(), torch.ones(1, 3)], damping=0.0)
    assert all(torch.equal(state[k], before[k]) for k in ("exp_avg", "exp_avg_sq"))


# --------------------------------------------------------------------------- refresh methods


def _spectrum(n: int, gen: torch.Generator, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.stack([_orthogonal(n, gen) for _ in range(batch)])
    d = torch.linspace(0.05, 3.0, n).expand(batch, n) * torch.tensor([[1.0], [0.5]])[:batch]
    return q @ torch.diag_embed(d) @ q.mT, d


def test_warm_refresh_converges_to_eigh_and_keeps_a_converged_basis() -> None:
    gen = torch.Generator().manual_seed(8)
    factor, d = _spectrum(6, gen)
    start = torch.stack([_orthogonal(6, gen) for _ in range(2)])
    q = start
    for _ in range(400):
        (res,) = linalg.warm_eigen_decompositions([factor], [q], inv_dtype=torch.float64)
        assert res is not None
        q = res.eigenvectors
    (exact,) = linalg.eigen_decompositions([factor], inv_dtype=torch.float64)
    assert exact is not None
    overlap = (q.mT @ exact.eigenvectors).abs()  # same columns up to sign, same order
    torch.testing.assert_close(overlap, torch.eye(6).expand(2, 6, 6), rtol=0, atol=1e-8)
    torch.testing.assert_close(res.eigenvalues, d, rtol=0, atol=1e-10)
    (again,) = linalg.warm_eigen_decompositions([factor], [exact.eigenvectors],
                                                inv_dtype=torch.float64)
    assert again is not None
    torch.testing.assert_close(again.eigenvectors, exact.eigenvectors, rtol=0, atol=1e-12)


def test_warm_refresh_falls_back_to_eigh() -> None:
    gen = torch.Generator().manual_seed(9)
    factor, _ = _spectrum(5, gen)
    broken = torch.full((2, 5, 5), math.nan)
    res = linalg.warm_eigen_decompositions([factor, factor], [broken, None],
                                           inv_dtype=torch.float64)
    (exact,) = linalg.eigen_decompositions([factor], inv_dtype=torch.float64)
    assert exact is not None
    for r in res:
        assert r is not None and torch.equal(r.eigenvectors, exact.eigenvectors)


def test_qr_refresh_runs_eigh_on_its_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    dense, warm = EigenMethod.decompose_dense, EigenMethod.refresh_dense
    monkeypatch.setattr(EigenMethod, "decompose_dense",
                        lambda self, *a, **k: calls.append("eigh") or dense(self, *a, **k))
    monkeypatch.setattr(EigenMethod, "refresh_dense",
                        lambda self, *a, **k: calls.append("qr") or warm(self, *a, **k))
    model = _net()
    opt = kaisa.EKFAC(model, basis_update_steps=2, basis_refresh="qr", eigh_every=3)
    for step in range(13):
        _train(model, opt, step)
    assert calls == ["eigh", "qr", "qr", "eigh", "qr", "qr", "eigh"]
    assert opt.refreshes == 7


@pytest.mark.parametrize("refresh", ["eigh", "qr"])
def test_ekfac_trains(refresh: str) -> None:
    model = _net()
    opt = kaisa.EKFAC(model, lr=3e-2, basis_update_steps=3, basis_refresh=refresh)
    batch = _batch(0, n=16)
    first = float(_loss(model, batch).detach())
    for _ in range(30):
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
    assert float(_loss(model, batch).detach()) < 0.5 * first
    assert all(b.has_decomposition() for b in opt.curvature.blocks.values())


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_resumes_bit_exactly() -> None:
    kw = dict(lr=2e-2, factor_update_steps=2, basis_update_steps=3, basis_refresh="qr",
              eigh_every=2)
    model = _net()
    opt = kaisa.EKFAC(model, **kw)
    for step in range(4):
        _train(model, opt, step)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(4, 9):
        _train(model, opt, step)
    resumed = Net()
    again = kaisa.EKFAC(resumed, **kw)
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    assert (again.steps, again.refreshes) == (4, 2)
    for step in range(4, 9):
        _train(resumed, again, step)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    layers = opt.state_dict()["kaisa"]["layers"]
    assert all({"exp_avg", "exp_avg_sq", "qa", "qg"} <= set(s) for n, s in layers.items()
               if n != "emb")


def test_load_rejects_a_foreign_state() -> None:
    opt = kaisa.EKFAC(_net())
    with pytest.raises(ValueError, match="no 'kaisa' entry"):
        opt.load_state_dict(torch.optim.AdamW(_net().parameters()).state_dict())
    state = opt.state_dict()
    state["kaisa"]["steps"] = -1
    with pytest.raises(ValueError, match="steps"):
        opt.load_state_dict(state)


# --------------------------------------------------------------------------- AMP, accumulation


def _scaled_run(scaler: torch.amp.GradScaler | None, steps: int = 5) -> tuple[Net, kaisa.EKFAC]:
    model = _net()
    opt = kaisa.EKFAC(model, lr=2e-2, basis_update_steps=2, grad_scaler=scaler)
    for step in range(steps):
        opt.zero_grad()
        loss = _loss(model, _batch(step))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return model, opt


def test_grad_scaler_with_a_power_of_two_scale_changes_no_bit() -> None:
    plain, _ = _scaled_run(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1_000_000)
    scaled, opt = _scaled_run(scaler)
    assert opt.steps == 5
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(p, q)


def test_overflow_folds_factors_and_changes_nothing_else() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1_000_000)
    model, opt = _scaled_run(scaler, steps=3)  # the overflow at step 3 refreshes no basis
    before = [p.detach().clone() for p in model.parameters()]
    steps = [opt.state[p]["step"].clone() for p in model.parameters()]
    moments = {n: b.decomposition["exp_avg"].clone() for n, b in opt.curvature.blocks.items()}
    opt.zero_grad()
    scaler.scale(_loss(model, _batch(9))).backward()
    model.fc.weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9 and opt.steps == 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(model.parameters(), steps,
                                                                     strict=True))
    assert all(torch.equal(b.decomposition["exp_avg"], moments[n])
               for n, b in opt.curvature.blocks.items())
    assert opt.curvature.skipped_factor_updates == 0  # the gradients overflowed, not G


def test_accumulation_equals_the_whole_batch() -> None:
    whole, parts = _net(), _net()
    # eps well above the rounding of the gradients: Adam's normalisation would amplify
    # the order of the sums into coordinates whose gradient is near zero
    kw: dict[str, Any] = dict(lr=2e-2, eps=1e-4, basis_update_steps=2)
    opt_whole = kaisa.EKFAC(whole, **kw)
    opt_parts = kaisa.EKFAC(parts, **kw, accumulation_steps=2)
    for step in range(4):
        tokens, targets = _batch(step, n=6)
        opt_whole.zero_grad()
        _loss(whole, (tokens, targets)).backward()
        opt_whole.step()
        opt_parts.zero_grad()
        for half in (slice(0, 3), slice(3, 6)):
            (_loss(parts, (tokens[half], targets[half])) / 2).backward()
        opt_parts.step()
    for p, q in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_bf16_autocast_trains() -> None:
    torch.set_default_dtype(torch.float32)
    model = _net().float()
    opt = kaisa.EKFAC(model, lr=3e-2, basis_update_steps=3)
    batch = _batch(0, n=16)
    with torch.no_grad():
        first = float(_loss(model, batch))
    for _ in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, batch)
        loss.backward()
        opt.step()
    assert opt.curvature.blocks["fc"].a.dtype == torch.float32
    assert float(_loss(model, batch).detach()) < 0.7 * first


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(lr=-1e-3), "lr must be"),
    (dict(lr=math.nan), "lr must be"),
    (dict(betas=(1.0, 0.9)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=-1.0), "eps must be"),
    (dict(weight_decay=-0.1), "weight_decay must be"),
    (dict(basis_refresh="svd"), "basis_refresh"),
    (dict(eigh_every=0), "eigh_every"),
    (dict(basis_update_steps=0), "inv_update_steps"),
    (dict(factor_decay=1.5), "factor_decay"),
    (dict(layer_kinds=("scale_shift",)), "no Kronecker kind"),
    (dict(grad_worker_fraction=1.5), "grad_worker_fraction"),
    (dict(param_groups=[{"params": []}]), "every trainable parameter"),
    (dict(param_groups=[{"params": list(_net().parameters())}]), "every trainable parameter"),
])
def test_bad_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kaisa.EKFAC(_net(), **kwargs)


def test_bad_param_group_values_raise() -> None:
    model = _net()
    with pytest.raises(ValueError, match="lr of param group 0 must be"):
        kaisa.EKFAC(model, param_groups=[{"params": list(model.parameters()), "lr": -1.0}])
    with pytest.raises(ValueError, match="betas of param group 0"):
        kaisa.EKFAC(model, param_groups=[{"params": list(model.parameters()),
                                          "betas": (0.9, 1.0)}])


def test_model_must_be_a_module() -> None:
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        kaisa.EKFAC(_net().parameters())  # type: ignore[arg-type]


def test_a_block_split_over_groups_with_different_lr_raises_at_the_step() -> None:
    model = _net()
    others = [p for n, p in model.named_parameters() if n != "fc.bias"]
    opt = kaisa.EKFAC(model, param_groups=[{"params": others},
                                           {"params": [model.fc.bias], "lr": 0.5}])
    with pytest.raises(ValueError, match=r"'fc'.*different lr"):
        _train(model, opt, 0)


def test_scale_shift_is_never_a_block() -> None:
    opt = kaisa.EKFAC(_net(), layer_kinds="all")
    assert opt.coverage()["norm.weight"] == "first-order"
    assert "norm" not in opt.curvature.blocks


class _CrossAttention(nn.Module):
    """A decoder layer (cross-attention: q/k/v blocks share in_proj's rows) and an MHA with
    separate q/k/v weights (its three blocks share in_proj_bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.decoder = nn.TransformerDecoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                  batch_first=True)
        self.mixed = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
        self.key, self.value = nn.Linear(8, 6), nn.Linear(8, 5)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        h = self.decoder(x, x.flip(1))
        h = h + self.mixed(h, self.key(h), self.value(h), need_weights=False)[0]
        return self.head(h)


def test_blocks_sharing_a_parameters_rows_step_it_once_as_adamw() -> None:
    torch.manual_seed(0)
    ours = _CrossAttention()
    reference = copy.deepcopy(ours)
    opt = kaisa.EKFAC(ours, **HYPER, weight_decay=0.1)
    adamw = torch.optim.AdamW(reference.parameters(), **HYPER, weight_decay=0.1, foreach=False)
    names = list(opt.curvature.blocks)
    assert "decoder.multihead_attn.q_proj" in names and "mixed.k_proj" in names
    for step in range(4):
        _train(ours, opt, step, identity=True)
        _train(reference, adamw, step)
        for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), (step, name)
    shared = ours.decoder.multihead_attn.in_proj_weight
    assert int(opt.state[shared]["step"]) == 4  # counted once per step, not once per block
