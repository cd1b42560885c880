"""Mixture-of-experts layers (Hugging Face's Mixtral): one Linear block per expert, and the
router, with the factors of separate ``nn.Linear`` experts fed the same routed tokens
(float64, 1e-12), through both of HF's expert paths (a loop of ``F.linear``, and one
grouped product); an expert that saw no tokens keeps its factors."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import kaisa
from kaisa.blocks import ExpertBlock, RouterBlock

pytestmark = pytest.mark.usefixtures("float64")
transformers = pytest.importorskip("transformers")

H, INNER, E, K = 8, 4, 4, 2  # hidden, intermediate, experts, experts per token


def _hf_moe(implementation: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=INNER,
                                        num_local_experts=E, num_experts_per_tok=K,
                                        vocab_size=8, num_attention_heads=2,
                                        num_key_value_heads=1, num_hidden_layers=1)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block.to(dtype)


class _Reference(nn.Module):
    """The same MoE with a separate ``nn.Linear`` per expert matrix and for the router."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up = nn.ModuleList(nn.Linear(H, 2 * INNER, bias=False) for _ in range(E))
        self.down = nn.ModuleList(nn.Linear(INNER, H, bias=False) for _ in range(E))
        self.act = hf.experts.act_fn
        with torch.no_grad():
            self.gate.weight.copy_(hf.gate.weight)
            for e in range(E):
                self.gate_up[e].weight.copy_(hf.experts.gate_up_proj[e])
                self.down[e].weight.copy_(hf.experts.down_proj[e])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, H)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, index = torch.topk(probs, K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tokens, slot = torch.where(index == e)
            if len(tokens) == 0:
                continue
            gate, up = self.gate_up[e](x[tokens]).chunk(2, dim=-1)
            y = self.down[e](self.act(gate) * up) * top[tokens, slot, None]
            out = out.index_add(0, tokens, y)
        return out.reshape(h.shape)


def _inputs(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(3, 5, H, generator=g).to(dtype),
            torch.randn(3, 5, H, generator=g).to(dtype))


def _steps(model: nn.Module, pre: Any, steps: int) -> None:
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        h, r = _inputs(step, dtype)
        model.zero_grad()
        (model(h) * r).sum().backward()
        pre.step()


def _never_route_to(expert: int) -> Any:
    """A forward hook for HF's router: the top experts chosen without ``expert``."""
    def hook(module: nn.Module, args: Any, out: tuple[torch.Tensor, ...]) -> Any:
        logits = out[0]
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs.index_fill(1, torch.tensor([expert]), -1.0), K, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index

    return hook


@pytest.mark.parametrize(("implementation", "tol"), [("eager", 1e-12), ("grouped_mm", 1e-5)])
def test_each_expert_has_the_factors_of_a_separate_linear_fed_its_tokens(
    implementation: str, tol: float,
) -> None:
    """The grouped product has no float64 kernel: float32 there, to float32's rounding."""
    dtype = torch.float64 if implementation == "eager" else torch.float32
    hf = _hf_moe(implementation, dtype)
    ref = _Reference(hf).to(dtype)
    kw: dict[str, Any] = dict(factor_update_steps=1, inv_update_steps=1, damping=0.01,
                              inv_dtype=torch.float64)
    pre_hf, pre_ref = kaisa.KFACPreconditioner(hf, **kw), kaisa.KFACPreconditioner(ref, **kw)
    blocks = pre_hf.curvature.blocks
    assert isinstance(blocks["gate"], RouterBlock)
    assert sorted(n for n, b in blocks.items() if isinstance(b, ExpertBlock)) == sorted(
        f"experts.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in range(E))
    assert set(pre_hf.coverage().values()) == {"linear"}  # every parameter preconditioned
    _steps(hf, pre_hf, 2)
    _steps(ref, pre_ref, 2)
    pairs = {"gate": "gate", **{f"experts.gate_up_proj.{e}": f"gate_up.{e}" for e in range(E)},
             **{f"experts.down_proj.{e}": f"down.{e}" for e in range(E)}}
    for ours, theirs in pairs.items():
        a, b = pre_hf.layers[ours], pre_ref.layers[theirs]
        torch.testing.assert_close(a.a, b.a, rtol=tol, atol=tol, msg=ours)
        torch.testing.assert_close(a.g, b.g, rtol=tol, atol=tol, msg=ours)
    # the preconditioned gradients too: each expert's slice of the 3-D parameter's grad
    for e in range(E):
        torch.testing.assert_close(hf.experts.gate_up_proj.grad[e], ref.gate_up[e].weight.grad,
                                   rtol=100 * tol, atol=tol)
        torch.testing.assert_close(hf.experts.down_proj.grad[e], ref.down[e].weight.grad,
                                   rtol=100 * tol, atol=tol)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_an_expert_without_tokens_keeps_its_factors(implementation: str) -> None:
    hf = _hf_moe(implementation, torch.float64 if implementation == "eager" else torch.float32)
    pre = kaisa.KFACPreconditioner(hf, factor_update_steps=1, inv_update_steps=1)
    _steps(hf, pre, 1)
    before = {name: block.a.clone() for name, block in pre.layers.items()}
    handle = hf.gate.register_forward_hook(_never_route_to(2))
    _steps(hf, pre, 3)
    handle.remove()
    for name, block in pre.layers.items():
        kept = torch.equal(block.a, before[name])
        assert kept == name.endswith(".2"), name  # expert 2's factors alone are as they were
    assert all(bool(torch.isfinite(p).all()) for p in hf.parameters())


def test_hf_mixtral_is_preconditioned() -> None:
    """A tiny HF Mixtral: >= 95% of the elements under EKFAC, 100% with "all"."""
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()  # grouped: no fp64
    x = torch.randint(0, 96, (2, 12))
    for make, share in ((lambda m: kaisa.EKFAC(m, lr=1e-3), 0.95),
                        (lambda m: kaisa.KFACPreconditioner(m, layer_kinds="all"), 1.0)):
        net = copy.deepcopy(model)
        opt = make(net)
        for _ in range(2):
            net.zero_grad()
            net(input_ids=x, labels=x).loss.backward()
            opt.step()
        coverage, sizes = opt.coverage(), dict(net.named_parameters())
        covered = sum(sizes[n].numel() for n, kind in coverage.items() if kind != "first-order")
        assert covered / sum(p.numel() for p in net.parameters()) >= share, coverage
        assert all(bool(torch.isfinite(p).all()) for p in net.parameters())


def _rank_coverage(rank: int, world: int) -> dict[str, str]:
    torch.set_default_dtype(torch.float64)
    hf = _hf_moe("eager")
    with pytest.warns(RuntimeWarning, match="rank average is not defined yet"):
        pre = kaisa.KFACPreconditioner(hf, factor_update_steps=1, inv_update_steps=1)
    _steps(hf, pre, 2)
    return pre.coverage()


@pytest.mark.distributed
def test_experts_are_first_order_with_several_ranks_and_nothing_hangs() -> None:
    from tests.support.dist import run_distributed

    for coverage in run_distributed(_rank_coverage, 2, timeout=120):
        assert coverage["gate.weight"] == "linear"
        assert coverage["experts.gate_up_proj"] == coverage["experts.down_proj"] == "first-order"


def test_kfac_muon_counts_an_expert_parameters_steps_once() -> None:
    """KFACMuon's eigen mode: the experts of one 3-D parameter share its Adam step count,
    which advances once a step (not once per expert)."""
    hf = _hf_moe("eager")
    opt = kaisa.KFACMuon(hf, lr=0.02, curvature="eigen", ns_dtype=torch.float64)
    for step in range(3):
        h, r = _inputs(step, torch.float64)
        opt.zero_grad()
        (hf(h) * r).sum().backward()
        opt.step()
    assert float(opt.state[hf.experts.gate_up_proj]["step"]) == 3.0
    assert float(opt.state[hf.gate.weight]["step"]) == 3.0
