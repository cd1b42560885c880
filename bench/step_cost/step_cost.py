"""Per-step cost of kaisa's optimizers against their first-order baselines, and where it goes.

Tasks and configurations (each keeps its own model, built from the same seed):

* ``resnet32``: CIFAR ResNet-32, batch 128 of synthetic 3x32x32 inputs, cross-entropy.
  ``sgd`` (momentum 0.9) against ``KFACPreconditioner`` + SGD with factors every 10 /
  inverses every 100 (KAISA's settings) and factors every step / inverses every 10.
* ``autoencoder``: 784-400-200-100-50-25-6 (and back, tanh), batch 256 of synthetic
  inputs in [0, 1), MSE. ``adam`` against ``kaisa.KFAC(loss="mse")`` (adaptive, defaults)
  and the same with ``inv_update_steps=5`` (kfac-jax's ``inverse_update_period``).
* ``gpt``: ``bench/convergence/gpt.py``'s byte GPT (d 128, 4 layers, 4 heads, context 64, batch 32,
  its stdlib corpus). ``adamw`` and ``adam`` (lr 3e-3) against ``KFACPreconditioner`` +
  AdamW at factors every 10 / inverses every 100 (``bench/convergence/gpt.py``'s kinds and damping),
  ``kaisa.KFAC(loss="cross_entropy")`` (defaults; ``kfac adaptive double_backward``: with
  ``jvp="double_backward"``, every step under the math attention kernel; ``kfac adaptive
  reduce``: with ``kfac_approx="reduce"``) and
  ``kaisa.EKFAC`` (lr 3e-3, factors every step, eigenbases every 10, as in
  ``bench/convergence/gpt.py``; ``ekfac reduce``: with ``kfac_approx="reduce"``; ``ekfac rows256``:
  with ``factor_rows=256``, 256 of the 2048 rows of each Linear, attention and embedding
  call; ``ekfac rows256 linear only``: the same with the attention and tied-embedding blocks
  keeping every row, as ``factor_rows`` was first; ``ekfac rows256 qr``: with
  ``basis_refresh="qr"``; ``ekfac rows256 o256``: with one-sided bases above 256,
  ``max_basis_dim=256``, and that with factors every 2 steps (``f2``) or bases every 20
  (``b20``)). No clipping, no lr
  schedule. The configurations are built in ``bench/step_cost/step_cost_tasks.py``.

Protocol: one thread; ``--warmup`` steps, then ``--rounds`` rounds of ``--round-steps``
steps of every configuration of a task in turn (the order rotating), so a slow patch of
the machine hits all alike. Every step is labelled by what its schedule does (``F``
factors, ``I`` inverses/eigenbases, ``D`` the LM damping rule); the per-step cost is
``sum over labels of (the label's share of steps in one full schedule period) x (median
time of the timed steps with that label)``: an amortised median (ratio of these against
the baseline's median in the same run). Each step runs inside a
:class:`kaisa.utils.profiling.PhaseProfile`; the phase split is amortised the same way, phase
by phase. Memory: after timing, ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` (tensors of 64 KiB
and more get and return their own pages) and, per step, after ``malloc_trim(0)`` (the
heap's free memory back to the system), the peak resident set size
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus the resident size
at the step's start; the largest over ``--memory-steps`` steps (Linux only; RSS, not the
allocator's bytes).

    python bench/step_cost/step_cost.py               # the full run (tens of minutes, 1 core)
    python bench/step_cost/step_cost.py --smoke --out /tmp/s.json  # tiny, a few steps
    python bench/step_cost/step_cost.py --tasks resnet32,gpt --configs "kfac_pre 10/100 + sgd,\
        kfac_pre 1/10 + sgd,kfac_pre 10/100 + adamw" --conv-variants \
        --before bench/results/step_cost.json --out bench/results/step_cost_after.json

``--configs`` runs only the named configurations (and their baselines); ``--conv-variants``
adds each ResNet K-FAC schedule with the compiled conv kernel in place of the shifted
correlations of ``kaisa.ops._shifted`` (the same run's "before" of that change);
``--before`` prints an earlier JSON's ratios beside the new ones.

Writes ``bench/results/step_cost.json`` and a stacked-bar plot beside it (``.png``).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kaisa.utils.profiling import PhaseProfile, phase

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from step_cost_report import CATEGORIES, categorise, plot, table
from step_cost_tasks import (  # noqa: F401 (re-exported: bench/experiments/precondition_batching.py)
    COMPILED_CONV,
    TASKS,
    Runner,
    autoencoder_runners,
    gpt_runners,
    resnet_runners,
)

from bench import harness

RESULTS = harness.RESULTS


def selected(runners: list[Runner], configs: str | None) -> list[Runner]:
    """The runners named in ``configs`` (comma-separated; all when ``None``), their
    compiled-conv-kernel variants and their baselines; a task with none selected keeps none."""
    if configs is None:
        return runners
    names = {c.strip() for c in configs.split(",")}
    keep = {r.name for r in runners if r.name.removesuffix(COMPILED_CONV) in names}
    keep |= {r.baseline for r in runners if r.name in keep and r.baseline is not None}
    return [r for r in runners if r.name in keep]


def run_task(runners: list[Runner], warmup: int, rounds: int, per_round: int) -> None:
    """Warm-up, then interleaved timed rounds; fills ``times`` and ``phases`` by label."""
    for r in runners:
        for i in range(warmup):
            r.step(i)
    for k in range(rounds):
        for r in runners[k % len(runners):] + runners[: k % len(runners)]:
            for j in range(per_round):
                i = warmup + k * per_round + j
                with PhaseProfile() as profile:
                    start = time.perf_counter()
                    with phase("step"):
                        r.step(i)
                    elapsed = time.perf_counter() - start
                label = r.label(i)
                r.times.setdefault(label, []).append(elapsed)
                r.phases.setdefault(label, []).append(dict(profile.seconds))


def amortised(r: Runner) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
    """Amortised median seconds per step, its split by category and by phase path, the
    labels' shares."""
    labels = [r.label(s) for s in range(r.period)]
    shares = {lab: labels.count(lab) / r.period for lab in dict.fromkeys(labels)}
    if not r.times:  # --rounds 0: memory only
        return 0.0, dict.fromkeys(CATEGORIES, 0.0), {}, shares
    fallback = statistics.median(t for ts in r.times.values() for t in ts)
    total, split = 0.0, dict.fromkeys(CATEGORIES, 0.0)
    paths: dict[tuple[str, ...], float] = {}
    for lab, share in shares.items():
        times = r.times.get(lab)  # a label the timed steps missed (smoke): all steps' median
        total += share * (statistics.median(times) if times else fallback)
        rows = r.phases.get(lab) or [p for ps in r.phases.values() for p in ps]
        cats = [categorise(p) for p in rows]
        for cat in CATEGORIES:
            split[cat] += share * statistics.median(c.get(cat, 0.0) for c in cats)
        for path in {q for p in rows for q in p}:
            paths[path] = paths.get(path, 0.0) + share * statistics.median(
                p.get(path, 0.0) for p in rows)
    by_path = {"/".join(k): v for k, v in sorted(paths.items(), key=lambda kv: -kv[1])}
    return total, split, by_path, shares


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def peak_rss(r: Runner, start: int, steps: int) -> dict[str, float]:
    """Largest peak-RSS rise over one step, by label (MiB); empty where unsupported."""
    if not Path("/proc/self/clear_refs").exists():
        return {}
    peaks: dict[str, float] = {}
    libc = ctypes.CDLL("libc.so.6")
    for i in range(start, start + steps):
        libc.malloc_trim(0)  # free heap memory back to the system: RSS is what is live
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return {}
        before = _status()["VmRSS"]
        r.step(i)
        rise = (_status()["VmHWM"] - before) / 2**20
        peaks[r.label(i)] = max(peaks.get(r.label(i), 0.0), rise)
    return peaks


def phase_call_ns(calls: int = 20000) -> float:
    """Nanoseconds of one ``with phase(...)`` while no profile is active."""
    start = time.perf_counter()
    for _ in range(calls):
        with phase("x"):
            pass
    return 1e9 * (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the tasks, prints the table, writes the JSON and the plot."""
    parser = harness.parser(__doc__, RESULTS / "step_cost.json")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-steps", type=int, default=10)
    parser.add_argument("--memory-steps", type=int, default=10)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--replot", action="store_true",
                        help="only print the table and redraw the plot of --out")
    parser.add_argument("--configs", default=None,
                        help="comma-separated configuration names to run (with their baselines)")
    parser.add_argument("--conv-variants", action="store_true",
                        help="also run each ResNet K-FAC schedule with the compiled conv kernel")
    parser.add_argument("--before", type=Path, default=None,
                        help="an earlier result JSON: its ratios printed beside these")
    args = parser.parse_args(argv)
    before = json.loads(args.before.read_text()) if args.before is not None else None
    if args.replot:
        saved: dict[str, Any] = json.loads(args.out.read_text())
        print(table(saved, before))
        plot(saved, args.out.with_suffix(".png"))
        return saved
    if args.smoke:
        args.warmup, args.rounds, args.round_steps, args.memory_steps = 1, 1, 2, 1
    torch.set_num_threads(1)
    off_ns = phase_call_ns()
    loadavg_start = list(os.getloadavg())
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "protocol": {"warmup": args.warmup, "rounds": args.rounds,
                     "steps_per_round": args.round_steps, "memory_steps": args.memory_steps,
                     "cost": "amortised median (labels' shares x per-label medians)",
                     "memory": "peak RSS rise over a step (VmHWM reset via clear_refs), "
                               "mallopt(M_MMAP_THRESHOLD, 64 KiB), malloc_trim(0) before each "
                               "step, max over memory steps"},
        "phase_call_off_ns": off_ns,
        "tasks": {},
    }
    measured: dict[str, list[Runner]] = {}
    for task in args.tasks.split(","):
        runners = selected(resnet_runners(args.smoke, True)
                           if task == "resnet32" and args.conv_variants
                           else TASKS[task](args.smoke), args.configs)
        if not runners:
            continue
        print(f"[{task}] {', '.join(r.name for r in runners)}", flush=True)
        run_task(runners, args.warmup, args.rounds, args.round_steps)
        measured[task] = runners
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    first = args.warmup + args.rounds * args.round_steps
    for task, runners in measured.items():
        entries: dict[str, Any] = {}
        for r in runners:
            seconds, split, by_path, shares = amortised(r)
            entries[r.name] = {
                "baseline": r.baseline,
                "ms_per_step": 1e3 * seconds,
                "ms_by_category": {k: 1e3 * v for k, v in split.items()},
                "ms_by_phase_path": {k: 1e3 * v for k, v in by_path.items()},
                "label_shares": shares,
                "median_ms_by_label": {k: 1e3 * statistics.median(v) for k, v in r.times.items()},
                "steps_by_label": {k: len(v) for k, v in r.times.items()},
                "peak_rss_rise_mib_by_label": peak_rss(r, first, args.memory_steps),
                "kfac_state_mib": r.state_bytes() / 2**20,
            }
        for entry in entries.values():
            if entry["baseline"] is not None:
                base = entries[entry["baseline"]]
                entry["ratio"] = entry["ms_per_step"] / (base["ms_per_step"] or math.nan)
        results["tasks"][task] = entries
    if before is not None:
        results["before"] = str(args.before)
    print(table(results, before))
    results = harness.write(args.out, "step_cost", results, argv,
                            script="bench/step_cost/step_cost.py", loadavg_start=loadavg_start)
    if not args.no_plot:
        plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
    raise SystemExit(0)
