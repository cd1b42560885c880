"""Linear layers stored transposed (Hugging Face's ``Conv1D``): the ``nn.Linear`` block of
the transposed weight in every product, float64 to 1e-12; HF GPT-2 preconditioned."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import TransposedLinearBlock, register_blocks
from tests.ekfac.test_grouped_ekfac import _per_block

pytestmark = pytest.mark.usefixtures("float64")


class Conv1D(nn.Module):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``, as that library defines it."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 7, 5, generator=g), torch.randint(0, 3, (4, 7), generator=g)


def _loss(net: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return F.cross_entropy(net(x).reshape(-1, 3), y.reshape(-1))


class _Both(nn.Module):
    """Conv1D projections that are called (both with a bias)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up: nn.Module = Conv1D(6, 5) if transposed else nn.Linear(5, 6)
        self.down: nn.Module = Conv1D(3, 6) if transposed else nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _both() -> tuple[_Both, _Both]:
    conv, lin = _Both(True), _Both(False)
    with torch.no_grad():
        for name in ("up", "down"):
            getattr(lin, name).weight.copy_(getattr(conv, name).weight.t())
            getattr(lin, name).bias.copy_(getattr(conv, name).bias)
    return conv, lin


def test_a_conv1d_is_recognised_by_its_class_and_attributes() -> None:
    blocks = register_blocks(_Both(True))
    assert set(blocks) == {"up", "down"}
    assert all(isinstance(b, TransposedLinearBlock) and b.kind == "linear"
               for b in blocks.values())
    assert blocks["up"].dims == (6, 6)  # 5 inputs + the bias column, 6 outputs

    class Conv1DLookalike(nn.Module):  # named Conv1D's way but another layout: not a block
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 3))
            self.nf = 4

    assert not TransposedLinearBlock.matches(Conv1DLookalike())
    Conv1DLookalike.__name__ = "Conv1D"
    assert not TransposedLinearBlock.matches(Conv1DLookalike())  # nf is not its columns

    class Sub(Conv1D):  # a subclass is one too
        pass

    assert TransposedLinearBlock.matches(Sub(4, 3))


def _same(conv: nn.Module, lin: nn.Module, tol: float = 1e-12) -> None:
    for name in ("up", "down"):
        c, m = getattr(conv, name), getattr(lin, name)
        assert torch.allclose(c.weight.t(), m.weight, rtol=0, atol=tol), name
        assert torch.allclose(c.bias, m.bias, rtol=0, atol=tol), name


def test_preconditioner_factors_and_gradients_equal_the_transposed_linear() -> None:
    conv, lin = _both()
    kw: dict[str, Any] = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01,
                              lr=0.1, inv_dtype=torch.float64)
    pc, pl = kaisa.KFACPreconditioner(conv, **kw), kaisa.KFACPreconditioner(lin, **kw)
    for step in range(3):
        for net, pre in ((conv, pc), (lin, pl)):
            net.zero_grad()
            _loss(net, step).backward()
            pre.step()
        for name in ("up", "down"):
            bc, bl = pc.curvature.blocks[name], pl.curvature.blocks[name]
            assert torch.allclose(bc.a, bl.a, rtol=0, atol=1e-12)
            assert torch.allclose(bc.g, bl.g, rtol=0, atol=1e-12)
            c, m = getattr(conv, name), getattr(lin, name)
            assert torch.allclose(c.weight.grad.t(), m.weight.grad, rtol=0, atol=1e-12)
            assert torch.allclose(c.bias.grad, m.bias.grad, rtol=0, atol=1e-12)
        with torch.no_grad():
            for net in (conv, lin):
                for p in net.parameters():
                    p -= 0.1 * p.grad


def _run(make: Callable[[nn.Module], Any], closure: bool = False) -> None:
    conv, lin = _both()
    oc, ol = make(conv), make(lin)
    for step in range(4):
        for net, opt in ((conv, oc), (lin, ol)):
            if closure:
                x, y = _batch(step)
                opt.step(lambda net=net, x=x, y=y: (net(x).reshape(-1, 3), y.reshape(-1)))
            else:
                opt.zero_grad()
                _loss(net, step).backward()
                opt.step()
        _same(conv, lin)


def test_kfac_ekfac_and_kfac_muon_step_as_on_the_transposed_linear() -> None:
    _run(lambda m: kaisa.KFAC(m, loss="cross_entropy", inv_dtype=torch.float64),
         closure=True)
    _run(lambda m: kaisa.EKFAC(m, lr=0.01, basis_update_steps=2, basis_refresh="eigh"))
    for curvature in ("input", "eigen"):
        _run(lambda m, c=curvature: kaisa.KFACMuon(m, lr=0.02, curvature=c, refresh_steps=2,
                                                   ns_dtype=torch.float64))


def test_grouped_step_equals_one_block_at_a_time() -> None:
    """Conv1D blocks of one shape stack into one group (their transposes' views): the
    per-block path's step, and the same groups as the ``nn.Linear`` twins."""
    conv, _ = _both()
    conv.side = Conv1D(6, 5)  # type: ignore[assignment]  # up's shape again: a group of two
    per_block = copy.deepcopy(conv)
    grouped_opt = kaisa.EKFAC(conv, lr=0.01, basis_update_steps=1, basis_refresh="eigh")
    single_opt = kaisa.EKFAC(per_block, lr=0.01, basis_update_steps=1, basis_refresh="eigh")
    _per_block(single_opt)
    for step in range(3):
        for net, opt in ((conv, grouped_opt), (per_block, single_opt)):
            opt.zero_grad()
            x, y = _batch(step)
            out = net.down(torch.tanh(net.up(x)) + torch.tanh(net.side(x)))
            F.cross_entropy(out.reshape(-1, 3), y.reshape(-1)).backward()
            opt.step()
    for a, b in zip(conv.parameters(), per_block.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    groups = grouped_opt.curvature._groups
    sizes = sorted(len(g.blocks) for layout in groups.values() for g in layout)
    assert sizes == [1, 2], sizes


def _share(model: nn.Module, opt: Any) -> float:
    cov = opt.coverage()
    sizes = dict(model.named_parameters())
    done = sum(sizes[n].numel() for n, kind in cov.items() if kind != "first-order")
    return done / sum(p.numel() for p in model.parameters())


def test_hf_gpt2_is_preconditioned() -> None:
    """HF GPT-2 (2 layers of width 64): >= 99% of the elements in EKFAC and in
    KFACPreconditioner("all"), 100% of the projections with the default kinds."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96,
                                         n_positions=32, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double()
    projections = {f"{name}.{p}" for name, m in model.named_modules()
                   if type(m).__name__ == "Conv1D" for p in ("weight", "bias")}
    assert len(projections) == 2 * 4 * 2
    x = torch.randint(0, 96, (3, 16))
    for make, share in ((lambda m: kaisa.EKFAC(m, lr=1e-3), 0.99),
                        (lambda m: kaisa.KFACPreconditioner(m, layer_kinds="all"), 1.0),
                        (lambda m: kaisa.KFACPreconditioner(m), 0.0)):
        net = copy.deepcopy(model)
        opt = make(net)
        for _ in range(2):
            net.zero_grad()
            net(x, labels=x).loss.backward()
            opt.step()
        assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
        coverage = opt.coverage()
        assert all(coverage[name] == "linear" for name in projections), coverage
        assert _share(net, opt) >= share, (_share(net, opt), coverage)
