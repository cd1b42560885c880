"""Per-phase floors of issue #21's step-cost targets on this CPU, and a GPU projection.

Reads ``bench/step_cost/step_cost.py``'s JSON (default: the committed runs the issue's figures come
from; a later file's row replaces an earlier one's for the same task and configuration)
and, for every configuration with a target (``step_cost_report.TARGETS``), prints its
amortised per-phase milliseconds, the **floor** and a **GPU projection**.

Floor (CPU, same run): the row's ratio to its baseline if every phase that a structural or
already measured-and-rejected cost keeps stayed and every removable overhead went to zero:

* forward + backward: the baseline's own (the same model and batch); the row's excess
  over it (hooks, caches, noise) is removable;
* factor statistics: their GEMM flops (counted below from the shapes) at the best GEMM
  rate the same run reached (the baseline's forward + backward, the row's factors or its
  preconditioning; flops / ms), EMA updates and bookkeeping removable;
* decompositions, preconditioning, the Monte-Carlo backward, the quadratic model's
  Jacobian-vector replays, the LM damping rule, the update: kept as measured (``RULES``
  says why, citing the measurements in docs/benchmarks.md); communication (one process) and the rest
  (``overhead``, the quadratic model outside its replays) go to zero.

GPU: **a projection, not a measurement** (no GPU has run this code): each measured phase
of the row on an H100 SXM with ``choose_covariance``'s constants (csrc/cuda/covariance.cu,
docs/cuda-kernels.md: datasheet peaks, assumed efficiencies): GEMM flops at TF32 495
TFLOP/s x 0.6, memory traffic at 3.35 TB/s x 0.8, 4 us a kernel launch. Forward and
backward: their aten ops (counted in one pass, views excluded; a launch each, outputs
written once and read twice); factors: that cost model per side, 3 more launches a block;
preconditioning: its GEMMs, 7 (eigen) / 4 (inverse) launches a block; the update: its
parameter traffic, 10 launches; the Monte-Carlo backward: a backward without the weight
gradients; the quadratic model: two replays of twice a forward; decompositions (a guess,
not part of the documented model): ``9 n^3`` flops at 5% of the FP32 units per matrix and
a launch per column per size group (eigh), ``2 n^3`` at the GEMM rate and ``n / 64 + 3``
launches (inverses).

    python bench/step_cost/step_floor.py                       # the committed runs, writes the JSON
    python bench/step_cost/step_floor.py A.json B.json --out /tmp/f.json
    python bench/step_cost/step_floor.py --smoke --out /tmp/f.json   # CI: committed runs, no README
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kaisa.ops._checks import ConvArgs
from kaisa.ops._shifted import supports_shifted
from kaisa.train import models
from kaisa.train.models.gpt import gpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from step_cost_report import TARGETS

from bench import harness

RESULTS = harness.RESULTS
#: Oldest first: step_cost_after.json's GPT eigen row replaces kfac_after's, and
#: step_cost_gpt_inverse.json's the eigen and inverse rows (the same run).
DEFAULTS = tuple(RESULTS / f for f in (
    "step_cost_kfac_after.json", "step_cost_after.json", "step_cost_gpt_inverse.json"))
TF32, SIMT, HBM = 495e12, 67e12, 3.35e12  # H100 SXM datasheet (dense), flop/s and bytes/s
GEMM_EFF, FUSED_EFF, BW_EFF, LAUNCH = 0.6, 0.5, 0.8, 4e-6  # choose_covariance's constants
EIGH_EFF = 0.05  # of SIMT: a guess (cuSOLVER's tridiagonal reduction is memory bound)

#: Category -> (floor rule, why). Rules: base (the baseline's), flops, keep, jvp, zero.
RULES: dict[str, tuple[str, str]] = {
    "forward": ("base", "the baseline's forward (same model and batch)"),
    "backward": ("base", "the baseline's backward"),
    "curvature backward (MC)": ("keep", "one sampled-target backward, already only the "
                                "edges nothing else precedes (docs/benchmarks.md, "
                                "KFAC's curvature passes)"),
    "factor statistics": ("flops", "GEMM flops at the run's best GEMM rate"),
    "communication": ("zero", "one process"),
    "decomposition": ("keep", "the configuration's schedule, amortised (KFAC's every 5 "
                      "converged slower: docs/training.md)"),
    "preconditioning": ("keep", "4 (eigen) / 2 (inverse) GEMMs a block at the core's rate; "
                        "batching per shape group measured, not kept "
                        "(bench/experiments/precondition_batching.py)"),
    "quadratic model": ("jvp", "two forward-mode replays; one vmapped pass measured, not "
                        "kept (bench/experiments/jvp_vmap.py); the rest removable"),
    "damping (LM rule)": ("keep", "the LM rule's loss at the new point"),
    "first-order update": ("keep", "the parameter update"),
    "overhead": ("zero", "Python bookkeeping"),
}
#: The targeted rows, in the table's order: TARGETS plus two more of the same issue (the
#: inverse method; KFAC with kfac-jax's inverse period).
_ORDER = (("resnet32", "kfac_pre 10/100 + sgd"), ("resnet32", "kfac_pre 1/10 + sgd"),
          ("gpt", "kfac_pre 10/100 + adamw"), ("gpt", "kfac_pre 10/100 inverse + adamw"),
          ("autoencoder", "kfac adaptive"), ("autoencoder", "kfac adaptive, inverses every 5"),
          ("gpt", "kfac adaptive"), ("gpt", "ekfac"))
_EXTRA = {("gpt", "kfac_pre 10/100 inverse + adamw"): 1.2,
          ("autoencoder", "kfac adaptive, inverses every 5"): 3.0}
ROWS = {k: TARGETS[k][0] if k in TARGETS else _EXTRA[k] for k in _ORDER}
assert set(TARGETS) <= set(ROWS), "a target of step_cost_report.TARGETS has no row here"
#: Rows whose tied embedding/head is a block (``layer_kinds`` with ``embedding``).
TIED = {"kfac_pre 10/100 + adamw", "kfac_pre 10/100 inverse + adamw", "ekfac"}


@dataclass
class Block:
    """One Kronecker block: rows per batch, A and G sides, A-factor flops on the CPU path."""

    rows: int
    a: int
    g: int
    pack: bool  # the CUDA covariance must build patches (conv, or a bias column)
    a_cpu_flops: float
    tied: bool = False


@dataclass
class Shapes:
    """A model at a step_cost.py size: its blocks, forward flops, aten ops and bytes."""

    blocks: list[Block]
    fwd_flops: float
    params: int
    ops: dict[str, int]  # forward / backward: non-view aten ops of one pass
    out_bytes: dict[str, float]  # bytes the pass's ops write, at the batch


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts non-view aten ops and the bytes their outputs hold."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops += 1
            flat = out if isinstance(out, tuple | list) else (out,)
            self.bytes += sum(t.numel() * t.element_size() for t in flat
                              if isinstance(t, torch.Tensor))
        return out


def model_of(task: str, smoke: bool) -> tuple[nn.Module, Callable[[int], torch.Tensor], int]:
    """step_cost.py's model of ``task`` (its sizes), inputs of ``n`` samples, the batch."""
    if task == "resnet32":
        side = 8 if smoke else 32
        return (models.resnet32(num_classes=10), lambda n: torch.randn(n, 3, side, side),
                4 if smoke else 128)
    if task == "autoencoder":
        dims, hidden = (32, (16, 8)) if smoke else (784, (400, 200, 100, 50, 25, 6))
        return (models.autoencoder(input_dim=dims, hidden_dims=hidden),
                lambda n: torch.rand(n, dims), 16 if smoke else 256)
    d, layers, context = (32, 2, 16) if smoke else (128, 4, 64)
    return (gpt(d_model=d, n_layers=layers, context=context, n_heads=4),
            lambda n: torch.randint(0, 256, (n, context)), 4 if smoke else 32)


def shapes(task: str, smoke: bool) -> Shapes:
    """Traces ``task``'s model (one sample, then two: the bytes' per-sample part)."""
    model, make, batch = model_of(task, smoke)
    blocks: list[Block] = []
    flops = [0.0]
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def hook(m: nn.Module, inp: tuple[torch.Tensor, ...], out: Any) -> None:
        if isinstance(m, nn.Conv2d):
            _, c, h, w = inp[0].shape
            rows = batch * out.shape[2] * out.shape[3]
            a = c * m.kernel_size[0] * m.kernel_size[1]
            flops[0] += 2 * rows * a * m.out_channels
            args = (m.kernel_size, m.stride, m.padding, m.dilation, m.groups)
            shifts = ((2 * m.kernel_size[0] - 1) * (2 * m.kernel_size[1] - 1) + 1) // 2
            cpu = (2 * shifts * c * c * batch * h * w
                   if supports_shifted(inp[0].expand(batch, -1, -1, -1), ConvArgs(*args))  # type: ignore[arg-type]
                   else 2 * rows * a * a)
            blocks.append(Block(rows, a, m.out_channels, True, cpu))
        elif isinstance(m, nn.Linear):
            rows = batch * inp[0].numel() // m.in_features
            flops[0] += 2 * rows * m.in_features * m.out_features
            if id(m.weight) in tied:  # A side the vocabulary, G the width (kaisa.blocks.tied)
                blocks.append(Block(rows, m.out_features, m.in_features, False,
                                    2 * rows * m.out_features ** 2, tied=True))
            else:
                a = m.in_features + (m.bias is not None)
                blocks.append(Block(rows, a, m.out_features, m.bias is not None, 2 * rows * a * a))
        elif isinstance(m, nn.MultiheadAttention):
            t, d = inp[0].shape[1], m.embed_dim
            rows = batch * t
            flops[0] += 2 * rows * d * 4 * d + 4 * batch * t * t * d
            for g in (3 * d, d):  # in_proj (q, k, v packed), out_proj
                blocks.append(Block(rows, d + 1, g, True, 2 * rows * (d + 1) ** 2))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, nn.Conv2d | nn.Linear | nn.MultiheadAttention)]
    model(make(1))
    for h in handles:
        h.remove()
    ops: dict[str, int] = {}
    written: dict[str, list[int]] = {"forward": [], "backward": []}
    for n in (1, 2):  # bytes = fixed (parameter gradients) + per sample x batch
        model.zero_grad(set_to_none=True)
        with _Ops() as fwd:
            out = model(make(n))
        with _Ops() as bwd:
            out.float().pow(2).mean().backward()
        for key, counter in (("forward", fwd), ("backward", bwd)):
            ops[key] = counter.ops
            written[key].append(counter.bytes)
    at_batch = {k: float(b1 + (b2 - b1) * (batch - 1)) for k, (b1, b2) in written.items()}
    return Shapes(blocks, flops[0], sum(p.numel() for p in model.parameters()), ops, at_batch)


def factor_flops(b: Block, cpu: bool) -> float:
    """GEMM flops of one block's factors at one factor step (tied: A_h, G_h and G_e)."""
    a = b.a_cpu_flops if cpu else 2 * b.rows * b.a ** 2
    return a + 2 * b.rows * b.g ** 2 * (2 if b.tied else 1)


def precondition_flops(b: Block, method: str) -> float:
    """Eigen: rotate into and out of both eigenbases (4 GEMMs); inverse: G^-1 grad A^-1."""
    return (4 if method == "eigen" else 2) * b.g * b.a * (b.g + b.a)


def covariance_s(rows: int, d: int, pack: bool) -> float:
    """choose_covariance's estimate (fp32 under TF32): the cheaper of fused and GEMM."""
    pairs = math.ceil(d / 64) * (math.ceil(d / 64) + 1) / 2
    fused = 2 * rows * pairs * 64 * 64 / (FUSED_EFF * SIMT) + LAUNCH
    gemm = (2 * rows * d * d / (GEMM_EFF * TF32) + (2 * rows * d * 4 / (BW_EFF * HBM) if pack
            else 0) + (2 if pack else 1) * LAUNCH + LAUNCH)
    return min(fused, gemm)


def decomposition_s(n: int, method: str, count: int) -> float:
    """A guess (module docstring): eigh or damped inverses of ``count`` n x n factors, one
    batched call per size group (the latency once, the flops per matrix)."""
    if method == "eigen":
        return count * 9 * n ** 3 / (EIGH_EFF * SIMT) + n * LAUNCH
    return count * 2 * n ** 3 / (GEMM_EFF * TF32) + (n / 64 + 3) * LAUNCH


def share(entry: dict[str, Any], letter: str) -> float:
    """The share of a schedule period's steps whose label has ``letter``."""
    return float(sum(v for k, v in entry["label_shares"].items() if letter in k))


def gpu_ms(s: Shapes, blocks: list[Block], entry: dict[str, Any], method: str,
           adam: bool) -> dict[str, float]:
    """Projected ms per phase (amortised like the measured split). Not measured."""
    def model(ops: int, flops: float, written: float) -> float:  # written once, read twice
        return ops * LAUNCH + flops / (GEMM_EFF * TF32) + 3 * written / (BW_EFF * HBM)

    fwd = model(s.ops["forward"], s.fwd_flops, s.out_bytes["forward"])
    bwd = model(s.ops["backward"], 2 * s.fwd_flops, s.out_bytes["backward"])
    update = 10 * LAUNCH + 4 * s.params * (7 if adam else 5) / (BW_EFF * HBM)
    out = {"forward": fwd, "backward": bwd, "first-order update": update}
    if entry.get("baseline") is None:
        return {k: 1e3 * v for k, v in out.items()}
    f, i, d = share(entry, "F"), share(entry, "I"), share(entry, "D")
    factors = sum(covariance_s(b.rows, b.a, b.pack) + covariance_s(b.rows, b.g, False)
                  * (2 if b.tied else 1) + 3 * LAUNCH for b in blocks)
    out["factor statistics"] = f * factors
    out["preconditioning"] = sum(precondition_flops(b, method) / (GEMM_EFF * TF32)
                                 + (7 if method == "eigen" else 4) * LAUNCH for b in blocks)
    sizes = [n for b in blocks for n in (b.a, b.g)]
    out["decomposition"] = i * sum(decomposition_s(n, method, sizes.count(n))
                                   for n in set(sizes))
    if entry["ms_by_category"].get("curvature backward (MC)", 0.0) > 0:  # kaisa.KFAC
        out["curvature backward (MC)"] = f * model(s.ops["backward"], s.fwd_flops,
                                                   s.out_bytes["backward"] / 2)
        out["quadratic model"] = 2 * model(2 * s.ops["forward"], 2 * s.fwd_flops,
                                           2 * s.out_bytes["forward"])
        out["damping (LM rule)"] = d * fwd
    return {k: 1e3 * v for k, v in out.items()}


def floor_row(task: str, name: str, entry: dict[str, Any], base: dict[str, Any],
              s: Shapes) -> dict[str, Any]:
    """One configuration: measured ms by category, the floor's and the GPU's."""
    cats: dict[str, float] = entry["ms_by_category"]
    paths: dict[str, float] = entry["ms_by_phase_path"]
    method = "inverse" if "inverse" in name or name.startswith("kfac adaptive") else "eigen"
    blocks = [b for b in s.blocks if not b.tied or name in TIED]
    f = share(entry, "F")
    fb_ms = base["ms_by_category"]["forward"] + base["ms_by_category"]["backward"]
    gflop = {"factors": f * sum(factor_flops(b, True) for b in blocks) / 1e9,
             "preconditioning": sum(precondition_flops(b, method) for b in blocks) / 1e9,
             "baseline forward+backward": 3 * s.fwd_flops / 1e9}
    rates = {"baseline forward+backward": 1e3 * gflop["baseline forward+backward"] / fb_ms,
             "factors": 1e3 * gflop["factors"] / (cats["factor statistics"] or math.nan),
             "preconditioning": 1e3 * gflop["preconditioning"]
             / (cats["preconditioning"] or math.nan)}
    best = max((k for k in rates if not math.isnan(rates[k])), key=lambda k: rates[k])
    floor: dict[str, float] = {}
    why: dict[str, str] = {}
    for cat, measured in cats.items():
        rule, reason = RULES[cat]
        if rule == "base":
            floor[cat] = base["ms_by_category"][cat]
        elif rule == "flops":
            floor[cat] = 1e3 * gflop["factors"] / rates[best]
            reason = (f"{gflop['factors']:.2f} GFLOP a step (amortised) at "
                      f"{rates[best]:.1f} GFLOP/s (this run's {best})")
        elif rule == "jvp":
            floor[cat] = sum(v for k, v in paths.items() if "jacobian_vector_products" in k)
        else:
            floor[cat] = measured if rule == "keep" else 0.0
        why[cat] = reason
    gpu = gpu_ms(s, blocks, entry, method, "adam" in str(entry["baseline"]))
    gpu_base = sum(gpu_ms(s, blocks, base, method, "adam" in str(entry["baseline"])).values())
    return {
        "task": task, "configuration": name, "baseline": entry["baseline"],
        "target": ROWS[(task, name)], "measured_ratio": entry["ratio"],
        "ms_per_step": entry["ms_per_step"], "baseline_ms_per_step": base["ms_per_step"],
        "ms_by_category": cats, "floor_ms_by_category": floor, "floor_rule": why,
        "floor_ratio": sum(floor.values()) / base["ms_per_step"],
        "gflop_per_step": gflop, "gflop_per_s": rates,
        "gpu_projection_ms_by_category": gpu, "gpu_projection_baseline_ms": gpu_base,
        "gpu_projection_ratio": sum(gpu.values()) / gpu_base,
    }


def rows_of(paths: list[Path]) -> list[dict[str, Any]]:
    """Every targeted configuration of the files (a later file's row wins)."""
    found: dict[tuple[str, str], tuple[Path, dict[str, Any], dict[str, Any], bool]] = {}
    for path in paths:
        results = json.loads(path.read_text())
        for task, entries in results["tasks"].items():
            for name, entry in entries.items():
                if (task, name) in ROWS and "ratio" in entry:
                    found[(task, name)] = (path, entry, entries[entry["baseline"]],
                                           bool(results.get("smoke")))
    traced: dict[tuple[str, bool], Shapes] = {}
    out = []
    for key in (k for k in ROWS if k in found):
        path, entry, base, smoke = found[key]
        if (key[0], smoke) not in traced:
            traced[(key[0], smoke)] = shapes(key[0], smoke)
        out.append({**floor_row(*key, entry, base, traced[(key[0], smoke)]), "source": path.name})
    return out


def _largest(ms: dict[str, float], n: int, digits: int) -> str:
    """The ``n`` largest K-FAC phases of ``ms`` (not the baseline's own)."""
    own = ("forward", "backward", "first-order update")
    top = sorted(((k, v) for k, v in ms.items() if k not in own and v > 0), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.{digits}f}" for k, v in top[:n])


def summary(rows: list[dict[str, Any]]) -> str:
    """The at-a-glance table (Markdown): measured, target, CPU floor, GPU projection."""
    lines = ["| task | configuration | measured | target | CPU floor | floor <= target | "
             "floor's largest K-FAC phases (ms) | GPU projection (not measured) | its largest "
             "K-FAC phases (ms) |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['configuration']} | {r['measured_ratio']:.2f}x "
            f"{r['baseline']} | <= {r['target']:g} | {r['floor_ratio']:.2f}x | "
            f"{'yes' if r['floor_ratio'] <= r['target'] else '**no**'} | "
            f"{_largest(r['floor_ms_by_category'], 3, 0)} | {r['gpu_projection_ratio']:.2f}x | "
            f"{_largest(r['gpu_projection_ms_by_category'], 2, 2)} |")
    return "\n".join(lines)


def detail(r: dict[str, Any]) -> str:
    """One configuration's phases: measured, floor (with its rule), GPU projection."""
    head = (f"{r['task']} / {r['configuration']} ({r['source']}): {r['measured_ratio']:.2f}x "
            f"{r['baseline']}, target <= {r['target']:g}, floor {r['floor_ratio']:.2f}x, GPU "
            f"projection {r['gpu_projection_ratio']:.2f}x "
            f"({r['gpu_projection_baseline_ms']:.2f} ms baseline; not measured)")
    lines = [head, "| phase | measured ms | floor ms | GPU ms (projection) | floor rule |",
             "|---|---|---|---|---|"]
    for cat, ms in r["ms_by_category"].items():
        gpu = r["gpu_projection_ms_by_category"].get(cat, 0.0)
        if ms > 0 or gpu > 0:
            lines.append(f"| {cat} | {ms:.1f} | {r['floor_ms_by_category'][cat]:.1f} | "
                         f"{gpu:.3f} | {r['floor_rule'][cat]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Prints the summary and per-configuration tables; writes the JSON."""
    parser = harness.parser(__doc__, RESULTS / "step_floor.json")
    parser.add_argument("paths", nargs="*", type=Path, help="step_cost JSONs, oldest first")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's form: the committed runs, summary table only")
    args = parser.parse_args(argv)
    paths = args.paths or list(DEFAULTS)
    rows = rows_of(paths)
    print(summary(rows))
    if not args.smoke:
        for r in rows:
            print("\n" + detail(r))
    root = harness.ROOT
    results = {"sources": [str(p.resolve().relative_to(root)) if p.resolve().is_relative_to(root)
                           else str(p) for p in paths],
               "gpu_assumptions": dict(
                   note="projection, not measured", tf32_flops=TF32, simt_flops=SIMT,
                   hbm_bytes=HBM, gemm_efficiency=GEMM_EFF, fused_efficiency=FUSED_EFF,
                   bandwidth_efficiency=BW_EFF, launch_s=LAUNCH, eigh_efficiency_guess=EIGH_EFF),
               "rows": rows}
    doc = harness.write(args.out, "step_floor", results, argv,
                        script="bench/step_cost/step_floor.py")
    print(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
