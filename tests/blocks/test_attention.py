"""nn.MultiheadAttention blocks: factors, preconditioning and recording against explicit math.

The reference (:func:`_reference`) re-implements ``F.multi_head_attention_forward`` with
explicit ``F.linear`` products whose inputs and outputs the test keeps (``retain_grad``):
it is checked to give the module's output (with dropout: the same random numbers, drawn
in the same order), and the factors are computed from it by the formulas of
``docs/conventions.md``.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kaisa
from kaisa.blocks import AttentionBlock
from tests.support.explicit import kron_solve, linear_g_batch, rows_a

pytestmark = pytest.mark.usefixtures("float64")

E, H, N, L, S = 8, 2, 3, 5, 4
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


# ---------------------------------------------------------------------- the reference
@dataclass
class _Products:
    """Inputs (rows, sequence-first) and outputs (kept for their gradients) of each product."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def product(self, key: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                ) -> torch.Tensor:
        out = F.linear(x, w, b)
        out.retain_grad()
        self.inputs[key], self.outputs[key] = x.detach(), out
        return out

    def grad(self, key: str) -> torch.Tensor:
        g = self.outputs[key].grad
        assert g is not None
        return g


def _reference(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
               key_padding_mask: torch.Tensor | None = None, need_weights: bool = True
               ) -> tuple[torch.Tensor, _Products]:
    """MHA's forward (training mode) with explicit q, k, v and out products."""
    batched = query.dim() == 3
    if m.batch_first and batched:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if not batched:
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt, bsz, e = query.shape
    src = key.shape[0]
    heads, hd = m.num_heads, e // m.num_heads
    rec = _Products()
    bq = bk = bv = None
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias.chunk(3)
    if m.in_proj_weight is not None:
        wq, wk, wv = m.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    q = rec.product("q", query, wq, bq)
    k = rec.product("k", key, wk, bk)
    v = rec.product("v", value, wv, bv)
    mask = None
    if attn_mask is not None:
        mask = torch.zeros(attn_mask.shape).masked_fill(attn_mask, -math.inf) \
            if attn_mask.dtype == torch.bool else attn_mask
        mask = mask.unsqueeze(0)
    q = q.reshape(tgt, bsz * heads, hd).transpose(0, 1)
    k = k.reshape(src, bsz * heads, hd).transpose(0, 1)
    v = v.reshape(src, bsz * heads, hd).transpose(0, 1)
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape).masked_fill(key_padding_mask, -math.inf)
        pad = pad.view(bsz, 1, 1, src).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src)
        mask = pad if mask is None else mask + pad
    p = m.dropout if m.training else 0.0
    if need_weights:
        scores = torch.bmm(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(torch.softmax(scores, dim=-1), p=p) if p > 0 else \
            torch.softmax(scores, dim=-1)
        heads_out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt * bsz, e)
    else:
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.size(0) == 1 else mask.view(bsz, heads, -1, src)
        out4 = F.scaled_dot_product_attention(
            q.view(bsz, heads, tgt, hd), k.view(bsz, heads, src, hd),
            v.view(bsz, heads, src, hd), mask, p)
        heads_out = out4.permute(2, 0, 1, 3).reshape(bsz * tgt, e)
    out = rec.product("out", heads_out, m.out_proj.weight, m.out_proj.bias)
    out = out.view(tgt, bsz, e)
    if not batched:
        out = out.squeeze(1)
    elif m.batch_first:
        out = out.transpose(0, 1)
    return out, rec


def _a(x: torch.Tensor, bias: bool) -> torch.Tensor:
    return rows_a(x, bias=bias)


def _g(d: torch.Tensor) -> torch.Tensor:
    return linear_g_batch(d)[0]


def _a_reduce(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """Per example (dim 1 of sequence-first rows): the mean over positions; then ``_a``."""
    return _a(x.mean(0), bias)


def _g_reduce(d: torch.Tensor) -> torch.Tensor:
    return _g(d.sum(0))


# ---------------------------------------------------------------------- helpers
class _Attend(nn.Module):
    """One MHA whose output is weighted by a fixed random tensor (a loss of every output)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = mha

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                **kwargs: object) -> torch.Tensor:
        return self.attn(q, k, v, **kwargs)[0]  # type: ignore[no-any-return]


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _step(model: _Attend, args: tuple[torch.Tensor, ...], kwargs: dict[str, object],
          **options: object) -> kaisa.KFACPreconditioner:
    """One KFACPreconditioner step (factor decay ~0: the running factors are the batch's)."""
    pre = kaisa.KFACPreconditioner(model, factor_decay=1e-300, layer_kinds="all",
                                   inv_dtype=torch.float64, **options)  # type: ignore[arg-type]
    torch.manual_seed(11)
    out = model(*args, **kwargs)
    (out * _weights(out.shape)).sum().backward()
    pre.step()
    return pre


def _explicit(model: _Attend, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]
              ) -> _Products:
    """The reference on the same parameters and random numbers, checked against the module."""
    mha = model.attn
    torch.manual_seed(11)
    want = model(*args, **kwargs)
    torch.manual_seed(11)
    out, rec = _reference(mha, *args, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(out, want, **TIGHT)
    (out * _weights(out.shape)).sum().backward()
    return rec


def _factors(pre: kaisa.KFACPreconditioner, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    block = pre.layers[name]
    assert block.a_factor is not None and block.g_factor is not None, name
    return block.a_factor, block.g_factor


def _inputs(batch_first: bool, batched: bool = True, src: int = S, dim: int = E
            ) -> torch.Tensor:
    g = torch.Generator().manual_seed(dim + src)
    if not batched:
        return torch.randn(src, dim, generator=g)
    shape = (N, src, dim) if batch_first else (src, N, dim)
    return torch.randn(shape, generator=g)


# ---------------------------------------------------------------------- self-attention
@pytest.mark.parametrize(("batch_first", "batched", "bias", "need_weights", "dropout", "masks"), [
    (True, True, True, True, 0.0, False),
    (False, True, True, False, 0.0, True),
    (True, True, False, False, 0.3, True),
    (False, True, True, True, 0.3, True),
    (True, False, True, False, 0.0, True),
    (True, False, False, True, 0.25, False),
])
def test_self_attention_factors_are_the_explicit_products(
    batch_first: bool, batched: bool, bias: bool, need_weights: bool, dropout: float,
    masks: bool,
) -> None:
    torch.manual_seed(0)
    model = _Attend(nn.MultiheadAttention(E, H, dropout=dropout, bias=bias,
                                          batch_first=batch_first))
    x = _inputs(batch_first, batched, src=L)
    kwargs: dict[str, object] = {"need_weights": need_weights}
    if masks:
        kwargs["attn_mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)
        pad = torch.zeros(N, L, dtype=torch.bool)
        pad[0, -2:] = True
        kwargs["key_padding_mask"] = pad if batched else pad[0]
    pre = _step(model, (x, x, x), kwargs)
    assert list(pre.layers) == ["attn.in_proj", "attn.out_proj"]
    assert all(isinstance(b, AttentionBlock) for b in pre.layers.values())
    rec = _explicit(model, (x, x, x), kwargs)
    a, g = _factors(pre, "attn.in_proj")
    d = torch.cat([rec.grad("q"), rec.grad("k"), rec.grad("v")], dim=-1)  # [q | k | v]
    assert g.shape == (3 * E, 3 * E)
    torch.testing.assert_close(a, _a(rec.inputs["q"], bias), **TIGHT)
    torch.testing.assert_close(g, _g(d), **TIGHT)
    a, g = _factors(pre, "attn.out_proj")
    torch.testing.assert_close(a, _a(rec.inputs["out"], bias), **TIGHT)
    torch.testing.assert_close(g, _g(rec.grad("out")), **TIGHT)


@pytest.mark.parametrize("batch_first", [True, False])
def test_reduce_puts_rows_back_to_examples_with_the_batch_dimension_mha_uses(
    batch_first: bool,
) -> None:
    torch.manual_seed(1)
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=batch_first))
    x = _inputs(batch_first, src=L)
    kwargs: dict[str, object] = {"need_weights": False}
    pre = _step(model, (x, x, x), kwargs, kfac_approx="reduce")
    rec = _explicit(model, (x, x, x), kwargs)
    seq = rec.inputs["q"]  # (L, N, E): the example is dim 1
    d = torch.cat([rec.grad("q"), rec.grad("k"), rec.grad("v")], dim=-1)
    a, g = _factors(pre, "attn.in_proj")
    torch.testing.assert_close(a, _a_reduce(seq, True), **TIGHT)
    torch.testing.assert_close(g, _g_reduce(d), **TIGHT)
    a, g = _factors(pre, "attn.out_proj")  # rows l*N + n
    torch.testing.assert_close(a, _a_reduce(rec.inputs["out"].view(L, N, E), True), **TIGHT)
    torch.testing.assert_close(g, _g_reduce(rec.grad("out").view(L, N, E)), **TIGHT)
    assert not torch.allclose(a, _a(rec.inputs["out"], True))  # reduce differs from expand


# ---------------------------------------------------------------------- cross-attention
@pytest.mark.parametrize("kv_same", [True, False])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_cross_attention_gives_three_row_blocks_from_their_own_products(
    kv_same: bool, approx: str
) -> None:
    torch.manual_seed(2)
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=True))
    x, mem = _inputs(True, src=L), _inputs(True, src=S)
    value = mem if kv_same else mem.flip(1) * 0.5
    kwargs: dict[str, object] = {"need_weights": False}
    pre = _step(model, (x, mem, value), kwargs, cross_attention="attn", kfac_approx=approx)
    assert list(pre.layers) == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]
    rec = _explicit(model, (x, mem, value), kwargs)
    a_of, g_of = (_a, _g) if approx == "expand" else (_a_reduce, _g_reduce)
    for name, key in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        a, g = _factors(pre, f"attn.{name}")
        assert g.shape == (E, E)
        torch.testing.assert_close(a, a_of(rec.inputs[key], True), **TIGHT)
        torch.testing.assert_close(g, g_of(rec.grad(key)), **TIGHT)


def test_separate_projection_weights_give_three_blocks_with_their_bias_rows() -> None:
    torch.manual_seed(3)
    model = _Attend(nn.MultiheadAttention(E, H, kdim=5, vdim=6))
    x, key, value = _inputs(False, src=L), _inputs(False, dim=5), _inputs(False, dim=6)
    pre = _step(model, (x, key, value), {})
    assert list(pre.layers) == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]
    assert pre.layers["attn.k_proj"].dims == (6, E) and pre.layers["attn.v_proj"].dims == (7, E)
    rec = _explicit(model, (x, key, value), {})
    for name, k in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        a, g = _factors(pre, f"attn.{name}")
        torch.testing.assert_close(a, _a(rec.inputs[k], True), **TIGHT)
        torch.testing.assert_close(g, _g(rec.grad(k)), **TIGHT)


def test_self_attention_called_as_cross_attention_records_nothing_and_warns_once() -> None:
    torch.manual_seed(4)
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=True))
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",))
    x, mem = _inputs(True, src=L), _inputs(True, src=S)
    model(x, x, x).sum().backward()  # the first call decides: self-attention
    pre.step()
    a_before = pre.layers["attn.in_proj"].a
    assert a_before is not None
    a_before = a_before.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(x, mem, mem).sum().backward()
            pre.step()
    mismatch = [w for w in caught if "has the self-attention layout" in str(w.message)]
    assert len(mismatch) == 1
    assert "cross_attention=['^attn$']" in str(mismatch[0].message)
    assert list(pre.layers) == ["attn.in_proj", "attn.out_proj"]
    assert torch.equal(pre.layers["attn.in_proj"].a, a_before)  # nothing recorded since
    # a self-attention call of a cross-attention layout is exact: the same rows, same X
    cross = _Attend(copy.deepcopy(model.attn))
    pre = _step(cross, (x, x, x), {}, cross_attention=["attn"])
    rec = _explicit(cross, (x, x, x), {})
    for name, key in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        a, g = _factors(pre, f"attn.{name}")
        torch.testing.assert_close(a, _a(rec.inputs[key], True), **TIGHT)
        torch.testing.assert_close(g, _g(rec.grad(key)), **TIGHT)


class _SelfThenCross(nn.Module):
    """A self-attention MHA, then one attending from its output to a memory."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.cross = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(x, x, x, need_weights=False)[0] + x
        return self.cross(h, mem, mem, need_weights=False)[0]  # type: ignore[no-any-return]


def _self_then_cross_run(make: Callable[[nn.Module], kaisa.EKFAC | kaisa.KFACPreconditioner],
                         steps: int = 3) -> tuple[nn.Module, object]:
    torch.manual_seed(12)
    model = _SelfThenCross().double()
    product = make(model)
    x, mem = _inputs(True, src=L).double(), _inputs(True, src=S).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model.zero_grad()
        model(x, mem).square().sum().backward()
        if isinstance(product, kaisa.KFACPreconditioner):
            product.step()
            sgd.step()
        else:
            product.step()
    return model, product


@pytest.mark.parametrize("product", ["preconditioner", "ekfac"])
def test_cross_attention_is_detected_at_the_first_call_exactly_as_declared(product: str) -> None:
    def make(patterns: list[str] | None) -> Callable[[nn.Module],
                                                     kaisa.EKFAC | kaisa.KFACPreconditioner]:
        def build(model: nn.Module) -> kaisa.EKFAC | kaisa.KFACPreconditioner:
            if product == "ekfac":
                return kaisa.EKFAC(model, lr=1e-2, cross_attention=patterns)
            return kaisa.KFACPreconditioner(model, layer_kinds=("attention",), damping=0.01,
                                            cross_attention=patterns)
        return build

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning: the call decides the layout
        detected, auto = _self_then_cross_run(make(None))
    declared, flagged = _self_then_cross_run(make(["^cross$"]))
    names = ["self_attn.in_proj", "self_attn.out_proj", "cross.q_proj", "cross.k_proj",
             "cross.v_proj", "cross.out_proj"]
    blocks = (auto.layers if isinstance(auto, kaisa.KFACPreconditioner)
              else auto.curvature.blocks)  # type: ignore[attr-defined]
    want = (flagged.layers if isinstance(flagged, kaisa.KFACPreconditioner)
            else flagged.curvature.blocks)  # type: ignore[attr-defined]
    assert [n for n in blocks if "proj" in n] == names == [n for n in want if "proj" in n]
    for name in names:
        assert torch.equal(blocks[name].a, want[name].a), name
        assert torch.equal(blocks[name].g, want[name].g), name
    for (n, p), q in zip(detected.named_parameters(), declared.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_cross_attention_patterns_override_the_detection() -> None:
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=True))
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",), cross_attention=[])
    x, mem = _inputs(True, src=L), _inputs(True, src=S)
    with pytest.warns(RuntimeWarning, match="has the self-attention layout"):
        model(x, mem, mem).sum().backward()
    pre.step()
    assert list(pre.layers) == ["attn.in_proj", "attn.out_proj"]
    assert pre.layers["attn.in_proj"].a is None


# ---------------------------------------------------------------------- preconditioning
@pytest.mark.parametrize("layout", ["self", "cross", "separate"])
def test_preconditioned_gradients_are_the_explicit_solves_rows_and_biases_included(
    layout: str,
) -> None:
    torch.manual_seed(5)
    kdim = 5 if layout == "separate" else None
    model = _Attend(nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim))
    x = _inputs(False, src=L)
    mem = _inputs(False, dim=kdim or E)
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",), kl_clip=None,
                                   damping=0.01, inv_dtype=torch.float64,
                                   cross_attention="attn" if layout == "cross" else None)
    for _ in range(2):  # the second step preconditions with the first step's factors folded
        for p in model.parameters():
            p.grad = None
        args = (x, x, x) if layout == "self" else (x, mem, mem)
        model(*args).sin().sum().backward()
        raw = {name: p.grad.clone() for name, p in model.named_parameters()
               if p.grad is not None}
        pre.step()
    mha = model.attn
    got = {name: p.grad for name, p in model.named_parameters()}

    def check(block: str, weight: str, bias: str, rows: slice, wrows: slice) -> None:
        a, g = _factors(pre, f"attn.{block}")
        grad = torch.cat([raw[weight][wrows], raw[bias][rows, None]], dim=1)
        want = kron_solve(g, a, grad, 0.01)
        torch.testing.assert_close(got[weight][wrows], want[:, :-1], **TIGHT)
        torch.testing.assert_close(got[bias][rows], want[:, -1], **TIGHT)

    every = slice(None)
    if layout == "self":
        check("in_proj", "attn.in_proj_weight", "attn.in_proj_bias", every, every)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        rows = slice(i * E, (i + 1) * E)
        if layout == "cross":
            check(name, "attn.in_proj_weight", "attn.in_proj_bias", rows, rows)
        elif layout == "separate":
            check(name, f"attn.{name}_weight", "attn.in_proj_bias", rows, every)
    check("out_proj", "attn.out_proj.weight", "attn.out_proj.bias", every, every)
    assert mha.in_proj_bias is not None


def test_kfac_direction_assembles_row_blocks_of_a_shared_parameter() -> None:
    torch.manual_seed(6)
    model = _Attend(nn.MultiheadAttention(E, H, kdim=5, vdim=5))
    x, mem = _inputs(False, src=L), _inputs(False, dim=5)
    opt = kaisa.KFAC(model, loss="mse", lr=0.1, momentum=0.0, curvature="empirical",
                     damping=0.01, kl_clip=None, inv_dtype=torch.float64, factor_decay=0.5)
    assert opt.coverage()["attn.in_proj_bias"] == "attention"
    target = torch.zeros(L, N, E)
    opt.step(lambda: (model(x, mem, mem), target))
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = None
    F.mse_loss(model(x, mem, mem), target).backward()
    raw, directions = opt._direction(params)
    names = [n for n, _ in model.named_parameters()]
    got = dict(zip(names, directions, strict=True))
    grads = dict(zip(names, raw, strict=True))
    bias = got["attn.in_proj_bias"]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        rows = slice(i * E, (i + 1) * E)
        block = opt.curvature.blocks[f"attn.{name}"]
        a, g = block.a_factor, block.g_factor
        assert a is not None and g is not None
        grad = torch.cat([grads[f"attn.{name}_weight"], grads["attn.in_proj_bias"][rows, None]],
                         dim=1)
        want = kron_solve(g, a, grad, opt.damping)
        torch.testing.assert_close(got[f"attn.{name}_weight"], want[:, :-1], **TIGHT)
        torch.testing.assert_close(bias[rows], want[:, -1], **TIGHT)
    assert not torch.equal(grads["attn.in_proj_bias"], bias)  # the raw gradient is untouched
    assert torch.equal(grads["attn.in_proj_bias"], model.attn.in_proj_bias.grad)


# ---------------------------------------------------------------------- transformer layers
class _Tiny(nn.Module):
    """Embedding, encoder and decoder layers with masks, a linear head."""

    def __init__(self, norm_first: bool, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, E)
        self.encoder = nn.TransformerEncoderLayer(E, H, 16, dropout=dropout, batch_first=True,
                                                  norm_first=norm_first)
        self.decoder = nn.TransformerDecoderLayer(E, H, 16, dropout=dropout, batch_first=True,
                                                  norm_first=norm_first)
        self.head = nn.Linear(E, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        pad = tokens == 0
        h = self.embed(tokens)
        memory = self.encoder(h, src_mask=causal, src_key_padding_mask=pad, is_causal=True)
        out = self.decoder(h, memory, tgt_mask=causal, tgt_is_causal=True,
                           memory_key_padding_mask=pad)
        return self.head(out)  # type: ignore[no-any-return]


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 11, (4, 6), generator=g)
    tokens[0, -1] = 0
    return tokens, torch.randint(0, 11, (4, 6), generator=g)


PROJECTIONS = [
    "encoder.self_attn.in_proj", "encoder.self_attn.out_proj", "encoder.linear1",
    "encoder.linear2", "decoder.self_attn.in_proj", "decoder.self_attn.out_proj",
    "decoder.multihead_attn.q_proj", "decoder.multihead_attn.k_proj",
    "decoder.multihead_attn.v_proj", "decoder.multihead_attn.out_proj", "decoder.linear1",
    "decoder.linear2", "head",
]


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_layers_register_and_record_every_projection(norm_first: bool) -> None:
    torch.manual_seed(8)
    model = _Tiny(norm_first)
    opt = kaisa.KFAC(model, loss="cross_entropy", lr=0.05, momentum=0.9, curvature="empirical",
                     kl_clip=0.01)
    assert list(opt.curvature.blocks) == PROJECTIONS
    first = {n for n, kind in opt.coverage().items() if kind == "first-order"}
    assert first == {"embed.weight"} | {f"{layer}.norm{i}.{p}" for layer, count in
                                        (("encoder", 2), ("decoder", 3))
                                        for i in range(1, count + 1) for p in ("weight", "bias")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            tokens, targets = _tokens(step)
            opt.zero_grad()
            F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            opt.step()
    assert not [w for w in caught if "kaisa" in str(w.message)]
    for name, block in opt.curvature.blocks.items():
        assert block.a is not None and block.g is not None and block.has_decomposition(), name
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_reference_kinds_leave_every_attention_parameter_first_order() -> None:
    torch.manual_seed(9)
    model = _Tiny(norm_first=False)
    pre = kaisa.KFACPreconditioner(model)  # kfac-pytorch's linear and conv2d
    assert list(pre.layers) == ["encoder.linear1", "encoder.linear2", "decoder.linear1",
                                "decoder.linear2", "head"]
    attention = {n: k for n, k in pre.coverage().items() if "attn" in n}
    assert attention and set(attention.values()) == {"first-order"}
    assert "encoder.self_attn.out_proj.weight" in attention
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            tokens, targets = _tokens(step)
            sgd.zero_grad()
            F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            raw = model.decoder.multihead_attn.out_proj.weight.grad.clone()
            pre.step()
            assert torch.equal(raw, model.decoder.multihead_attn.out_proj.weight.grad)
            sgd.step()
    assert not [w for w in caught if "did not fire" in str(w.message)]


def test_preconditioner_and_sgd_train_a_small_transformer_without_nan() -> None:
    torch.manual_seed(10)
    model = _Tiny(norm_first=True)
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", damping=0.01)
    assert "encoder.self_attn.bias_k" not in pre.coverage()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens, targets = _tokens(0)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        model.train()
        return float(loss)

    before = evaluate()
    for _ in range(6):
        sgd.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        pre.step()
        sgd.step()
        assert math.isfinite(float(loss.detach()))
    assert evaluate() < before
    assert set(pre.coverage().values()) == {"linear", "attention", "scale_shift", "embedding"}


def test_bias_kv_is_first_order_and_add_zero_attn_changes_nothing() -> None:
    torch.manual_seed(12)
    model = _Attend(nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True))
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",))
    assert pre.coverage()["attn.bias_k"] == "first-order"
    assert pre.coverage()["attn.bias_v"] == "first-order"
    x = _inputs(False, src=L)
    model(x, x, x).sum().backward()
    pre.step()
    assert all(b.a is not None and b.g is not None for b in pre.layers.values())


def test_adaptive_kfac_with_forward_jvp_trains_an_encoder_layer() -> None:
    torch.manual_seed(13)
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 16, dropout=0.1, batch_first=True),
                          nn.Linear(E, 3))
    opt = kaisa.KFAC(model, loss="cross_entropy", jvp="forward", compute_method="eigen")
    assert "0.self_attn.in_proj" in opt.curvature.blocks
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, E, generator=g), torch.randint(0, 3, (4, 5), generator=g)
    for _ in range(3):
        loss = opt.step(lambda: (model(x), y))
        assert loss is not None and math.isfinite(float(loss))
        assert math.isfinite(opt.last["lr"])
    for name, block in opt.curvature.blocks.items():
        assert block.a is not None and block.g is not None, name
    assert torch._C._len_torch_function_stack() == 0


# ---------------------------------------------------------------------- the forward itself
class _Ops(TorchDispatchMode):
    """The names of the aten operators a region runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("dtype", "dropout"), [(torch.float32, 0.0), (torch.float64, 0.2)])
def test_forward_and_attention_kernel_are_those_of_the_model_without_kaisa(
    dtype: torch.dtype, dropout: float
) -> None:
    torch.manual_seed(14)
    model = _Tiny(norm_first=True, dropout=dropout).to(dtype)
    plain = copy.deepcopy(model)
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all")
    assert pre.layers["decoder.multihead_attn.k_proj"] is not None
    tokens, _ = _tokens(0)
    with _Ops() as ops_kaisa:
        torch.manual_seed(1)
        out = model(tokens)
    with _Ops() as ops_plain:
        torch.manual_seed(1)
        want = plain(tokens)
    assert torch.equal(out, want)
    attention = [n for n in ops_plain.names if "attention" in n or "softmax" in n]
    assert attention == [n for n in ops_kaisa.names if "attention" in n or "softmax" in n]
    fused = [n for n in attention if "flash" in n]  # CPU's fused kernel, without dropout
    assert len(fused) == (3 if dropout == 0 else 0)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    pre.step()
    assert all(block.g is not None for block in pre.layers.values())


def test_a_forward_that_raises_leaves_nothing_installed() -> None:
    torch.manual_seed(15)
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=True))
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",), factor_update_steps=2)
    x = _inputs(True, src=L)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError, match="attn_mask"):  # raised after the in-projection
        model(x, x, x, attn_mask=torch.zeros(L + 1, L))
    assert torch._C._len_torch_function_stack() == depth
    pre.discard_step()  # what the in-projection recorded before the error
    seen: list[int] = []  # the stack inside MHA's forward (after kaisa's pre-hook)
    model.attn.register_forward_pre_hook(
        lambda *_: seen.append(torch._C._len_torch_function_stack()))
    model(x, x, x).sum().backward()  # the next forward records as usual
    pre.step()
    assert pre.layers["attn.in_proj"].a is not None
    model(x, x, x).sum().backward()  # step 1: not a factor-update step
    pre.step()
    model.eval()
    model(x, x, x)
    model.train()
    with torch.no_grad():
        model(x, x, x)
    model(x, x, x)  # step 2 records
    assert seen == [depth + 1, depth, depth, depth, depth + 1]
    assert torch._C._len_torch_function_stack() == depth


def test_mha_fast_path_in_eval_is_untouched() -> None:
    torch.manual_seed(16)
    model = _Attend(nn.MultiheadAttention(E, H, batch_first=True)).eval()
    plain = copy.deepcopy(model)
    kaisa.KFACPreconditioner(model, layer_kinds=("attention",))
    x = _inputs(True, src=L)
    with torch.no_grad(), _Ops() as ops_kaisa:
        out = model(x, x, x)
    with torch.no_grad(), _Ops() as ops_plain:
        want = plain(x, x, x)
    assert torch.equal(out, want) and ops_kaisa.names == ops_plain.names
    assert any("native_multi_head_attention" in n for n in ops_plain.names)


def test_cross_attention_setting_is_validated_and_accepted_by_both_products() -> None:
    with pytest.raises(ValueError, match="cross_attention must be a str or a list of str"):
        kaisa.KFACPreconditioner(nn.Linear(2, 2), cross_attention=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cross_attention has an invalid regular expression"):
        kaisa.KFACPreconditioner(nn.Linear(2, 2), cross_attention="(")
    model = _Tiny(norm_first=False)
    opt = kaisa.KFAC(model, loss="cross_entropy", cross_attention=[])  # every MHA self
    assert "decoder.multihead_attn.in_proj" in opt.curvature.blocks
    assert re.search("q_proj", " ".join(opt.curvature.blocks)) is None
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", cross_attention=r"self_attn$")
    assert "encoder.self_attn.q_proj" in pre.layers
    assert "decoder.multihead_attn.in_proj" in pre.layers
    skipped = kaisa.KFACPreconditioner(model, layer_kinds="all", skip_layers=["k_proj"],
                                       cross_attention=r"self_attn$")
    assert not any("encoder.self_attn.q_proj" in n for n in skipped.layers)  # shared weight
    assert skipped.coverage()["encoder.self_attn.in_proj_weight"] == "first-order"



# ---------------------------------------------------------------------- several ranks
class _Pair(nn.Module):
    """A self-attention and a cross-attention MHA (the cross one with separate k/v dims)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.cross = nn.MultiheadAttention(E, H, batch_first=True)
        self.side = nn.MultiheadAttention(E, H, kdim=5, vdim=5, batch_first=True)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, extra: torch.Tensor
                ) -> torch.Tensor:
        h = x + self.self_attn(x, x, x, need_weights=False)[0]
        h = h + self.cross(h, mem, mem)[0]
        return h + self.side(h, extra, extra)[0]


def _pair_data(world: int, step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + step)
    n = 2 * world
    return (torch.randn(n, L, E, generator=g), torch.randn(n, S, E, generator=g),
            torch.randn(n, S, 5, generator=g), torch.randn(n, L, E, generator=g))


def _pair_train(world: int, rank: int | None, strategy: str) -> list[torch.Tensor]:
    """Three steps; ``rank=None``: one process on the global batch (loss and grads scaled)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _Pair().double()
    pre = kaisa.KFACPreconditioner(model, layer_kinds=("attention",), cross_attention="cross",
                                   grad_worker_fraction=strategy, inv_dtype=torch.float64,
                                   factor_decay=0.9, damping=0.01, kl_clip=0.05, lr=0.1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        batch = [t.double() for t in _pair_data(world, step)]
        if rank is not None:
            batch = [t[2 * rank: 2 * rank + 2] for t in batch]
        x, mem, extra, y = batch
        sgd.zero_grad()
        loss = F.mse_loss(model(x, mem, extra), y)
        (loss * (world if rank is None else 1)).backward()
        for p in model.parameters():
            assert p.grad is not None
            if rank is None:
                p.grad /= world
            else:
                dist.all_reduce(p.grad)
                p.grad /= world
        pre.step()
        sgd.step()
    assert len(pre.layers) == 10 and all(b.a is not None for b in pre.layers.values())
    return [p.detach().clone() for p in model.parameters()]


def _pair_job(rank: int, world: int, strategy: str) -> list[torch.Tensor]:
    torch.set_default_dtype(torch.float64)
    return _pair_train(world, rank, strategy)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["comm_opt", "mem_opt"])
def test_attention_blocks_on_two_ranks_equal_one_process(strategy: str) -> None:
    from tests.support.dist import run_distributed

    results = run_distributed(_pair_job, 2, strategy, timeout=170)
    ref = _pair_train(2, None, strategy)
    for params in results:
        for p, q in zip(params, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10)
