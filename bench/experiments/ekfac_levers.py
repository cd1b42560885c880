"""Would EKFAC's step on the byte GPT gain from batching or fusing? Isolated timings.

The byte GPT of ``bench/step_cost/step_cost.py`` (d 128, 4 layers, tied 256-byte vocabulary) has 17
Kronecker blocks in five shapes (four of each but the tied one). On one thread, each
candidate against what ``kaisa.EKFAC`` does now, interleaved (median of ``--reps``):

* rotations: ``QG^T g QA`` and back per block, against one ``bmm`` per shape group, on
  bases already stacked and with the stacking each step (the bases are stored per block);
* the Adam-in-eigenbasis elementwise update of all blocks per block
  (:func:`~kaisa.utils.first_order.adam_moments` and
  :meth:`~kaisa.utils.first_order.AdamStep.update`) against ``torch._foreach_*`` ops;
* a basis refresh of four 512 x 512 factors: ``eigh`` against one warm-started QR step.

    python bench/experiments/ekfac_levers.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kaisa.utils.first_order import AdamStep, adam_moments

#: (out, in) of the blocks: in_proj, out_proj, fc1, fc2 (four layers), the tied embedding.
SHAPES = [(384, 129), (128, 129), (512, 129), (128, 513)] * 4 + [(128, 256)]


def timed(candidates: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median milliseconds of each candidate, run in turn ``reps`` times after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for f in candidates.values():
        f()
    for _ in range(reps):
        for name, f in candidates.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def orthogonal(n: int) -> torch.Tensor:
    """A random ``n x n`` orthogonal matrix."""
    return torch.linalg.qr(torch.randn(n, n))[0]


def main() -> None:
    """Prints each comparison's medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    grads = [torch.randn(1, m, n) for m, n in SHAPES]
    qg = [orthogonal(m) for m, _ in SHAPES]
    qa = [orthogonal(n) for _, n in SHAPES]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(SHAPES):
        groups.setdefault(shape, []).append(i)
    stacked = {s: (torch.stack([qg[i] for i in ix]), torch.stack([qa[i] for i in ix]),
                   torch.cat([grads[i] for i in ix])) for s, ix in groups.items()}

    def per_block() -> None:
        for g, left, right in zip(grads, qg, qa, strict=True):
            left @ ((left.mT @ g @ right) @ right.mT)

    def batched() -> None:
        for left, right, g in stacked.values():
            left @ ((left.mT @ g @ right) @ right.mT)

    def batched_with_stacking() -> None:
        for ix in groups.values():
            left = torch.stack([qg[i] for i in ix])
            right = torch.stack([qa[i] for i in ix])
            g = torch.cat([grads[i] for i in ix])
            left @ ((left.mT @ g @ right) @ right.mT)

    print("rotations (ms):", timed({"per block": per_block, "stacked bmm": batched,
                                    "stack + bmm": batched_with_stacking}, args.reps))
    m = [torch.zeros_like(g) for g in grads]
    v = [torch.rand_like(g) for g in grads]
    step = AdamStep(3e-3, 0.9, 0.999, 1e-8, 5.0)

    def adam_per_block() -> None:
        for g, mi, vi in zip(grads, m, v, strict=True):
            adam_moments(mi, vi, g, 0.9, 0.999)
            step.update(mi, vi)

    def adam_foreach() -> None:
        torch._foreach_lerp_(m, grads, 0.1)
        torch._foreach_mul_(v, 0.999)
        torch._foreach_addcmul_(v, grads, grads, value=0.001)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1 - 0.999**5) ** 0.5)
        torch._foreach_add_(denom, 1e-8)
        update = torch._foreach_mul(m, -3e-3 / (1 - 0.9**5))
        torch._foreach_div_(update, denom)

    print("Adam elementwise (ms):", timed({"per block": adam_per_block,
                                           "foreach": adam_foreach}, args.reps))
    x = torch.randn(2048, 512)
    factor = (x.T @ x / 2048).expand(4, 512, 512).contiguous()
    previous = torch.linalg.eigh(factor)[1]

    def qr_step() -> None:
        p = factor @ previous
        order = (previous * p).sum(-2).argsort(-1, descending=True)
        torch.linalg.qr(torch.gather(p, -1, order.unsqueeze(-2).expand_as(p)))

    print("refresh of 4 x 512 (ms):", timed({"eigh": lambda: torch.linalg.eigh(factor),
                                             "qr step": qr_step}, max(3, args.reps // 3)))


if __name__ == "__main__":
    main()
