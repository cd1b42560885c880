"""Preconditioning batched per shape group against one call per block (issue #21).

``KFACPreconditioner`` preconditions each block with one
:func:`kaisa.ops.eigen_precondition` call (``QG ((QG^T g QA) * dgda) QA^T``). Blocks with
the same factor shapes could share one batched call instead. This measures, on the
models of ``bench/step_cost/step_cost.py`` after two steps (ResNet-32 at batch 128, the byte
GPT at ``bench/convergence/gpt.py``'s size; eigen method, ``dgda`` stored), one thread,
interleaved rounds:

* ``engine``: the core's whole preconditioning
  (:meth:`kaisa.core.curvature.KFACCurvature.precondition`: gradient matrices, the engine);
* ``per block``: one op call per block on the same gradient matrices (what the engine
  does for each);
* ``batched, stacks kept``: one call per shape group, the decompositions stacked once
  beforehand (the best case: kept stacked beside the per-block state, or the state held
  as views of the stacks), gradients concatenated and results split per step;
* ``batched, stacked per step``: the same, stacking the decompositions every step;

and the largest difference of the batched results from the per-block ones.

    python bench/experiments/precondition_batching.py [--rounds 15] [--out ...]
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kaisa
from kaisa import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step_cost"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import step_cost

from bench import harness


def _preconditioner(step: Callable[[int], None]) -> kaisa.KFACPreconditioner:
    """The preconditioner a ``bench/step_cost/step_cost.py`` step closes over."""
    for cell in step.__closure__ or ():
        if isinstance(cell.cell_contents, kaisa.KFACPreconditioner):
            return cell.cell_contents
    raise LookupError("no KFACPreconditioner in the step")


def measure(task: str, rounds: int) -> dict[str, Any]:
    """Times the four ways on one task's ``kfac_pre 10/100`` model."""
    runners = (step_cost.resnet_runners(False) if task == "resnet32"
               else step_cost.gpt_runners(False))
    runner = next(r for r in runners if r.name.startswith("kfac_pre 10/100"))
    for i in range(2):
        runner.step(i)
    pre = _preconditioner(runner.step)
    curvature = pre.curvature
    blocks = [b for b in curvature.layers.values() if not b.diagonal]
    grads: dict[str, torch.Tensor] = {}
    for b in blocks:
        matrix = b.gradient_matrix(None)
        assert matrix is not None
        grads[b.name] = matrix
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for b in blocks:
        s = b.decomposition
        groups.setdefault((tuple(s["qa"].shape), tuple(s["qg"].shape)), []).append(b)
    keys = ("qa", "qg", "dgda")

    def stacks() -> dict[tuple[Any, ...], list[torch.Tensor]]:
        return {k: [torch.cat([b.decomposition[key] for b in bs]) for key in keys]
                for k, bs in groups.items()}

    kept = stacks()

    def per_block() -> list[torch.Tensor]:
        return [ops.eigen_precondition(grads[b.name], b.decomposition["qa"],
                                       b.decomposition["qg"], dgda=b.decomposition["dgda"])
                for b in blocks]

    def batched(stacked: dict[tuple[Any, ...], list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for k, bs in groups.items():
            g = torch.cat([grads[b.name] for b in bs]) if len(bs) > 1 else grads[bs[0].name]
            qa, qg, dgda = stacked[k]
            for b, p in zip(bs, ops.eigen_precondition(g, qa, qg, dgda=dgda).split(1),
                            strict=True):
                out[b.name] = p
        return out

    ways: dict[str, Callable[[], object]] = {
        "engine": lambda: curvature.precondition(pre.damping),
        "per block": per_block,
        "batched, stacks kept": lambda: batched(kept),
        "batched, stacked per step": lambda: batched(stacks()),
    }
    reference = dict(zip((b.name for b in blocks), per_block(), strict=True))
    together = batched(kept)
    difference = max(float((together[n] - reference[n]).abs().max()) for n in reference)
    times = harness.interleaved(ways, rounds, warmup=1)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    print(f"[{task}] {len(blocks)} blocks in {len(groups)} shape groups: "
          + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items())
          + f"; batched - per block: max |diff| {difference:.1e}", flush=True)
    return {"blocks": len(blocks), "groups": [len(bs) for bs in groups.values()],
            "median_ms": ms, "max_abs_difference": difference}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures both tasks; prints and writes the JSON."""
    parser = harness.parser(__doc__, harness.RESULTS / "precondition_batching.json")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tasks", default="resnet32,gpt")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loadavg_start = list(os.getloadavg())
    results: dict[str, Any] = {
        "protocol": f"{args.rounds} interleaved rounds after one warm-up call, median ms",
        "tasks": {task: measure(task, args.rounds) for task in args.tasks.split(",")},
    }
    results = harness.write(args.out, "precondition_batching", results, argv,
                            script="bench/experiments/precondition_batching.py",
                            loadavg_start=loadavg_start)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
