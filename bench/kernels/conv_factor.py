"""The conv A factor at ResNet-32's shapes: which computation is fastest on the CPU.

Issue #21's profile puts 55% of a ResNet-32 step with factors every step in the conv A
factors. This times, at batch 128 of CIFAR-size activations (the stride-1 3x3 layers:
10 at 16 channels 32x32, 9 at 32 channels 16x16, 9 at 64 channels 8x8, and the stem at
3 channels), one thread, in interleaved rounds (median per method):

* ``compiled``: the C++ CPU kernel ``torch.ops.kaisa.conv_covariance`` (tiled im2col and
  an upper-triangle blocked SYRK);
* ``shifted``: :func:`kaisa.ops._shifted.conv_covariance_shifted` (what
  :func:`kaisa.ops.conv_covariance` runs for these layers now);
* ``unfold + covariance``: ``F.unfold`` patches, then the compiled covariance kernel;
* ``unfold + matmul``: ``F.unfold`` patches and one ``P^T P`` (the reference).

and each one's float32 error against the float64 reference (max |error| / max |entry|).
``--crossover`` adds a scan of ``compiled`` against ``shifted`` over channels, image sides
and batch sizes (best of 5): where :data:`kaisa.ops._shifted.MIN_CHANNELS`,
``MIN_SIDE`` and ``MIN_POSITIONS`` come from.

    python bench/kernels/conv_factor.py [--rounds 7] [--crossover] \
        [--out bench/results/conv_factor.json]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from kaisa.ops._checks import ConvArgs
from kaisa.ops._shifted import conv_covariance_shifted

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

#: (channels, side, stride-1 3x3 layers of that shape in ResNet-32).
SHAPES = [(16, 32, 10), (32, 16, 9), (64, 8, 9), (3, 32, 1)]
BATCH = 128


def methods(x: torch.Tensor, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """The four computations of one layer's A factor (3x3, stride 1, padding 1)."""

    def compiled() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.conv_covariance(
            x, [3, 3], [1, 1], [1, 1], [1, 1], 1, False, scale)
        return out

    def unfold_covariance() -> torch.Tensor:
        conv = ConvArgs((3, 3), (1, 1), (1, 1), (1, 1), 1)
        patches = ref.conv_patches(x, conv, False)[0]
        return ops.covariance(patches, scale).unsqueeze(0)

    return {
        "compiled": compiled,
        "shifted": lambda: conv_covariance_shifted(x, (3, 3), (1, 1), False, scale),
        "unfold + covariance": unfold_covariance,
        "unfold + matmul": lambda: ref.conv_covariance(
            x, (3, 3), (1, 1), (1, 1), (1, 1), 1, False, scale),
    }


def crossover(gen: torch.Generator) -> list[dict[str, Any]]:
    """``compiled`` and ``shifted`` ms (best of 5) over channels, sides and batch sizes."""
    rows = []
    for channels, side in [(3, 32), (16, 32), (32, 16), (64, 8), (128, 8), (256, 4)]:
        for batch in (2, 8, 16, 32, 64):
            x = torch.randn(batch, channels, side, side, generator=gen)
            best = {}
            for name, fn in methods(x, 1.0).items():
                if name not in ("compiled", "shifted"):
                    continue
                fn()
                runs = []
                for _ in range(5):
                    start = time.perf_counter()
                    fn()
                    runs.append(time.perf_counter() - start)
                best[name] = 1e3 * min(runs)
            rows.append({"channels": channels, "side": side, "batch": batch,
                         "positions": batch * side * side, "best_ms": best,
                         "speedup": best["compiled"] / best["shifted"]})
            print(f"  C={channels} {side}x{side} batch {batch}: compiled "
                  f"{best['compiled']:.2f} ms, shifted {best['shifted']:.2f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Times every method at every shape; prints a table and writes the JSON."""
    parser = harness.parser(__doc__, harness.RESULTS / "conv_factor.json")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--crossover", action="store_true")
    args = parser.parse_args(argv)
    if not ops.extension_available():
        raise SystemExit(f"needs the compiled extension: {ops.extension_error()}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    loadavg_start = list(os.getloadavg())
    results: dict[str, Any] = {
        "protocol": f"batch {args.batch}, 3x3 stride 1 padding 1, no bias, float32; "
                    f"{args.rounds} interleaved rounds after one warm-up, median ms",
        "shapes": [],
    }
    totals: dict[str, float] = {}
    for channels, side, layers in SHAPES:
        x = torch.randn(args.batch, channels, side, side, generator=gen) + 0.5
        scale = 1.0 / (args.batch * side * side)
        truth = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 1, False, scale)
        fns = methods(x, scale)
        errors = {}
        for name, fn in fns.items():
            got = fn().double()
            errors[name] = float((got - truth).abs().max() / truth.abs().max())
        times = harness.interleaved(fns, args.rounds)  # fn() above was the warm-up
        ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        for name, value in ms.items():
            totals[name] = totals.get(name, 0.0) + layers * value
        results["shapes"].append({
            "channels": channels, "side": side, "layers": layers,
            "factor_dim": 9 * channels, "rows": args.batch * side * side,
            "median_ms": ms, "relative_error_float32": errors,
        })
        print(f"C={channels:3d} {side}x{side} (x{layers}): "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()), flush=True)
    results["ms_per_factor_step"] = totals
    if args.crossover:
        results["crossover"] = crossover(gen)
    print("all stride-1 3x3 layers of one ResNet-32 factor step: "
          + ", ".join(f"{n} {v:.0f} ms" for n, v in totals.items()))
    results = harness.write(args.out, "conv_factor", results, argv,
                            script="bench/kernels/conv_factor.py", loadavg_start=loadavg_start)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
