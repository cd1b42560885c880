"""A transformer under torch.distributed: 2 and 4 gloo ranks equal one process.

The model is the project's byte-level GPT (:mod:`kaisa.train.models.gpt`) at a tiny size in
float64: an ``nn.Embedding`` tied to the ``Linear`` head, learned positions, norm-first
``nn.TransformerEncoderLayer`` blocks under a causal mask (dropout 0) and a final
LayerNorm. Both products run with ``layer_kinds="all"``, so every block kind kaisa
registers for these modules takes part (the test asserts the coverage is non-trivial and
that the covered blocks recorded factors; blocks added later join by themselves).

Rank ``r`` holds windows ``[r R, (r + 1) R)`` of a global batch of ``W R`` windows; the
parent trains the same model in one process on the whole batch. ``KFACPreconditioner``:
gradients are averaged by an explicit allreduce; with a mean loss each rank's output
gradients are ``W`` times the single process's, so the reference multiplies its loss by
``W`` for backward and divides the gradients by ``W`` before ``step()`` (as in
``tests/distributed/test_distributed.py``). ``kaisa.KFAC``: DDP averages the gradients and KFAC
scales its own Fisher, so both sides run the plain loop.

Tolerance (``rtol=1e-8, atol=1e-10`` on the parameters after every step): the two runs do
the same float64 arithmetic except the order of sums (per-rank means then a mean over
ranks, against one mean over the batch), a relative difference of a few ``1e-16`` per
reduction; the damped factors' inverses (damping ``>= 1e-2`` on factors of norm ~1) and
four steps amplify it by at most ~``1e4``, so agreement to ``1e-8`` holds with a wide
margin, while every mistake this test is for (a missing ``1/W``, a rank's own factor or
sample instead of the average, a block left out on some rank) is of the order of the
step itself, ``>= 1e-4`` here (asserted: every parameter moves by more than that).
Measured: at most 4.7e-13 absolute (parameters of size ~1), 0.5% of the tolerance, on 2
and on 4 ranks. Every rank must hold bit-identical parameters. ``kaisa.KFAC``'s
Monte-Carlo targets are equal too because each rank keeps its rows of the global batch's
draw (``kaisa.kfac.losses.Share``); with every rank drawing from the same stream, as before,
the 2-rank run differed from one process by 12% after one step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kaisa
from kaisa.train.distributed import DistContext, data_parallel
from kaisa.train.models.gpt import GPT
from tests.support.dist import run_distributed

VOCAB, D_MODEL, LAYERS, HEADS, CONTEXT = 13, 8, 2, 2, 6
WINDOWS_PER_RANK = 3
STEPS = 4
RTOL, ATOL = 1e-8, 1e-10
#: Parameters (of 28) kaisa covers today with layer_kinds="all": every Linear, LayerNorm and
#: the head (tied to the embedding); MHA's packed in-projection and the positions are not.
MIN_COVERED = 23


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS,
               context=CONTEXT, dropout=0.0).double()


def _batch(world: int, step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global windows (``rank=None``) or rank ``rank``'s share of them."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (world * WINDOWS_PER_RANK, CONTEXT + 1), generator=gen)
    if rank is not None:
        tokens = tokens[rank * WINDOWS_PER_RANK : (rank + 1) * WINDOWS_PER_RANK]
    return tokens[:, :-1], tokens[:, 1:]


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _facts(curvature: Any, coverage: dict[str, str]) -> dict[str, Any]:
    """What a rank saw: coverage, the blocks whose running factors were updated."""
    return {
        "covered": sorted(n for n, kind in coverage.items() if kind != "first-order"),
        "kinds": sorted({kind for kind in coverage.values()}),
        "with_factors": sorted(n for n, b in curvature.blocks.items()
                               if b.g is not None and (b.diagonal or b.a is not None)),
        "blocks": sorted(curvature.blocks),
    }


# ----------------------------------------------------------------------------- preconditioner


def _precondition(cfg: dict[str, Any], world: int, rank: int | None) -> dict[str, Any]:
    """STEPS of SGD + KFACPreconditioner; ``rank=None`` is the one-process reference."""
    model = _gpt()
    pre = kaisa.KFACPreconditioner(
        model, grad_worker_fraction=cfg["strategy"], compute_method=cfg["method"],
        layer_kinds="all", inv_dtype=torch.float64, factor_decay=0.9, damping=0.01,
        kl_clip=0.05, lr=0.1, inv_update_steps=2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    scale = float(world) if rank is None else 1.0
    steps = [_snapshot(model)]
    for step in range(STEPS):
        tokens, targets = _batch(world, step, rank)
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        (loss * scale).backward()
        for p in model.parameters():
            assert p.grad is not None
            if rank is not None:
                dist.all_reduce(p.grad)
            p.grad.div_(world)
        pre.step()
        opt.step()
        steps.append(_snapshot(model))
    return {"steps": steps, "facts": _facts(pre.curvature, pre.coverage()),
            "fraction": pre.grad_worker_fraction, "held": pre.placement.held_by(pre.rank)}


# ----------------------------------------------------------------------------- kaisa.KFAC


def _kfac(cfg: dict[str, Any], world: int, rank: int | None) -> dict[str, Any]:
    """STEPS of adaptive kaisa.KFAC (lr, momentum, damping) under DDP."""
    model = _gpt()
    net: nn.Module = DistributedDataParallel(model) if rank is not None else model
    opt = kaisa.KFAC(
        model, loss="cross_entropy", curvature=cfg["curvature"], seed=7, damping=0.01,
        damping_interval=2, inv_update_steps=2, inv_dtype=torch.float64,
        grad_worker_fraction=cfg["strategy"], compute_method=cfg["method"],
        layer_kinds="all",
    )
    steps, last = [_snapshot(model)], []
    for step in range(STEPS):
        tokens, targets = _batch(world, step, rank)
        opt.step(lambda tokens=tokens, targets=targets: (net(tokens), targets))
        steps.append(_snapshot(model))
        last.append(dict(opt.last))
    return {"steps": steps, "facts": _facts(opt.curvature, opt.coverage()), "last": last}


# ----------------------------------------------------------------------------- the jobs

_PRODUCTS = {"precondition": _precondition, "kfac": _kfac}


def _job(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_default_dtype(torch.float64)
    return [_PRODUCTS[cfg["product"]](cfg, world, rank) for cfg in configs]


def _reference(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _PRODUCTS[cfg["product"]](cfg, world, None)
    finally:
        torch.set_default_dtype(old)


def _check(configs: list[dict[str, Any]], world: int, results: list[list[dict[str, Any]]]) -> None:
    for i, cfg in enumerate(configs):
        ours = [results[r][i] for r in range(world)]
        ref = _reference(cfg, world)
        for r in range(1, world):
            for step, (a, b) in enumerate(zip(ours[0]["steps"], ours[r]["steps"], strict=True)):
                for p, q in zip(a, b, strict=True):
                    assert torch.equal(p, q), f"rank {r} differs from rank 0 at step {step}: {cfg}"
        for step, (a, b) in enumerate(zip(ours[0]["steps"], ref["steps"], strict=True)):
            for p, q in zip(a, b, strict=True):
                torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, s=step, c=cfg: f"step {s} {c}: {m}")
        moved = min(float((p - q).abs().max())
                    for p, q in zip(ref["steps"][-1], ref["steps"][0], strict=True))
        assert moved > 1e-4, (cfg, moved)
        facts = ours[0]["facts"]
        assert all(o["facts"] == facts for o in ours) and facts == ref["facts"], cfg
        assert len(facts["covered"]) >= MIN_COVERED, facts
        assert {"linear", "scale_shift", "first-order"} <= set(facts["kinds"]), facts
        # Every block recorded factors on every rank, but MHA's out_proj where nn.Linear's
        # hooks do not fire (nn.MultiheadAttention calls it functionally).
        missing = set(facts["blocks"]) - set(facts["with_factors"])
        assert all(n.endswith("self_attn.out_proj") for n in missing), facts
        if cfg["product"] == "kfac":
            for a, b in zip(ours[0]["last"], ref["last"], strict=True):
                assert a.keys() == b.keys()
                for key in a:
                    assert a[key] == pytest.approx(b[key], rel=1e-7, abs=1e-10), (cfg, key)


def _configs(world: int) -> list[dict[str, Any]]:
    fractions = ["comm_opt", "mem_opt"] + (["hybrid_opt"] if world > 2 else [])
    methods = ("eigen", "inverse")
    if world > 2:  # the short form: one strategy per product, both methods between them
        return [
            dict(product="precondition", strategy="hybrid_opt", method="eigen"),
            dict(product="kfac", strategy="hybrid_opt", method="inverse", curvature="mc"),
        ]
    return [
        *(dict(product="precondition", strategy=s, method=m) for s in fractions for m in methods),
        *(dict(product="kfac", strategy=s, method=m, curvature="mc")
          for s in fractions for m in methods),
        dict(product="kfac", strategy="comm_opt", method="pi_inverse", curvature="mc"),
        dict(product="kfac", strategy="mem_opt", method="eigen", curvature="empirical"),
    ]


def _full_grid(world: int) -> list[dict[str, Any]]:
    fractions = ("comm_opt", "mem_opt", "hybrid_opt")
    return [
        *(dict(product="precondition", strategy=s, method=m)
          for s in fractions for m in ("eigen", "inverse")),
        *(dict(product="kfac", strategy=s, method=m, curvature="mc")
          for s in fractions for m in ("eigen", "inverse")),
    ]


#: nn.MultiheadAttention calls out_proj functionally: kaisa warns that its hooks never fire.
_QUIET = pytest.mark.filterwarnings("ignore:.*the hooks of registered layer")


@_QUIET
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_gpt_on_ranks_equals_one_process(world: int) -> None:
    configs = _configs(world)
    results = run_distributed(_job, world, configs, timeout=280)
    _check(configs, world, results)
    # MEM-OPT: each block's decompositions live on exactly one rank.
    for i, cfg in enumerate(configs):
        if cfg["product"] == "precondition" and cfg["strategy"] == "mem_opt":
            held = sorted(name for r in range(world) for name in results[r][i]["held"])
            assert held == sorted(set(held)) and held, held


@_QUIET
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpt_on_four_ranks_every_strategy_equals_one_process() -> None:
    configs = _full_grid(4)
    results = run_distributed(_job, 4, configs, timeout=580)
    _check(configs, 4, results)


# ----------------------------------------------------------------------------- resume

#: Decompositions at steps 0 and 3: saved after step 1 (whose factors moved on), used at 2.
RESUME_AT, RESUME_STEPS, RESUME_INV = 2, 3, 3


class _Run:
    """One rank's model and product, stepped on its share of the global batches."""

    def __init__(self, product: str, strategy: str, world: int, rank: int) -> None:
        self.model, self.world, self.rank, self.product = _gpt(), world, rank, product
        common: dict[str, Any] = dict(grad_worker_fraction=strategy, inv_update_steps=RESUME_INV,
                                      inv_dtype=torch.float64, layer_kinds="all")
        if product == "precondition":
            self.pre = kaisa.KFACPreconditioner(self.model, compute_method="eigen",
                                                factor_decay=0.9, damping=0.01, kl_clip=0.05,
                                                lr=0.1, **common)
            self.opt: Any = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.5)
        else:
            # DDP's bucket layout changes after its first step, and with 3+ ranks the ring
            # allreduce's rounding with it: the app's hook sums in one fixed layout.
            self.net = data_parallel(self.model, DistContext(rank, world))
            self.opt = kaisa.KFAC(self.model, loss="cross_entropy", seed=7, damping=0.01,
                                  damping_interval=2, compute_method="inverse", **common)

    def step(self, step: int) -> None:
        tokens, targets = _batch(self.world, step, self.rank)
        if self.product != "precondition":
            self.opt.step(lambda: (self.net(tokens), targets))
            return
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(tokens)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
        for p in self.model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(self.world)
        self.pre.step()
        self.opt.step()

    def state(self, gather: bool) -> dict[str, Any]:
        """What a checkpoint holds (copied: training goes on)."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.product == "precondition":
            state["opt"] = self.opt.state_dict()
            state["pre"] = self.pre.state_dict(gather=gather)
            state["layers"] = state["pre"]["layers"]
        else:
            state["opt"] = self.opt.state_dict(gather=gather)
            state["layers"] = state["opt"]["kaisa"]["preconditioner"]["layers"]
        return copy.deepcopy(state)

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        if self.product == "precondition":
            self.pre.load_state_dict(state["pre"])


def _resume_job(rank: int, world: int, product: str, strategy: str) -> dict[str, Any]:
    """Runs RESUME_AT + RESUME_STEPS steps, and resumes from rank 0's states at RESUME_AT."""
    torch.set_default_dtype(torch.float64)
    whole = _Run(product, strategy, world, rank)
    for step in range(RESUME_AT):
        whole.step(step)
    saved = {gather: whole.state(gather) for gather in (True, False)}
    box = [saved]
    dist.broadcast_object_list(box, src=0)  # the checkpoint rank 0 writes
    saved = box[0]
    after: dict[str, list[list[torch.Tensor]]] = {"whole": [], "gathered": [], "local": []}
    for step in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
        whole.step(step)
        after["whole"].append(_snapshot(whole.model))
    for label, gather in (("gathered", True), ("local", False)):
        resumed = _Run(product, strategy, world, rank)
        resumed.load(saved[gather])
        for step in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
            resumed.step(step)
            after[label].append(_snapshot(resumed.model))
    kron = [n for n, b in whole.opt.curvature.blocks.items() if not b.diagonal] if (
        product == "kfac") else [n for n, b in whole.pre.curvature.blocks.items()
                                 if not b.diagonal]
    return {"after": after, "kron": kron,
            "saved": {g: sorted(n for n in kron if len(saved[g]["layers"][n]) > 4)
                      for g in (True, False)}}


@_QUIET
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "strategy"), [(2, "mem_opt"), (4, "hybrid_opt")])
@pytest.mark.parametrize("product", ["precondition", "kfac"])
def test_gpt_resumes_bit_exactly_from_rank_zeros_gathered_state(
    world: int, strategy: str, product: str
) -> None:
    """MEM-OPT/HYBRID-OPT keep each block's decompositions on its gradient workers: rank
    0's ``state_dict(gather=True)`` holds them all, and every rank resuming from it
    continues bit for bit; rank 0's own state (``gather=False``) lacks some, which
    loading recomputes from the factors: not the uninterrupted run."""
    results = run_distributed(_resume_job, world, product, strategy, timeout=280)
    for r, got in enumerate(results):
        # every block with decompositions saved (beyond A, G and the two skip counts), but
        # MHA's out_proj where its hooks do not fire
        with_factors = {n for n in got["kron"] if not n.endswith("self_attn.out_proj")}
        assert with_factors <= set(got["saved"][True]) <= set(got["kron"]), got["saved"]
        assert set(got["saved"][False]) < set(got["saved"][True])
        for step, (a, b) in enumerate(zip(got["after"]["whole"], got["after"]["gathered"],
                                          strict=True)):
            for p, q in zip(a, b, strict=True):
                assert torch.equal(p, q), f"rank {r}, step {RESUME_AT + step}"
        assert any(not torch.equal(p, q) for p, q in zip(got["after"]["whole"][-1],
                                                         got["after"]["local"][-1], strict=True))
