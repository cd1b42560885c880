"""Unit tests of the layer registry and the per-layer state (kaisa.blocks)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import kaisa
from kaisa.blocks import (
    BLOCK_KINDS,
    AttentionBlock,
    BatchStatistics,
    Conv1dBlock,
    Conv2dBlock,
    EmbeddingBlock,
    ExpertBlock,
    LinearBlock,
    RouterBlock,
    RunningFactors,
    ScaleShiftBlock,
    TransposedLinearBlock,
    register_blocks,
)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.circ = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 2)
        self.norm = nn.LayerNorm(4)


def test_registry_picks_kinds_skips_frozen_unsupported_and_patterns() -> None:
    assert list(BLOCK_KINDS) == [LinearBlock, TransposedLinearBlock, ExpertBlock, RouterBlock,
                                 Conv2dBlock, Conv1dBlock, EmbeddingBlock, ScaleShiftBlock,
                                 AttentionBlock]
    with pytest.warns(RuntimeWarning, match=r"'circ'.*padding_mode='circular'"):
        layers = register_blocks(_Net())
    assert {n: type(la) for n, la in layers.items()} == {
        "conv": Conv2dBlock, "head": LinearBlock, "norm": ScaleShiftBlock}
    skipped = register_blocks(_Net(), skip=(re.compile("Conv2d"),))  # class names too
    assert list(skipped) == ["head", "norm"]
    conv = layers["conv"]
    assert conv.dims == (3 * 9 + 1, 4) and conv.groups == 1 and conv.has_bias


def test_batch_statistics_mean_over_micro_batches_and_clear() -> None:
    stats = BatchStatistics()
    assert not stats.has_factors and stats.take() == (None, None)
    stats.add_a(torch.ones(1, 2, 2))
    stats.add_a(3 * torch.ones(1, 2, 2))
    stats.add_g(torch.ones(1, 3, 3))
    assert stats.nbytes() == (4 + 9) * 4
    a, g = stats.take()
    assert a is not None and torch.equal(a, 2 * torch.ones(1, 2, 2))
    assert g is not None and torch.equal(g, torch.ones(1, 3, 3))
    assert not stats.has_factors and stats.a_count == 0


def test_running_factors_start_at_identity_and_skip_non_finite_batches() -> None:
    f = RunningFactors()
    f.fold(torch.zeros(1, 2, 2), None, 0.75)
    assert f.a is not None and torch.equal(f.a, 0.75 * torch.eye(2).unsqueeze(0))
    before = f.a.clone()
    f.fold(torch.full((1, 2, 2), float("nan")), torch.ones(1, 1, 1), 0.5)
    assert torch.equal(f.a, before) and f.skipped == 1
    assert f.g is not None and torch.equal(f.g, torch.ones(1, 1, 1))


def test_layer_state_dict_round_trip_and_gradient_matrix() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, groups=2)
    layer = Conv2dBlock(name="c", module=conv, factor_dtype=None)
    assert layer.groups == 2 and layer.gradient_matrix() is None
    conv.weight.grad = torch.randn_like(conv.weight)
    assert conv.bias is not None
    conv.bias.grad = torch.randn_like(conv.bias)
    grad = layer.gradient_matrix()
    assert grad is not None and grad.shape == (2, 3, 2 * 9 + 1)
    layer.write_grad(2 * grad)
    torch.testing.assert_close(layer.gradient_matrix(), 2 * grad)
    layer.factors.fold(torch.ones(2, 19, 19), torch.ones(2, 3, 3), 0.5)
    layer.decomposition["a_inv"] = torch.eye(19).repeat(2, 1, 1)
    state = layer.state_dict()
    other = Conv2dBlock(name="c", module=conv, factor_dtype=None)
    other.load_state_dict(state)
    assert other.a is not None and torch.equal(other.a, layer.a)  # type: ignore[arg-type]
    assert torch.equal(other.a_inv, layer.decomposition["a_inv"]) and other.qa is None
    assert other.a_factor is not None and other.a_factor.shape == (2, 19, 19)  # grouped
    assert other.memory_usage()["decompositions"] == 2 * 19 * 19 * 4


_CONV1D = [(p, 1, True, 1, 1) for p in (0, 2, "same", "valid")] + [
    (p, 1, True, 1, 2) for p in (0, 2, "same", "valid")
] + [(p, 2, False, 2, 1) for p in (0, 2, "valid")]  # torch: no padding='same' with stride 2


@pytest.mark.parametrize(("padding", "groups", "bias", "stride", "dilation"), _CONV1D)
def test_conv1d_block_is_the_conv2d_block_of_height_one(
    padding: int | str, groups: int, bias: bool, stride: int, dilation: int
) -> None:
    """Factors and preconditioned gradients of a Conv1d equal its height-1 Conv2d's."""
    torch.manual_seed(0)
    conv1 = nn.Conv1d(4, 6, 3, stride=stride, padding=padding, dilation=dilation,
                      groups=groups, bias=bias).double()
    pad2: int | str | tuple[int, int] = padding if isinstance(padding, str) else (0, padding)
    conv2 = nn.Conv2d(4, 6, (1, 3), stride=(1, stride), padding=pad2,
                      dilation=(1, dilation), groups=groups, bias=bias).double()
    with torch.no_grad():
        conv2.weight.copy_(conv1.weight.unsqueeze(2))
        if bias:
            conv2.bias.copy_(conv1.bias)
    pre1 = kaisa.KFACPreconditioner(conv1, inv_dtype=torch.float64, layer_kinds="all")
    pre2 = kaisa.KFACPreconditioner(conv2, inv_dtype=torch.float64)
    assert isinstance(pre1.layers[""], Conv1dBlock) and pre1.coverage()["weight"] == "conv1d"
    x = torch.randn(3, 4, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    conv1(x).square().sum().backward()
    conv2(x.unsqueeze(2)).square().sum().backward()
    pre1.step()
    pre2.step()
    a1, a2 = pre1.layers[""], pre2.layers[""]
    assert a1.a is not None and a2.a is not None and a1.g is not None and a2.g is not None
    torch.testing.assert_close(a1.a, a2.a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a1.g, a2.g, rtol=1e-12, atol=1e-12)
    assert conv1.weight.grad is not None and conv2.weight.grad is not None
    torch.testing.assert_close(conv1.weight.grad, conv2.weight.grad.squeeze(2),
                               rtol=1e-10, atol=1e-12)
