"""Coverage: every trainable parameter is preconditioned by a block or follows a first-order rule."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import kaisa

pytestmark = pytest.mark.usefixtures("float64")


class _Net(nn.Module):
    """Embedding tied to the head, a LayerNorm, a frozen Linear and a covered Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.frozen(self.norm(self.embed(tokens))))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 7, (5, 3), generator=g), torch.randint(0, 7, (5, 3), generator=g)


def test_coverage_names_every_trainable_parameter_once_and_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = _Net()
    with caplog.at_level(logging.INFO, logger="kaisa"):
        pre = kaisa.KFACPreconditioner(model)
    want = {"embed.weight": "first-order", "norm.weight": "first-order",
            "norm.bias": "first-order", "hidden.weight": "linear", "hidden.bias": "linear"}
    # the tied weight is listed once under its first name; without the embedding kind it
    # is first-order (never preconditioned from the head's use alone)
    assert pre.coverage() == want
    assert list(pre.coverage()) == [n for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    share = 100 * (sizes["hidden.weight"] + sizes["hidden.bias"]) / sum(sizes[n] for n in want)
    lines = [r.getMessage() for r in caplog.records if "preconditions" in r.getMessage()]
    assert lines == [f"kaisa: K-FAC preconditions 2 of 5 trainable parameters ({share:.1f}% of "
                     "the elements) in 1 blocks; first-order: embed.weight, norm.weight, "
                     "norm.bias"]
    opt = kaisa.KFAC(_Net(), loss="cross_entropy", layer_kinds=("linear", "conv2d"))
    assert opt.coverage() == want
    tied = want | {"embed.weight": "embedding"}
    assert kaisa.KFAC(_Net(), loss="cross_entropy",
                      layer_kinds=("linear", "embedding")).coverage() == tied
    every = kaisa.KFAC(_Net(), loss="cross_entropy", layer_kinds="all")
    assert every.coverage() == tied | {"norm.weight": "scale_shift", "norm.bias": "scale_shift"}


def test_uncovered_parameters_follow_adamw_on_their_raw_gradients() -> None:
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    tokens, targets = _data()
    opt = kaisa.KFAC(model, loss="cross_entropy")  # norms are first-order by default
    assert isinstance(opt.first_order, torch.optim.AdamW)
    opt.step(lambda: (model(tokens), targets))
    loss = nn.functional.cross_entropy(reference(tokens).reshape(-1, 7), targets.reshape(-1))
    loss.backward()
    adamw = torch.optim.AdamW([reference.norm.weight, reference.norm.bias], lr=1e-3)
    adamw.step()
    assert torch.equal(model.norm.weight, reference.norm.weight)
    assert torch.equal(model.norm.bias, reference.norm.bias)
    assert not torch.equal(model.hidden.weight, reference.hidden.weight)  # K-FAC moved it
    assert torch.equal(model.frozen.weight, reference.frozen.weight)


def test_first_order_rule_is_configurable_and_resumes_bit_exactly() -> None:
    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    tokens, targets = _data()

    def build() -> tuple[nn.Module, kaisa.KFAC]:
        torch.manual_seed(0)
        model = _Net()
        return model, kaisa.KFAC(model, loss="cross_entropy", first_order=sgd,
                                 layer_kinds=("linear", "conv2d"))

    def run(model: nn.Module, opt: kaisa.KFAC, steps: int) -> None:
        for _ in range(steps):
            opt.step(lambda: (model(tokens), targets))

    model, opt = build()
    assert isinstance(opt.first_order, torch.optim.SGD)
    run(model, opt, 5)
    half, half_opt = build()
    run(half, half_opt, 3)
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": half_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, resumed_opt = build()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.first_order is not None
    assert resumed_opt.first_order.state_dict()["state"]  # momentum buffers came back
    run(resumed, resumed_opt, 2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="first_order must be a callable"):
        kaisa.KFAC(_Net(), loss="cross_entropy", first_order="adamw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_kinds must be"):
        kaisa.KFACPreconditioner(_Net(), layer_kinds=("linear", "lstm"))


def test_fixed_lr_steps_every_parameter_with_sgd() -> None:
    opt = kaisa.KFAC(_Net(), loss="cross_entropy", curvature="empirical", lr=0.1, momentum=0.0)
    assert opt.first_order is None


class _Functional(nn.Module):
    """BEiT's attention input: the ``qkv`` Linear's weight used through ``F.linear`` with a
    bias made of other parameters, so the Linear's own hooks never fire."""

    def __init__(self, called: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(4))
        self.v_bias = nn.Parameter(torch.zeros(4))
        self.out = nn.Linear(12, 2)
        self.called = called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.called:
            return self.out(self.qkv(x))
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        return self.out(nn.functional.linear(x, self.qkv.weight, bias))


def test_a_block_whose_hooks_never_fire_is_reported_first_order() -> None:
    """coverage() never reports a block that nothing preconditions: after the first step
    that recorded, the functional use is first-order (with one warning); when the module
    is called again, its kind comes back."""
    torch.manual_seed(0)
    model = _Functional(called=False)
    pre = kaisa.KFACPreconditioner(model)
    assert pre.coverage()["qkv.weight"] == "linear"  # before any step: not known yet
    x = torch.randn(5, 4)

    def step() -> None:
        model.zero_grad()
        model(x).square().sum().backward()
        pre.step()

    with pytest.warns(RuntimeWarning, match=r"'qkv' \(Linear\) did not fire .*\(first-order in coverage"):
        step()
    assert pre.coverage()["qkv.weight"] == "first-order"
    assert pre.coverage()["out.weight"] == "linear"
    assert "qkv.weight" in pre.curvature.coverage_summary(model).split("first-order:")[1]
    resumed = kaisa.KFACPreconditioner(model)  # a resume knows it before its first step
    resumed.load_state_dict(pre.state_dict())
    assert resumed.coverage() == pre.coverage()
    fresh = kaisa.KFACPreconditioner(model)
    fresh.load_state_dict(kaisa.KFACPreconditioner(model).state_dict())  # nothing recorded
    assert fresh.coverage()["qkv.weight"] == "linear"
    model.called = True
    step()
    assert pre.coverage()["qkv.weight"] == "linear"
