"""Lever for the peak inside ``step()``: the grouped write-back streamed group by group.

``KFACPreconditioner.step()`` preconditions every group of same-shape blocks
(:mod:`kaisa.core.grouped`) and only then KL-clips and writes the directions back
(:func:`kaisa.core.clipping.write_directions`): every group's gradient stack and
preconditioned stack, and while the KL sum is taken the KL products, are alive at once,
the largest bytes of a factor step. This experiment writes each group back as soon as it is
preconditioned, ``where(ok, P, grad)`` into ``.grad``, its KL term kept (a float64 scalar per
block), and scales every written ``.grad`` by ``where(ok, nu, 1)`` once all are known: the
same directions bit for bit (``P * nu`` rounds once either way), while one group's stacks
live at a time; or block by block (one block's copies at a time). It counts what that
costs in operator calls and what it saves in bytes.

On ResNet-50 (ImageNet shapes, fp32, eigen, one process, a factor step that does not
decompose) it measures, for the library's write-back and the two streamed ones: the operator
calls of ``step()``, the largest bytes held inside it above what K-FAC holds at its start
(``bench/distributed/step_memory.py``), and that the written gradients are the same bits.

    python bench/experiments/streamed_write.py             # bench/results/streamed_write.json
    python bench/experiments/streamed_write.py --smoke --out /tmp/s.json   # ResNet-20
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import kaisa
import kaisa.preconditioner.preconditioner as preconditioner_module
from bench import harness
from bench.distributed import step_memory
from bench.distributed.factor_memory import held_storages
from bench.step_cost.launches import Calls
from kaisa.core import clipping
from kaisa.core.grouped import GroupedDirections, group_blocks

_MB = 2.0**20


class _Streamed(GroupedDirections):
    """The groups already written (their KL terms and checks), and the other blocks."""

    terms: list[torch.Tensor]
    oks: list[torch.Tensor]
    targets: list[list[torch.Tensor]]


def _per_block_precondition(curvature: Any, damping: float) -> _Streamed:
    """Preconditions each block and writes ``where(ok, P, grad)`` into its ``.grad``."""
    engine, blocks = curvature.engine, curvature.blocks
    rule = engine.preconditioning(damping)
    terms: list[torch.Tensor] = []
    oks: list[torch.Tensor] = []
    targets: list[list[torch.Tensor]] = []
    done: set[str] = set()
    for name, block in blocks.items():
        if block.diagonal or not engine.local_worker(name):
            continue
        grad = block.gradient_matrix()
        direction = rule(block, grad)
        if grad is None or direction is None:
            continue
        inner = (direction * grad).sum(dtype=torch.float64)
        ok = (inner * 0) == 0
        torch.where(ok, direction, grad, out=direction)
        block.write_grad(direction)
        terms.append(inner.view(1))
        oks.append(ok.view(1))
        targets.append([p.grad for p in block.parameters() if p.grad is not None])
        done.add(name)
        del grad, direction
    out = _Streamed([], curvature._precondition(damping, None, skip=done))
    out.terms, out.oks, out.targets = terms, oks, targets
    return out


def _streamed_precondition(curvature: Any, damping: float) -> _Streamed:
    """Preconditions each group and writes ``where(ok, P, grad)`` into its ``.grad``."""
    method, engine, blocks = curvature._method, curvature.engine, curvature.blocks
    local = [b for name, b in blocks.items() if engine.local_worker(name)]
    terms: list[torch.Tensor] = []
    oks: list[torch.Tensor] = []
    targets: list[list[torch.Tensor]] = []
    done: set[str] = set()
    for group in group_blocks(local, method, curvature._groups):
        group.adopt()
        grad = group.gradients()
        direction = method.precondition(group.stacked, grad, damping)
        inner = clipping._per_block(direction * grad, group).sum(
            dim=(1, 2), keepdim=True, dtype=torch.float64)
        ok = (inner * 0) == 0
        n = group.blocks[0].groups
        torch.where(ok if n == 1 else ok.repeat_interleave(n, 0), direction, grad,
                    out=direction)
        dst, src = group.destinations(direction)
        torch._foreach_copy_(dst, src)
        terms.append(inner.view(-1))
        oks.append(ok.view(-1))
        targets.append(dst)
        done.update(b.name for b in group.blocks)
        del grad, direction, src
    out = _Streamed([], curvature._precondition(damping, None, skip=done))
    out.terms, out.oks, out.targets = terms, oks, targets
    return out


def _streamed_write(directions: GroupedDirections, *, kl_clip: float | None,
                    lr: float) -> None:
    """Scales the written groups by ``where(ok, nu, 1)``; the other blocks as usual."""
    assert isinstance(directions, _Streamed)
    checks = clipping._checks(directions.single, kl_clip)
    if kl_clip is None or not directions.terms:
        for block, d in clipping._apply(directions.single, checks, None, in_place=True):
            block.write_grad(d)
        return
    inner = torch.cat(directions.terms)
    ok = torch.cat(directions.oks)
    total = inner.nan_to_num(0.0, 0.0, 0.0).sum()
    if checks:
        total = total + torch.stack([torch.where(k, t, torch.zeros_like(t))
                                     for t, k in checks if t is not None]).sum()
    nu = clipping._nu(total, kl_clip, lr)
    dst = [t for ts in directions.targets for t in ts]
    per_target = torch.tensor([len(ts) // len(k) for ts, k in
                               zip(directions.targets, directions.oks, strict=True)
                               for _ in range(len(k))])
    scale = torch.where(ok, nu.to(dst[0].dtype), torch.ones((), dtype=dst[0].dtype))
    torch._foreach_mul_(dst, list(scale.repeat_interleave(per_target).unbind()))
    for block, d in clipping._apply(directions.single, checks, nu, in_place=True):
        block.write_grad(d)


@contextmanager
def streamed(curvature: Any, *, per_block: bool = False) -> Iterator[None]:
    """``step()`` with the streamed write-back (group by group, or block by block)."""
    run = _per_block_precondition if per_block else _streamed_precondition
    curvature.precondition_grouped = lambda damping: run(curvature, damping)
    original = getattr(preconditioner_module, "write_directions")  # noqa: B009
    setattr(preconditioner_module, "write_directions", _streamed_write)  # noqa: B010
    try:
        yield
    finally:
        del curvature.precondition_grouped
        setattr(preconditioner_module, "write_directions", original)  # noqa: B010


def _run(model_name: str, stream: str) -> dict[str, Any]:
    from kaisa.train import models

    torch.manual_seed(0)
    model = models.resnet20(num_classes=10) if model_name == "resnet20" else models.resnet50()
    classes = 10 if model_name == "resnet20" else 1000
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10**6)
    gen = torch.Generator().manual_seed(100)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    y = torch.randint(0, classes, (2,), generator=gen)
    out: dict[str, Any] = {}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(F.cross_entropy(model(x), y))
        if step == 0:
            pre.step()
            continue
        held = held_storages(pre, model)
        params = list(model.parameters())

        def exclude(ps: list[torch.nn.Parameter] = params) -> set[int]:
            return step_memory.model_storages(ps)

        peak = step_memory.StepPeak(held, exclude)
        calls = Calls()
        with (streamed(pre._curvature, per_block=stream == "per_block") if stream
              else _nothing(), peak, calls):
            pre.step()
        out = {"calls": calls.totals()["calls"], "extra_mb": peak.peak / _MB,
               "held_mb": sum(held.values()) / _MB,
               "grad_mb": sum(p.grad.numel() * 4 for p in params if p.grad is not None) / _MB,
               "grads": [p.grad.clone() for p in params if p.grad is not None]}
    return out


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Both write-backs on one model: calls, bytes, and whether the gradients agree."""
    p = harness.parser(__doc__, harness.RESULTS / "streamed_write.json")
    p.add_argument("--smoke", action="store_true", help="ResNet-20 (CIFAR)")
    args = p.parse_args(argv)
    name = "resnet20" if args.smoke else "resnet50"
    runs = {label: _run(name, mode) for label, mode in
            (("library", ""), ("streamed", "group"), ("per_block", "per_block"))}
    grads = {label: r.pop("grads") for label, r in runs.items()}
    same = {label: all(torch.equal(a, b) for a, b in zip(grads["library"], g, strict=True))
            for label, g in grads.items() if label != "library"}
    result = {"model": name, **runs, "same_bits": same}
    harness.write(args.out, "streamed_write", result, argv=argv,
                  script="bench/experiments/streamed_write.py")
    for label, r in runs.items():
        print(f"{label:9s} step() calls {r['calls']:5d}  peak above start {r['extra_mb']:7.1f} MB"
              f"  ({r['extra_mb'] / r['grad_mb']:.2f} x gradients; K-FAC held "
              f"{r['held_mb']:.0f} MB at the start)")
    print(f"gradients bit for bit the same as the library's: {same}")
    return result


if __name__ == "__main__":
    main()
