"""Optimizer step cost on a GPU, as ratios against the first-order baseline in one process.

Tasks (synthetic inputs; every model of a task built from the same seed):

* ``resnet50``: ResNet-50 at ImageNet shapes (batch 32 of 3x224x224, 1000 classes),
  cross-entropy (``--tiny``: a CIFAR ResNet-20 on 32x32 inputs in its place). ``sgd``
  (momentum 0.9) against ``KFACPreconditioner`` + SGD with factors every 10 and
  eigendecompositions every 100 steps (KAISA's 10/100).
* ``gpt``: the byte GPT at a GPU size (d 768, 12 layers, 12 heads, context 1024, batch 8)
  under bf16 autocast. ``adamw`` (lr 3e-3) against ``torch.optim.Muon`` (lr 0.05 on the
  blocks' matrices, AdamW on the rest), ``kaisa.EKFAC`` (lr 3e-3, factors every
  step, eigenbases every 10) and ``kaisa.KFACMuon`` with ``curvature`` ``'input'`` and
  ``'eigen'`` (Muon's groups and learning rates; factors every step, a refresh every 10),
  whose baseline is Muon.
* ``autoencoder``: 784-400-200-100-50-25-6 and back (batch 256), MSE. ``adam`` against
  ``kaisa.KFAC(loss="mse")`` (adaptive, defaults).

Protocol: the configurations of a task are built together; ``--warmup`` steps each, then
``--rounds`` rounds of ``--round-steps`` steps of every configuration in turn (the order
rotating; the defaults per task, ``STEPS``, time each schedule's rarest step at least
once). Each step is timed on the host between two device synchronisations and
labelled by what its schedule does (``F`` factors, ``I`` eigendecompositions, ``D`` the
damping rule, ``-`` none); the per-step cost is the amortised median: the sum over labels
of (the label's share of one schedule period) x (the median of its timed steps), and the
ratio is that against the baseline's. The first warm-up step of each label is run under a
``TorchDispatchMode`` that counts its operator calls (each at least a kernel launch):
``calls`` per label. Peak memory: ``torch.cuda.max_memory_allocated``
over each configuration's last round (all the task's models are resident).

Captured: after the timed rounds, each configuration's most frequent step (a plain one for
``KFACPreconditioner``, a factor step for EKFAC) is captured in a CUDA graph
(``torch.cuda.graph``, after three warm-up steps of that label on a side stream) and
replayed ``CAPTURE_REPLAYS`` times: ``captured`` holds its median ms and ratio, or why
it could not be captured (a host synchronisation in the step, an operation a graph
cannot hold). Replays repeat the recorded kernels only (no Python runs), so they time the
launch-free step, not training.

    python bench/gpu/step_cost.py --out /tmp/step_cost.json           # on a GPU
    python bench/gpu/step_cost.py --device cpu --tiny --out /tmp/s.json  # plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kaisa
from kaisa.train.models import autoencoder
from kaisa.train.models.gpt import gpt
from kaisa.train.models.resnet import resnet20
from kaisa.train.models.resnet_imagenet import resnet50


@dataclass
class Config:
    """One optimizer configuration of a task."""

    name: str
    baseline: str | None
    step: Callable[[int], None]
    every: dict[str, int] = field(default_factory=dict)  # label letter -> period
    times: dict[str, list[float]] = field(default_factory=dict)
    peak_bytes: int | None = None
    calls: dict[str, int] = field(default_factory=dict)  # label -> operator calls of a step

    def label(self, i: int) -> str:
        """What the schedule does at step ``i``."""
        return "".join(k for k, n in self.every.items() if i % n == 0) or "-"

    @property
    def period(self) -> int:
        """Steps after which the labels repeat."""
        return math.lcm(*self.every.values()) if self.every else 1


@dataclass(frozen=True)
class Setup:
    """Sizes and step counts of a run."""

    device: torch.device
    tiny: bool
    warmup: int
    rounds: int
    round_steps: int

    def sync(self) -> None:
        """Waits for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Calls(TorchDispatchMode):
    """Operator calls that reach the dispatcher (views included): each is at least a launch."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def train_step(model: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               batch: tuple[torch.Tensor, torch.Tensor], optimizer: torch.optim.Optimizer,
               pre: Any = None, autocast: torch.dtype | None = None) -> Callable[[int], None]:
    """A forward/backward/step closure (``pre.step()`` first, the preconditioner's)."""
    x, y = batch
    device = x.device.type

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        ctx = (torch.autocast(device, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with ctx:
            value = loss(model(x), y)
        value.backward()  # type: ignore[no-untyped-call]
        if pre is not None:
            pre.step()
        optimizer.step()

    return step


def resnet50_configs(s: Setup) -> tuple[list[Config], dict[str, Any]]:
    """SGD and KFACPreconditioner(10/100) + SGD on ResNet-50."""
    batch, side = (2, 32) if s.tiny else (32, 224)
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(batch, 3, side, side, generator=gen).to(s.device),
            torch.randint(0, 1000, (batch,), generator=gen).to(s.device))

    def build() -> nn.Module:  # tiny (the dry run): a CIFAR ResNet-20 in its place
        torch.manual_seed(0)
        return (resnet20(num_classes=1000) if s.tiny else resnet50()).to(s.device)

    model = build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    configs = [Config("sgd", None, train_step(model, F.cross_entropy, data, sgd))]
    model = build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100,
                                   lr=0.1, damping=0.003)
    configs.append(Config("kfac_pre 10/100 + sgd", "sgd",
                          train_step(model, F.cross_entropy, data, sgd, pre),
                          {"F": 10, "I": 100}))
    return configs, {"model": "resnet20" if s.tiny else "resnet50", "batch": batch,
                     "image": side, "classes": 1000}


def gpt_configs(s: Setup) -> tuple[list[Config], dict[str, Any]]:
    """AdamW, Muon, EKFAC and KFACMuon (both curvatures) on the byte GPT under bf16 autocast."""
    sizes = (dict(d_model=32, n_layers=2, n_heads=4, context=16) if s.tiny else
             dict(d_model=768, n_layers=12, n_heads=12, context=1024))
    batch = 2 if s.tiny else 8
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, sizes["context"] + 1), generator=gen).to(s.device)
    data = (tokens[:, :-1], tokens[:, 1:])

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())

    def build() -> nn.Module:
        torch.manual_seed(0)
        return gpt(**sizes).to(s.device)

    bf16 = torch.bfloat16
    model = build()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    configs = [Config("adamw", None, train_step(model, loss, data, adamw, autocast=bf16))]
    model = build()
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    muon = torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1)
    rest_adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1)
    both = _Both(muon, rest_adamw)
    configs.append(Config("muon", "adamw", train_step(model, loss, data, both, autocast=bf16)))
    model = build()
    ekfac = kaisa.EKFAC(model, lr=3e-3, weight_decay=0.1, factor_update_steps=1,
                        basis_update_steps=10)
    configs.append(Config("ekfac", "adamw", train_step(model, loss, data, ekfac, autocast=bf16),
                          {"F": 1, "I": 10}))
    model = build()  # the warm refresh against the default eigh: what a default change needs
    ekfac_qr = kaisa.EKFAC(model, lr=3e-3, weight_decay=0.1, factor_update_steps=1,
                           basis_update_steps=10, basis_refresh="qr")
    configs.append(Config("ekfac qr", "ekfac",
                          train_step(model, loss, data, ekfac_qr, autocast=bf16),
                          {"F": 1, "I": 10}))
    for mode in ("input", "eigen"):  # KFACMuon's curvatures against Muon, as muon's groups
        model = build()
        named = dict(model.named_parameters())
        chosen = [p for n, p in named.items() if p.ndim == 2 and n.startswith("blocks.")]
        others = [p for p in named.values() if all(p is not q for q in chosen)]
        kfac_muon = kaisa.KFACMuon(model, lr=0.05, weight_decay=0.1, curvature=mode,
                                   param_groups=[{"params": chosen},
                                                 {"params": others, "lr": 3e-3,
                                                  "weight_decay": 0.1}])
        configs.append(Config(f"kfac-muon {mode}", "muon",
                              train_step(model, loss, data, kfac_muon, autocast=bf16),
                              {"F": 1, "I": 10}))
    params = sum(p.numel() for p in model.parameters())
    return configs, {**sizes, "batch": batch, "autocast": "bf16", "parameters": params}


class _Both(torch.optim.Optimizer):
    """Two optimizers stepped as one (Muon on the matrices, AdamW on the rest)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()


def autoencoder_configs(s: Setup) -> tuple[list[Config], dict[str, Any]]:
    """Adam and adaptive kaisa.KFAC on the deep autoencoder."""
    dims, hidden, batch = ((32, (16, 8), 16) if s.tiny else
                           (784, (400, 200, 100, 50, 25, 6), 256))
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, dims, generator=gen).to(s.device)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return autoencoder(input_dim=dims, hidden_dims=hidden).to(s.device)

    model = build()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    configs = [Config("adam", None, train_step(model, F.mse_loss, (x, x), adam))]
    model = build()
    kfac = kaisa.KFAC(model, loss="mse")

    def kfac_step(i: int, model: nn.Module = model) -> None:
        kfac.step(lambda: (model(x), x))

    configs.append(Config("kfac adaptive", "adam", kfac_step,
                          {"F": 1, "I": 1, "D": kfac.config.damping_interval}))
    return configs, {"dims": [dims, *hidden], "batch": batch}


TASKS: dict[str, Callable[[Setup], tuple[list[Config], dict[str, Any]]]] = {
    "resnet50": resnet50_configs, "gpt": gpt_configs, "autoencoder": autoencoder_configs,
}


def time_task(configs: list[Config], s: Setup) -> None:
    """Warm-up, then interleaved timed rounds; fills each config's ``times`` by label."""
    for c in configs:
        for i in range(s.warmup):  # the first warm-up step of each label is counted
            if c.label(i) in c.calls:
                c.step(i)
                continue
            counter = Calls()
            with counter:
                c.step(i)
            c.calls[c.label(i)] = counter.n
    s.sync()
    for k in range(s.rounds):
        for c in configs[k % len(configs):] + configs[: k % len(configs)]:
            last = k == s.rounds - 1
            if last and s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(s.device)
            for j in range(s.round_steps):
                i = s.warmup + k * s.round_steps + j
                start = time.perf_counter()
                c.step(i)
                s.sync()
                c.times.setdefault(c.label(i), []).append(time.perf_counter() - start)
            if last and s.device.type == "cuda":
                c.peak_bytes = torch.cuda.max_memory_allocated(s.device)


CAPTURE_REPLAYS = 20


def run_until(c: Config, i: int, label: str, count: int) -> int:
    """Runs ``c``'s steps from ``i`` until the next ``count`` all have ``label``; that step.

    A schedule's own counter (the preconditioner's) follows the calls, so the steps
    captured next are the kind the labels say.
    """
    while any(c.label(i + k) != label for k in range(count)):
        c.step(i)
        i += 1
    return i


def captured_ms(c: Config, s: Setup, next_step: int) -> dict[str, Any]:
    """The median ms of a CUDA-graph replay of ``c``'s most frequent step, or why not.

    Steps run uncaptured until the next four steps all have that label (a schedule's own
    counter follows the calls), then three warm up on a side stream and the fourth is
    captured.
    """
    labels = [c.label(i) for i in range(c.period)]
    target = max(dict.fromkeys(labels), key=labels.count)
    if s.device.type != "cuda":
        return {"label": target, "error": "not run: CUDA graphs need a CUDA device"}
    try:
        i = run_until(c, next_step, target, 4)
        side = torch.cuda.Stream(s.device)
        side.wait_stream(torch.cuda.current_stream(s.device))
        with torch.cuda.stream(side):
            for k in range(3):
                c.step(i + k)
        torch.cuda.current_stream(s.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.step(i + 3)
        s.sync()
        times = []
        for _ in range(CAPTURE_REPLAYS):
            start = time.perf_counter()
            graph.replay()
            s.sync()
            times.append(time.perf_counter() - start)
        return {"label": target, "median_ms": round(1e3 * statistics.median(times), 3)}
    except Exception as err:  # what stops a capture is the finding
        return {"label": target, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def amortised_ms(c: Config) -> tuple[float, dict[str, Any]]:
    """Amortised median milliseconds per step, and each label's share, median and count."""
    labels = [c.label(i) for i in range(c.period)]
    every = [t for ts in c.times.values() for t in ts]
    total, split = 0.0, {}
    for lab in dict.fromkeys(labels):
        share = labels.count(lab) / c.period
        times = c.times.get(lab)  # a label the timed steps missed (tiny runs): all steps
        med = statistics.median(times if times else every)
        total += share * med
        split[lab] = {"share": share, "median_ms": round(1e3 * med, 3),
                      "timed_steps": len(times or [])}
    return 1e3 * total, split


def run_task(name: str, s: Setup) -> dict[str, Any]:
    """One task's table: per configuration its amortised ms, ratio and peak memory."""
    t0 = time.perf_counter()
    configs, sizes = TASKS[name](s)
    time_task(configs, s)
    next_step = s.warmup + s.rounds * s.round_steps
    captured = {c.name: captured_ms(c, s, next_step) for c in configs}
    rows: dict[str, Any] = {}
    for c in configs:
        ms, split = amortised_ms(c)
        for label, n in c.calls.items():  # a whole step's calls (forward, backward, steps)
            split.setdefault(label, {})["calls"] = n
        rows[c.name] = {"ms_per_step": round(ms, 3), "baseline": c.baseline, "labels": split,
                        "peak_gib": (round(c.peak_bytes / 2**30, 3)
                                     if c.peak_bytes is not None else None),
                        "captured": captured[c.name]}
    for row in rows.values():
        base = row["baseline"]
        row["ratio"] = round(row["ms_per_step"] / rows[base]["ms_per_step"], 3) if base else None
        mine, theirs = row["captured"], rows[base]["captured"] if base else {}
        if base and "median_ms" in mine and "median_ms" in theirs:
            mine["ratio"] = round(mine["median_ms"] / theirs["median_ms"], 3)
    del configs
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"sizes": sizes, "configs": rows, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    """Runs the tasks within ``--budget`` seconds and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models, a few steps")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--round-steps", type=int, default=None)
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds; a task that would start after them is not run")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default $KAISA_BENCH_OUT or bench/results/)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for the plumbing check")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    env_out = os.environ.get("KAISA_BENCH_OUT")
    out = args.out or (Path(env_out) if env_out else
                       Path(__file__).resolve().parents[1] / "results" / "step_cost_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    tasks: dict[str, Any] = {}
    payload = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "tiny": args.tiny, "protocol": {}, "tasks": tasks,
    }
    for name in [t.strip() for t in args.tasks.split(",")]:
        # per task: the fewest steps that time each schedule's rarest step at least once
        # (ResNet-50: 3 + 5 x 21 = 108 > 100; GPT: 3 + 2 x 12 = 27 > 20)
        defaults = (2, 1, 2) if args.tiny else STEPS.get(name, (3, 3, 10))
        s = Setup(device, args.tiny, *(v if v is not None else d for v, d in zip(
            (args.warmup, args.rounds, args.round_steps), defaults, strict=True)))
        payload["protocol"][name] = {"warmup": s.warmup, "rounds": s.rounds,
                                     "round_steps": s.round_steps}
        left = deadline - time.perf_counter()
        if not args.tiny and left < ESTIMATE_S.get(name, 30.0) * 0.5:
            tasks[name] = {"error": f"not run: {left:.0f} s left of the budget"}
            continue
        print(f"--- {name}", flush=True)
        try:
            tasks[name] = run_task(name, s)
        except Exception as err:  # one broken task does not hide the others' numbers
            tasks[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(json.dumps(tasks[name], indent=1), flush=True)
        # after every task: a run cut short keeps the tasks it finished
        out.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in t for t in tasks.values()) else 1


STEPS = {"resnet50": (3, 5, 21), "gpt": (3, 2, 12), "autoencoder": (3, 3, 10)}
"""Warm-up steps, rounds and steps a round per task (``--warmup`` etc. override)."""

ESTIMATE_S = {"resnet50": 40.0, "gpt": 100.0, "autoencoder": 15.0}
"""Seconds a task takes on an H100 (ResNet-50 measured: 34 s): one that would start with
less than half of it left is not run."""


if __name__ == "__main__":
    sys.exit(main())
