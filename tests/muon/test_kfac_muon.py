"""kaisa.KFACMuon against its conventions (``docs/conventions.md``, "KFACMuon").

* ``curvature='identity'`` is ``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit;
* ``'input'``: float64, the update written with explicit matrices (``A = X^T X / M`` of the
  inputs without a bias column, ``M = (A / k + ridge I)^-1``, Muon's momentum, the
  Newton-Schulz iteration in float64, the lr adjustment, decoupled weight decay) for Linear
  with and without bias, Conv2d and ``nn.MultiheadAttention``;
* ``'eigen'``: float64, ``O = NS(-u)`` of EKFAC's update ``u`` at ``lr = 1`` on a model
  without biases (the same factors, bases and moments);
* checkpoints resume bit for bit; bad arguments are refused; no output-gradient hook in
  the input mode; an overflowed step changes nothing.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.muon.methods import input_parts
from kaisa.muon.newton_schulz import DEFAULT_NS_COEFFICIENTS

_QUIET = pytest.mark.filterwarnings("ignore:.*the hooks of registered layer")


class _Net(nn.Module):
    """Embedding, attention, Linear with and without bias, a norm, a head (every kind)."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm(h + self.down(torch.tanh(self.up(h))))
        return self.head(h)


def _batches(steps: int, vocab: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (3, 5), generator=g),
             torch.randint(0, vocab, (3, 5), generator=g)) for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# ----------------------------------------------------------------------------- identity


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_identity_is_torch_muon_plus_adamw_bit_for_bit(nesterov: bool, adjust: str | None
                                                       ) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    opt = kaisa.KFACMuon(model, lr=0.05, weight_decay=0.1, nesterov=nesterov,
                         adjust_lr_fn=adjust, curvature="identity", adamw_lr=3e-3)
    covered = {n for n, kind in opt.coverage().items() if kind != "first-order"}
    names = dict(ref.named_parameters())
    assert covered == {"attn.in_proj_weight", "attn.out_proj.weight", "up.weight",
                       "down.weight", "head.weight"}
    muon = torch.optim.Muon([names[n] for n in sorted(covered)], lr=0.05, weight_decay=0.1,
                            nesterov=nesterov, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([p for n, p in names.items() if n not in covered], lr=3e-3)
    for x, y in _batches(6):
        _loss(model, x, y).backward()
        _loss(ref, x, y).backward()
        opt.step()
        muon.step()
        adamw.step()
        for o in (opt, muon, adamw):
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_identity_stacks_matrices_of_one_shape() -> None:
    """Four 64 x 64 matrices in one stack: Muon's result per matrix (float32, bfloat16 NS)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    ref = copy.deepcopy(model)
    opt = kaisa.KFACMuon(model, lr=0.02, curvature="identity")
    muon = torch.optim.Muon(list(ref.parameters()), lr=0.02)
    x = torch.randn(16, 64)
    for _ in range(3):
        for m, o in ((model, opt), (ref, muon)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- explicit math


def _ns64(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's Newton-Schulz, float64, one matrix."""
    a, b, c = DEFAULT_NS_COEFFICIENTS
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if u.shape[0] > u.shape[1] else x


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _inputs(model: nn.Module) -> dict[nn.Module, list[torch.Tensor]]:
    """Hooks keeping each Linear/Conv2d/MHA input as the rows of its A (no bias column)."""
    seen: dict[nn.Module, list[torch.Tensor]] = {}

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], _: object) -> None:
        x = args[0].detach()
        if isinstance(module, nn.Conv2d):
            rows = F.unfold(x, module.kernel_size, padding=module.padding)
            # the conventions' conv A: (P / S)^T (P / S) / (N S), S output positions
            x = rows.transpose(1, 2).reshape(-1, rows.shape[1]) / rows.shape[2]
        seen.setdefault(module, []).append(x.reshape(-1, x.shape[-1]))

    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Conv2d | nn.MultiheadAttention) and \
                not isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear):
            m.register_forward_hook(hook)
    return seen


@_QUIET
@pytest.mark.parametrize(("kind", "widest"), [("transformer", None), ("conv", None),
                                              ("transformer", 8), ("conv", 6)])
def test_input_mode_equals_explicit_matrices_float64(kind: str, widest: int | None) -> None:
    """``widest``: ``max_input_dim`` (``A`` replaced by its block diagonal)."""
    torch.manual_seed(0)
    dtype = torch.float64
    model = (_Net() if kind == "transformer" else _Conv()).to(dtype)
    ref = copy.deepcopy(model)
    lr, wd, mu, rho, ridge = 0.05, 0.1, 0.9, 0.8, 0.3
    opt = kaisa.KFACMuon(model, lr=lr, weight_decay=wd, momentum=mu, curvature="input",
                         refresh_steps=2, factor_decay=rho, ridge=ridge, ns_dtype=dtype,
                         adamw_lr=1e-2, adamw_eps=1e-4, max_input_dim=widest)
    blocks = opt.curvature.blocks
    assert all(b.a is None and b.g is None for b in blocks.values())
    # the explicit reference: per block weight (and the MHA's out_proj input)
    if kind == "transformer":
        mha = ref.attn
        weights = {"attn.in_proj": mha.in_proj_weight, "attn.out_proj": mha.out_proj.weight,
                   "up": ref.up.weight, "down": ref.down.weight, "head": ref.head.weight}
    else:
        weights = {"conv": ref.conv.weight, "fc": ref.fc.weight}
    assert set(blocks) == set(weights)
    seen = _inputs(ref)
    others = [p for p in ref.parameters() if all(p is not w for w in weights.values())]
    # eps 1e-4: Adam's r / (|r| + eps) would amplify the last bits of a near-zero r
    adamw = torch.optim.AdamW(others, lr=1e-2, eps=1e-4)
    running: dict[str, torch.Tensor] = {}
    inverse: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if kind == "transformer":
        batches = [(x, y) for x, y in _batches(4)]
    else:
        g = torch.Generator().manual_seed(2)
        batches = [(torch.randn(4, 2, 4, 4, generator=g, dtype=dtype),
                    torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]

    def loss_of(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _loss(m, x, y) if kind == "transformer" else F.cross_entropy(m(x), y)

    for step, (x, y) in enumerate(batches):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        for v in seen.values():
            v.clear()
        loss_of(ref, x, y).backward()
        out_rows = _out_proj_rows(ref, x) if kind == "transformer" else None
        for name, w in weights.items():
            if out_rows is not None and name == "attn.out_proj":
                rows = out_rows
            elif kind == "transformer" and name == "attn.in_proj":
                rows = seen[ref.attn][0]
            else:
                rows = seen[getattr(ref, name)][0]
            a_batch = rows.T @ rows / rows.shape[0]
            running[name] = rho * running.get(name, torch.zeros_like(a_batch)) + \
                (1 - rho) * a_batch
            if step % 2 == 0:
                a = running[name]
                k = a.diagonal().mean()
                parts = input_parts(len(a), widest)
                if parts > 1:
                    d = len(a) // parts
                    a = torch.block_diag(*(a[i * d:(i + 1) * d, i * d:(i + 1) * d]
                                           for i in range(parts)))
                eye = torch.eye(len(a), dtype=dtype)
                inverse[name] = torch.linalg.inv(a / k + ridge * eye)
            grad = w.grad.reshape(w.shape[0], -1)
            p = grad @ inverse[name]
            buf = buffers.setdefault(name, torch.zeros_like(p))
            buf.lerp_(p, 1 - mu)
            o = _ns64(p.lerp(buf, mu))
            m_rows, n_cols = grad.shape
            with torch.no_grad():
                w.mul_(1 - lr * wd)
                w.sub_(lr * math.sqrt(max(1, m_rows / n_cols)) * o.view_as(w))
        adamw.step()
        adamw.zero_grad()
        ref.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=f"step {step} {name}")
    for name, block in blocks.items():  # A without a bias column: X^T X / M
        assert block.a is not None and block.a.shape[-1] == running[name].shape[-1]
        torch.testing.assert_close(block.a[0], running[name], rtol=0, atol=1e-13)
        assert block.g is None  # one-sided: nothing recorded from output gradients


def _out_proj_rows(model: _Net, x: torch.Tensor) -> torch.Tensor:
    """The input of the MHA's out_proj: the attention's output before the projection."""
    mha = model.attn
    h = model.emb(x).detach()
    q, k, v = F.linear(h, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    b, t, e = q.shape
    heads = mha.num_heads

    def split(z: torch.Tensor) -> torch.Tensor:
        return z.reshape(b, t, heads, e // heads).transpose(1, 2)

    att = F.scaled_dot_product_attention(split(q), split(k), split(v))
    return att.transpose(1, 2).reshape(b * t, e).detach()


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 7, bias=False)
        self.b = nn.Linear(7, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("dense", [None, 6])
def test_eigen_mode_orthogonalises_ekfacs_update_float64(dense: int | None) -> None:
    """``dense``: ``max_basis_dim`` (the 7-wide sides keep the identity basis, as EKFAC's)."""
    torch.manual_seed(0)
    dtype = torch.float64
    model = _Plain().to(dtype)
    ref = copy.deepcopy(model)
    lr, wd, b1, b2 = 0.05, 0.1, 0.9, 0.95
    opt = kaisa.KFACMuon(model, lr=lr, weight_decay=wd, momentum=b1, beta2=b2,
                         adam_eps=1e-8, curvature="eigen", refresh_steps=2,
                         basis_refresh="eigh", ns_dtype=dtype, max_basis_dim=dense)
    ekfac = kaisa.EKFAC(ref, lr=1.0, betas=(b1, b2), eps=1e-8, weight_decay=0.0,
                        basis_update_steps=2, basis_refresh="eigh", max_basis_dim=dense)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(9, 6, generator=g, dtype=dtype)
        target = torch.randn(9, 4, generator=g, dtype=dtype)
        F.mse_loss(model(x), target).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), target).backward()
        before = [p.detach().clone() for p in ref.parameters()]
        ekfac.step()
        ekfac.zero_grad()
        with torch.no_grad():
            for p, old in zip(ref.parameters(), before, strict=True):
                u = p - old  # EKFAC's u at lr 1
                o = _ns64(-u)
                rows, cols = u.shape
                p.copy_(old * (1 - lr * wd) - lr * math.sqrt(max(1, rows / cols)) * o)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=f"step {step}")
    assert all(b.g is not None for b in opt.curvature.blocks.values())
    sides = {n: set(b.diagonal_sides) for n, b in opt.curvature.blocks.items()}
    assert sides == ({"a": set(), "b": set()} if dense is None else
                     {"a": {kaisa.utils.enums.Side.G}, "b": {kaisa.utils.enums.Side.A}})


# ----------------------------------------------------------------------------- product


@_QUIET
@pytest.mark.parametrize("mode", ["input", "eigen", "identity"])
def test_state_dict_resumes_bit_for_bit(mode: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    kwargs = dict(lr=0.05, curvature=mode, refresh_steps=2, factor_rows=7)
    opt = kaisa.KFACMuon(model, **kwargs)  # type: ignore[arg-type]
    batches = _batches(6)
    for x, y in batches[:3]:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for x, y in batches[3:]:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    other = _Net()
    other.load_state_dict(saved[0])
    opt2 = kaisa.KFACMuon(other, **kwargs)  # type: ignore[arg-type]
    opt2.load_state_dict(saved[1])
    for x, y in batches[3:]:
        _loss(other, x, y).backward()
        opt2.step()
        opt2.zero_grad()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)


def test_lr_scheduler_and_param_groups() -> None:
    torch.manual_seed(0)
    model = _Net()
    names = dict(model.named_parameters())
    muon = [names[n] for n in ("attn.in_proj_weight", "attn.out_proj.weight", "up.weight",
                               "down.weight", "head.weight")]
    rest = [p for p in model.parameters() if all(p is not q for q in muon)]
    opt = kaisa.KFACMuon(model, lr=0.05, param_groups=[
        {"params": muon[:2], "lr": 0.02}, {"params": muon[2:]},
        {"params": rest, "weight_decay": 0.0}])
    assert [g["use_muon"] for g in opt.param_groups] == [True, True, False]
    assert opt.param_groups[2]["lr"] == 1e-3 and opt.param_groups[2]["betas"] == (0.9, 0.999)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for x, y in _batches(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="mixes block weights"):
        net = _Net()
        kaisa.KFACMuon(net, param_groups=[{"params": list(net.parameters())}])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="curvature"):
        kaisa.KFACMuon(_Net(), curvature="shampoo")
    with pytest.raises(ValueError, match="layer_kinds"):
        kaisa.KFACMuon(_Net(), layer_kinds=("embedding",))
    with pytest.raises(ValueError, match="ridge"):
        kaisa.KFACMuon(_Net(), ridge=0.0)
    with pytest.raises(ValueError, match="ns_steps"):
        kaisa.KFACMuon(_Net(), ns_steps=100)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        kaisa.KFACMuon(_Net(), adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="momentum"):
        kaisa.KFACMuon(_Net(), momentum=1.0)
    with pytest.raises(ValueError, match="max_input_dim applies"):
        kaisa.KFACMuon(_Net(), curvature="eigen", max_input_dim=4)
    with pytest.raises(ValueError, match="max_basis_dim applies"):
        kaisa.KFACMuon(_Net(), curvature="input", max_basis_dim=4)
    with pytest.raises(ValueError, match="model must be"):
        kaisa.KFACMuon(_Net().parameters())  # type: ignore[arg-type]


def test_input_mode_hooks_no_output_gradient() -> None:
    model = _Net()
    opt = kaisa.KFACMuon(model, curvature="input")
    hooked: list[torch.Tensor] = []
    real = torch.Tensor.register_hook

    def count(self: torch.Tensor, hook: object) -> object:
        hooked.append(self)
        return real(self, hook)  # type: ignore[arg-type]

    x, y = _batches(1)[0]
    torch.Tensor.register_hook = count  # type: ignore[method-assign]
    try:
        _loss(model, x, y).backward()
    finally:
        torch.Tensor.register_hook = real  # type: ignore[method-assign]
    assert hooked == []
    opt.step()
    assert all(b.a is not None and b.g is None for b in opt.curvature.blocks.values())


@pytest.mark.parametrize("mode", ["input", "eigen"])
def test_overflowed_step_changes_nothing(mode: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = kaisa.KFACMuon(model, curvature=mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model, x, y)).backward()
    model.up.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@_QUIET
@pytest.mark.parametrize("mode", ["input", "eigen"])
def test_accumulation_equals_the_whole_batch_float64(mode: str) -> None:
    """Two micro-batches of half the rows (loss halved) equal one step on all of them."""
    torch.manual_seed(0)
    whole = _Plain().double()
    split = copy.deepcopy(whole)
    kwargs = dict(lr=0.05, curvature=mode, refresh_steps=2, ns_dtype=torch.float64,
                  adamw_eps=1e-4)
    one = kaisa.KFACMuon(whole, **kwargs)  # type: ignore[arg-type]
    two = kaisa.KFACMuon(split, accumulation_steps=2, **kwargs)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        target = torch.randn(8, 4, generator=g, dtype=torch.float64)
        F.mse_loss(whole(x), target).backward()
        one.step()
        one.zero_grad()
        for half in (slice(0, 4), slice(4, 8)):
            (F.mse_loss(split(x[half]), target[half]) / 2).backward()
        two.step()
        two.zero_grad()
        for p, q in zip(whole.parameters(), split.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


@_QUIET
@pytest.mark.parametrize("mode", ["input", "eigen"])
def test_bf16_autocast_stays_finite(mode: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    opt = kaisa.KFACMuon(model, lr=0.05, curvature=mode, refresh_steps=2)
    for x, y in _batches(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(b.a is not None and torch.isfinite(b.a).all()
               for b in opt.curvature.blocks.values())


def test_tied_embedding_and_head_take_adamw_on_the_byte_gpt() -> None:
    """The byte GPT (tied embedding/head, positions, LayerNorms, MHA): identity mode, by
    default one matrix at a time (``batch_matrices=False``), is Muon on the blocks'
    matrices + AdamW on the rest, the tied weight included, bit for bit (its matrices
    come in stacks of two 16 x 16 ones, where a batched bfloat16 product may round
    differently from Muon's)."""
    from kaisa.train.models.gpt import gpt

    torch.manual_seed(0)
    model = gpt(d_model=16, context=8, n_layers=2, n_heads=2)
    ref = copy.deepcopy(model)
    opt = kaisa.KFACMuon(model, lr=0.05, curvature="identity", adamw_lr=3e-3)
    assert opt.batch_matrices is False  # identity's default
    assert kaisa.KFACMuon(copy.deepcopy(model), curvature="input").batch_matrices is True
    kinds = opt.coverage()
    assert model.head.weight is model.embedding.weight  # tied
    assert kinds["embedding.weight"] == "first-order"
    muon_names = {n for n, k in kinds.items() if k != "first-order"}
    named = dict(ref.named_parameters())
    assert muon_names == {n for n, p in named.items() if p.ndim == 2 and n.startswith("blocks.")}
    muon = torch.optim.Muon([named[n] for n in named if n in muon_names], lr=0.05)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=3e-3)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        tokens = torch.randint(0, 256, (2, 9), generator=g)
        for m in (model, ref):
            out = m(tokens[:, :-1])
            F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        muon.step()
        adamw.step()
        for o in (opt, muon, adamw):
            o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
