"""The models users bring: Hugging Face's RMS norms and classes declared like a known layer.

Float64 against the explicit per-element Fisher of a norm's weight (the per-row gradient
contributions written from the norm's formula), and declared linear layers against
``nn.Linear``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import declared as declared_module
from kaisa.blocks import register_blocks
from kaisa.blocks.declared import hf_rms_norm

pytestmark = pytest.mark.usefixtures("float64")

DAMPING = 0.01


@pytest.fixture(autouse=True)
def _no_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no declared class and leaves none behind."""
    monkeypatch.setattr(declared_module, "_DECLARED", {})


class ScaleNorm(nn.Module):
    """An RMS norm as users write one: ``weight * x / sqrt(mean(x^2) + epsilon)``."""

    def __init__(self, width: int, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon)


def _hf_norms() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """``name -> (build, input shape)`` of HF's weight-only RMS norms (Gemma's scales by
    ``1 + weight``: the same derivative by ``weight``)."""
    transformers = pytest.importorskip("transformers")
    models = transformers.models
    return {
        "llama": (lambda: models.llama.modeling_llama.LlamaRMSNorm(6, eps=1e-5), (3, 4, 6)),
        "qwen3_head": (lambda: models.qwen3.modeling_qwen3.Qwen3RMSNorm(6, eps=1e-6),
                       (2, 3, 4, 6)),  # q_norm / k_norm: over the head dim, on 4-D inputs
        "t5": (lambda: models.t5.modeling_t5.T5LayerNorm(6, eps=1e-6), (3, 4, 6)),
        "gemma": (lambda: models.gemma.modeling_gemma.GemmaRMSNorm(6, eps=1e-6), (3, 4, 6)),
    }


def _check_norm(norm: nn.Module, shape: tuple[int, ...], eps: float, grad_tol: float) -> None:
    """The block's statistic equals ``mean_r (xhat_r d_r)^2`` (1e-12), and ``sum_r xhat_r d_r``
    is the weight's gradient (so ``xhat`` is the one the norm computes; HF's norms compute
    it in float32 whatever the input's dtype: to ``grad_tol``)."""
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.add_(torch.randn_like(norm.weight))  # type: ignore[operator]
    pre = kaisa.KFACPreconditioner(norm, factor_decay=1e-300, damping=DAMPING, kl_clip=None,
                                   layer_kinds="all")
    assert pre.coverage() == {"weight": "scale_shift"}
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = norm(x)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * r).sum().backward()  # the output gradient is exactly r
    grad = norm.weight.grad.clone()  # type: ignore[union-attr]
    pre.step()
    rows, d = x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1])
    xhat = rows / torch.sqrt((rows**2).mean(-1, keepdim=True) + eps)
    per_row = xhat * d  # d out / d weight = xhat
    torch.testing.assert_close(per_row.sum(0), grad, rtol=grad_tol, atol=grad_tol)
    fisher = (per_row**2).mean(0)
    block = pre.layers[""]
    assert block.g is not None and block.a is None
    torch.testing.assert_close(block.g[0, 0], fisher, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(norm.weight.grad, grad / (fisher + DAMPING))  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["llama", "qwen3_head", "t5", "gemma"])
def test_hf_rms_norms_are_scale_blocks_with_the_explicit_fisher(name: str) -> None:
    build, shape = _hf_norms()[name]
    norm = build().double()
    assert hf_rms_norm(norm)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    assert isinstance(eps, float)
    _check_norm(norm, shape, eps, grad_tol=1e-5)


def test_a_declared_norm_is_a_scale_block_and_one_without_its_epsilon_is_refused() -> None:
    assert not hf_rms_norm(ScaleNorm(6))  # not HF's naming: first-order until declared
    assert register_blocks(ScaleNorm(6)) == {}
    kaisa.declare_module(ScaleNorm, like="rms_norm", eps="epsilon")
    _check_norm(ScaleNorm(6).double(), (3, 4, 6), 1e-5, grad_tol=1e-12)

    kaisa.declare_module(ScaleNorm, like=kaisa.Like.RMS_NORM, eps="missing")
    with pytest.warns(RuntimeWarning, match="declared like 'rms_norm', but it has no number "
                      "in attribute 'missing'"):
        assert register_blocks(ScaleNorm(6)) == {}


class Projection(nn.Module):
    """A linear layer as users write one: ``F.linear`` with its own parameters."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def test_a_declared_linear_class_steps_as_nn_linear() -> None:
    torch.manual_seed(0)
    ours = nn.Sequential(Projection(5, 6), nn.Tanh(), Projection(6, 3))
    assert register_blocks(ours) == {}
    kaisa.declare_module(Projection, like="linear")
    ref = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            b.copy_(a)
    kw = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, lr=0.1,
              inv_dtype=torch.float64)
    pres = [kaisa.KFACPreconditioner(net, **kw) for net in (ours, ref)]  # type: ignore[arg-type]
    assert set(pres[0].coverage().values()) == {"linear"}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        for net, pre in zip((ours, ref), pres, strict=True):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            pre.step()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_declare_module_refuses_what_it_cannot_declare() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Module subclass"):
        kaisa.declare_module(int, like="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="like must be one of"):
        kaisa.declare_module(Projection, like="conv2d")
    assert declared_module._DECLARED == {}


def test_a_declaration_decides_over_the_recognised_kind() -> None:
    """A subclass of nn.Linear declared like a norm is not a Linear block."""

    class Odd(nn.Linear):
        pass

    kaisa.declare_module(Odd, like="transposed_linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks = register_blocks(copy.deepcopy(nn.Sequential(Odd(3, 3))))
    assert [type(b).__name__ for b in blocks.values()] == ["TransposedLinearBlock"]
