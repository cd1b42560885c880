"""K-FAC step overhead of this checkout against another one, in one run.

    git worktree add /tmp/kaisa-base <commit>      # and build or copy its kaisa/_C*.so
    python bench/step_cost/before_after.py --baseline /tmp/kaisa-base [--iters 60]

One long-lived worker process per checkout builds the same model, optimiser and
preconditioner (SGD + K-FAC, eigen, factors every step, inverses every 10; or
``kaisa.KFAC`` with its defaults for the ``kfac_*`` models) on the same data; the
controller then asks them for one iteration at a time, alternating, so the two sides see
the same machine noise and their iteration times pair up. Models: the
digits autoencoder (64-256-128-64-16-mirror, batch 128: Python glue dominates) and a
CIFAR ResNet-20 (batch 32). Reports per model each side's median iteration time and the
ratio of medians (after / before: < 1 is faster), plus the median of the paired
ratios, and writes ``bench/results/before_after.json`` (rename it to keep it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

ROOT = harness.ROOT

_SETTLE_S = 0.05
MODELS = ("autoencoder", "resnet20", "kfac_autoencoder", "kfac_resnet20")
#: Further models, not in the default set: ``resnet32_10_100`` (CIFAR ResNet-32, batch 32,
#: SGD + KFACPreconditioner with factors every 10 steps and decompositions every 100: mostly
#: plain steps) and ``ekfac_gpt`` (the byte GPT of ``bench/step_cost/step_cost.py``, d 128,
#: 4 layers, context 64, batch 32, ``kaisa.EKFAC`` with its defaults).
EXTRA = ("resnet32_10_100", "ekfac_gpt")

_WORKER = textwrap.dedent(
    """
    import json, sys, time
    import torch, torch.nn.functional as F
    import kaisa
    try:
        from kaisa.train import models
    except ImportError:  # a baseline from before the model zoo moved under the app
        from kaisa import models
    torch.set_num_threads(int(sys.argv[1]))
    name = sys.argv[2]
    if name in ("resnet32_10_100", "ekfac_gpt"):
        torch.manual_seed(0)
        if name == "ekfac_gpt":
            from kaisa.train.models.gpt import gpt
            model = gpt(d_model=128, n_layers=4, context=64, n_heads=4)
            tokens = torch.randint(0, 256, (32, 65))
            x, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)
            opt = kaisa.EKFAC(model, lr=1e-3)
            step = opt.step
        else:
            model = models.resnet32(num_classes=10)
            x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
            sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            pre = kaisa.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
            def step():
                pre.step()
                sgd.step()
        print(json.dumps({"kaisa": kaisa.__file__}), flush=True)
        for line in sys.stdin:
            t0 = time.perf_counter()
            model.zero_grad()
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y).backward()
            step()
            print(time.perf_counter() - t0, flush=True)
        sys.exit(0)
    setups = {
        "autoencoder": (lambda: models.build_model("autoencoder", input_dim=64), (64,), 128),
        "resnet20": (lambda: models.resnet20(num_classes=10), (3, 32, 32), 32),
    }
    kfac = name.startswith("kfac_")
    build, shape, batch = setups[name.removeprefix("kfac_")]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(batch, *shape)
    y = torch.randint(0, 10, (batch,))
    mse = name.endswith("autoencoder")
    target = x if mse else y
    if kfac:
        opt = kaisa.KFAC(model, loss="mse" if mse else "cross_entropy")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10)
    print(json.dumps({"kaisa": kaisa.__file__}), flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        if kfac:
            opt.step(lambda: (model(x), target))
        else:
            opt.zero_grad()
            out = model(x)
            loss = F.mse_loss(out, x) if mse else F.cross_entropy(out, y)
            loss.backward()
            pre.step()
            opt.step()
        print(time.perf_counter() - t0, flush=True)
    """
)


class _Worker:
    """One checkout's training loop in a subprocess, one iteration per request."""

    def __init__(self, path: Path, model: str, threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(path), KAISA_BACKEND="ext")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(threads), model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(path),
        )
        assert self.proc.stdout is not None
        origin = json.loads(self.proc.stdout.readline())["kaisa"]
        if not origin.startswith(str(path)):
            raise RuntimeError(f"{path}: imported kaisa from {origin}")

    def iteration(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        # Let the other side's OpenMP workers stop spinning before this one runs.
        time.sleep(_SETTLE_S)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _compare(before: Path, after: Path, model: str, iters: int, threads: int) -> dict[str, object]:
    workers = {"before": _Worker(before, model, threads), "after": _Worker(after, model, threads)}
    times: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for i in range(iters + 10):  # the first 10 iterations (both sides) are warm-up
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            sample = {side: workers[side].iteration() for side in order}
            if i >= 10:
                for side in sample:
                    times[side].append(sample[side])
    finally:
        for w in workers.values():
            w.close()
    med = {side: statistics.median(t) for side, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["after"], times["before"], strict=True))
    return {
        "before_ms": round(1e3 * med["before"], 3),
        "after_ms": round(1e3 * med["after"], 3),
        "ratio_of_medians_after_over_before": round(med["after"] / med["before"], 3),
        "median_paired_ratio": round(paired, 3),
        "times_s": times,
    }


def _commit(path: Path) -> str | None:
    """The baseline checkout's commit."""
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=path, text=True,
                              capture_output=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    """Runs the comparison and writes the JSON."""
    parser = harness.parser(__doc__, harness.RESULTS / "before_after.json")
    parser.add_argument("--baseline", type=Path, required=True, help="other checkout")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + EXTRA)
    args = parser.parse_args()
    before = args.baseline.resolve()
    summary = {}
    for model in args.models:
        summary[model] = _compare(before, ROOT, model, args.iters, args.threads)
        s = summary[model]
        print(f"{model}: before {s['before_ms']} ms, after {s['after_ms']} ms, ratio of medians "
              f"{s['ratio_of_medians_after_over_before']}, median paired ratio "
              f"{s['median_paired_ratio']}", flush=True)
    doc = {
        "description": "median iteration time, two checkouts alternating iteration by "
        "iteration; ratio < 1 means this checkout is faster. autoencoder/resnet20: SGD + "
        "KFACPreconditioner (eigen, factors every step, inverses every 10); kfac_*: kaisa.KFAC "
        "with its defaults (adaptive lr/momentum/damping, MC Fisher)",
        "baseline": _commit(before),
        "iters": args.iters, "threads": args.threads,
        "summary": summary,
    }
    harness.write(args.out, "before_after", doc, script="bench/step_cost/before_after.py",
                  indent=2, baseline_commit=_commit(before))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
