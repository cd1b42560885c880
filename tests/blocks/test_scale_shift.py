"""Scale-and-shift blocks (LayerNorm, RMSNorm, BatchNorm affine): explicit float64 math."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from tests.support.dist import run_distributed

pytestmark = pytest.mark.usefixtures("float64")

DAMPING = 0.01


def _xhat_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The normalised input, written independently of the block."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims, keepdim=True)
        var = ((x - mean) ** 2).mean(dims, keepdim=True)
        xhat = (x - mean) / torch.sqrt(var + module.eps)
        return xhat.movedim(1, -1).reshape(-1, x.shape[1])
    e = module.weight.numel()  # type: ignore[union-attr]
    rows = x.reshape(-1, e)
    if isinstance(module, nn.RMSNorm):
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        return rows / torch.sqrt((rows**2).mean(-1, keepdim=True) + eps)
    mean = rows.mean(-1, keepdim=True)
    return (rows - mean) / torch.sqrt(((rows - mean) ** 2).mean(-1, keepdim=True) + module.eps)


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "layernorm": (lambda: nn.LayerNorm(5), (4, 3, 5)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((2, 3)), (4, 2, 3)),
    "layernorm_no_bias": (lambda: nn.LayerNorm(5, bias=False), (6, 5)),
    "rmsnorm": (lambda: nn.RMSNorm(5), (4, 3, 5)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(3), (6, 3, 4)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_statistics_and_preconditioned_gradient_are_the_explicit_ones(case: str) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    norm = build().double()
    with torch.no_grad():  # away from the initial ones/zeros
        norm.weight.add_(torch.randn_like(norm.weight))  # type: ignore[operator]
    pre = kaisa.KFACPreconditioner(norm, factor_decay=1e-300, damping=DAMPING, kl_clip=None,
                                   layer_kinds="all")
    assert set(pre.coverage().values()) == {"scale_shift"}
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = norm(x)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * r).sum().backward()  # the output gradient is exactly r
    grads = [p.grad.clone() for p in norm.parameters()]  # type: ignore[union-attr]
    pre.step()
    xhat = _xhat_rows(norm, x)
    d = r.movedim(1, -1).reshape(xhat.shape) if case.startswith("batchnorm") else (
        r.reshape(xhat.shape))
    torch.testing.assert_close((xhat * d).sum(0), grads[0].reshape(-1))  # xhat is torch's
    want = [((xhat * d) ** 2).mean(0), (d**2).mean(0)][: len(grads)]
    block = pre.layers[""]
    assert block.g is not None and block.a is None
    torch.testing.assert_close(block.g[0], torch.stack(want), rtol=1e-12, atol=1e-14)
    for p, g, f in zip(norm.parameters(), grads, want, strict=True):
        torch.testing.assert_close(p.grad.reshape(-1), g.reshape(-1) / (f + DAMPING))  # type: ignore[union-attr]


def test_a_norm_called_twice_pairs_each_call_with_its_gradient() -> None:
    torch.manual_seed(0)
    norm = nn.LayerNorm(4).double()
    pre = kaisa.KFACPreconditioner(norm, factor_decay=1e-300, layer_kinds=("scale_shift",))
    x1, x2 = (torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    r1, r2 = (torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (3, 4))
    ((norm(x1) * r1).sum() + (norm(x2 * 3.0) * r2).sum()).backward()
    pre.step()
    per_call = [torch.stack([((_xhat_rows(norm, x) * r) ** 2).mean(0), (r**2).mean(0)])
                for x, r in ((x1, r1), (x2 * 3.0, r2))]
    block = pre.layers[""]
    assert block.g is not None
    torch.testing.assert_close(block.g[0], (per_call[0] + per_call[1]) / 2, rtol=1e-12,
                               atol=1e-14)


def test_kfac_preconditions_norms_inside_the_quadratic_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2)).double()
    opt = kaisa.KFAC(model, loss="mse", mc_samples=2, layer_kinds="all")
    assert opt.first_order is None and opt.coverage()["1.weight"] == "scale_shift"
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    losses = [float(opt.step(lambda: (model(x), y))) for _ in range(6)]  # type: ignore[arg-type]
    assert losses[-1] < losses[0] and all(torch.isfinite(p).all() for p in model.parameters())


def _rank_train(rank: int | None, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()
    pre = kaisa.KFACPreconditioner(model, grad_worker_fraction="mem_opt", damping=0.01,
                                   inv_dtype=torch.float64, kl_clip=0.05, lr=0.1,
                                   layer_kinds="all")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 4, generator=gen), torch.randint(0, 3, (2 * world,),
                                                                        generator=gen)
        if rank is not None:
            x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * (world if rank is None else 1)).backward()
        for p in model.parameters():
            assert p.grad is not None
            if rank is None:
                p.grad.div_(world)
            else:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
        pre.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _rank_fn(rank: int, world: int) -> list[torch.Tensor]:
    torch.set_default_dtype(torch.float64)
    return _rank_train(rank, world)


@pytest.mark.distributed
def test_norm_blocks_on_two_ranks_equal_one_process() -> None:
    want = _rank_train(None, 2)
    for got in run_distributed(_rank_fn, 2, timeout=120):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_micro_batches_pair_each_norm_input_with_its_own_gradient() -> None:
    torch.manual_seed(0)
    norm = nn.LayerNorm(4).double()
    pre = kaisa.KFACPreconditioner(norm, factor_decay=1e-300, accumulation_steps=2,
                                   layer_kinds="all")
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    rs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    for x, r in zip(xs, rs, strict=True):
        (norm(x * 2.0) * r).sum().backward()
    pre.step()
    per_batch = [torch.stack([((_xhat_rows(norm, x * 2.0) * r) ** 2).mean(0), (r**2).mean(0)])
                 for x, r in zip(xs, rs, strict=True)]
    block = pre.layers[""]
    assert block.g is not None
    torch.testing.assert_close(block.g[0], (per_batch[0] + per_batch[1]) / 2, rtol=1e-12,
                               atol=1e-14)
