"""Distributed K-FAC benchmark: KAISA strategies on CPU/gloo with ResNet-32 shapes.

For 1, 2 and 4 ranks (spawned processes, gloo on 127.0.0.1, one thread per rank) it
trains a CIFAR ResNet-32 (``kaisa.train.models.resnet32``, 32x32 synthetic inputs, a small
batch per rank) wrapped in DistributedDataParallel with K-FAC (eigen, factors every step,
decompositions every ``--inv-update-steps`` steps) under each strategy, and reports per
configuration:

* median / mean iteration time (forward, backward, ``pre.step()``, ``optimizer.step()``),
* time ``pre.step()`` spends blocked waiting on K-FAC communication,
* payload bytes per step by kind: factor allreduce (every rank), decomposition and
  preconditioned-gradient broadcasts (sent by the source rank), max and sum over ranks,
* per-rank K-FAC memory (``pre.memory_usage()``).

All configurations of one world size run in the same processes, interleaved in rounds,
so machine noise hits them alike. ``comm_opt+noallreduce`` skips the factor allreduce
(the communicator's factor allreduces are replaced by local results) to measure what the
allreduce adds.

    python bench/distributed/distributed.py [--worlds 1 2 4] [--batch 8] [--rounds 4] [--iters 3]

Writes ``bench/results/distributed.json`` and prints a markdown table.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import kaisa
from kaisa.train import models

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

CONFIGS: dict[int, list[dict[str, Any]]] = {
    1: [dict(name="single", strategy="comm_opt")],
    2: [
        dict(name="comm_opt", strategy="comm_opt"),
        dict(name="mem_opt", strategy="mem_opt"),
        dict(name="comm_opt+sym", strategy="comm_opt", sym=True),
        dict(name="comm_opt+noallreduce", strategy="comm_opt", skip=True),
    ],
    4: [
        dict(name="comm_opt", strategy="comm_opt"),
        dict(name="hybrid_opt", strategy="hybrid_opt"),
        dict(name="mem_opt", strategy="mem_opt"),
        dict(name="comm_opt+sym", strategy="comm_opt", sym=True),
        dict(name="comm_opt+nofusion", strategy="comm_opt", bucket=0.0),
        dict(name="comm_opt+bucket2mb", strategy="comm_opt", bucket=2.0),
        dict(name="comm_opt+noallreduce", strategy="comm_opt", skip=True),
    ],
}


def _configs(world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    only = args.get("only")
    return [c for c in CONFIGS[world] if not only or c["name"] in only]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Run:
    """One configuration: model, DDP wrapper, preconditioner, optimizer, measurements."""

    def __init__(self, cfg: dict[str, Any], world: int, inv_update_steps: int) -> None:
        torch.manual_seed(0)
        self.cfg = cfg
        self.model = models.resnet32(num_classes=10)
        self.net: torch.nn.Module = DistributedDataParallel(self.model) if world > 1 else self.model
        self.pre = kaisa.KFACPreconditioner(
            self.net,
            grad_worker_fraction=cfg["strategy"],
            symmetry_aware=cfg.get("sym", False),
            allreduce_bucket_cap_mb=cfg.get("bucket", 25.0),
            factor_update_steps=1,
            inv_update_steps=inv_update_steps,
        )
        if cfg.get("skip", False):
            _skip_factor_allreduce(self.pre.communicator)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.iter_times: list[float] = []
        self.step_times: list[float] = []
        self.measured = 0

    def iteration(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.net(x), y).backward()
        mid = time.perf_counter()
        self.pre.step()
        step_done = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        if record:
            self.iter_times.append(end - start)
            self.step_times.append(step_done - mid)
            self.measured += 1

    def reset(self) -> None:
        self.pre.communicator.stats.reset()
        self.pre.reset_timings()

    def report(self) -> dict[str, Any]:
        stats = self.pre.communicator.stats
        n = max(self.measured, 1)
        return {
            "fraction": self.pre.grad_worker_fraction,
            "iter_times": self.iter_times,
            "step_times": self.step_times,
            "wait_per_step": {k: v / n for k, v in stats.wait_seconds.items()},
            "bytes_sent_per_step": {k: v / n for k, v in stats.bytes_sent.items()},
            "calls_per_step": {k: v / n for k, v in stats.calls.items()},
            "memory": self.pre.memory_usage(),
            "placement": self.pre.placement.describe() if self.pre.rank == 0 else "",
        }


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out_dir: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
    runs = [_Run(cfg, world, args["inv_update_steps"]) for cfg in _configs(world, args)]
    gen = torch.Generator().manual_seed(rank)
    batch = args["batch"]
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    for run in runs:
        for _ in range(args["warmup"]):
            run.iteration(x, y, record=False)
        run.reset()
    for _ in range(args["rounds"]):
        for run in runs:
            for _ in range(args["iters"]):
                barrier()
                run.iteration(x, y, record=True)
    barrier()
    result = [run.report() for run in runs]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.destroy_process_group()


def _run_world(world: int, args: dict[str, Any]) -> list[list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, args, out_dir)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"world {world}: exit codes {[p.exitcode for p in procs]}")
        out = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def _summarise(
    world: int, per_rank: list[list[dict[str, Any]]], args: dict[str, Any]
) -> list[dict[str, Any]]:
    rows = []
    for i, cfg in enumerate(_configs(world, args)):
        reps = [per_rank[r][i] for r in range(world)]
        # An iteration ends when the slowest rank ends it: use rank-max per iteration.
        iters = [max(t) for t in zip(*(rep["iter_times"] for rep in reps), strict=True)]
        steps = [max(t) for t in zip(*(rep["step_times"] for rep in reps), strict=True)]
        kinds = sorted({k for rep in reps for k in rep["bytes_sent_per_step"]})
        rows.append(
            {
                "world": world,
                "config": cfg["name"],
                "grad_worker_fraction": reps[0]["fraction"],
                "iter_median_s": statistics.median(iters),
                "iter_mean_s": statistics.fmean(iters),
                "step_median_s": statistics.median(steps),
                "wait_per_step_s_max_rank": max(sum(rep["wait_per_step"].values()) for rep in reps),
                "bytes_per_step_max_rank": {
                    k: max(rep["bytes_sent_per_step"].get(k, 0.0) for rep in reps) for k in kinds
                },
                "bytes_per_step_all_ranks": {
                    k: sum(rep["bytes_sent_per_step"].get(k, 0.0) for rep in reps) for k in kinds
                },
                "calls_per_step_max_rank": {
                    k: max(rep["calls_per_step"].get(k, 0.0) for rep in reps) for k in kinds
                },
                "memory_per_rank": [rep["memory"] for rep in reps],
                "placement": reps[0]["placement"],
            }
        )
    return rows


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["world"], r["config"]): r for r in rows}
    out: dict[str, Any] = {}
    for world in (2, 4):
        comm, mem = by.get((world, "comm_opt")), by.get((world, "mem_opt"))
        if comm and mem:
            c = max(m["decompositions"] for m in comm["memory_per_rank"])
            m = max(m["decompositions"] for m in mem["memory_per_rank"])
            out[f"w{world}_memopt_decomp_ratio"] = m / c
            out[f"w{world}_memopt_decomp_target"] = 1 / world + 0.1
            out[f"w{world}_memopt_decomp_ok"] = m / c <= 1 / world + 0.1
        sym = by.get((world, "comm_opt+sym"))
        if comm and sym:
            ratio = (
                sym["bytes_per_step_max_rank"]["factors"]
                / comm["bytes_per_step_max_rank"]["factors"]
            )
            out[f"w{world}_sym_factor_bytes_ratio"] = ratio
            out[f"w{world}_sym_ok"] = ratio <= 0.55
        skip = by.get((world, "comm_opt+noallreduce"))
        if comm and skip:
            over = comm["iter_median_s"] / skip["iter_median_s"] - 1
            out[f"w{world}_allreduce_overhead"] = over
            out[f"w{world}_allreduce_overhead_ok"] = over <= 0.10
    return out


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | config | fraction | iter median (s) | step() wait/step (ms) | "
        "factor allreduce B/step/rank | decomp bcast B/step (all ranks) | "
        "grad bcast B/step (all ranks) | max rank decomp MB | max rank total MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["bytes_per_step_max_rank"]
        ball = r["bytes_per_step_all_ranks"]
        mem = r["memory_per_rank"]
        lines.append(
            f"| {r['world']} | {r['config']} | {r['grad_worker_fraction']:.3g} | "
            f"{r['iter_median_s']:.3f} | {1000 * r['wait_per_step_s_max_rank']:.1f} | "
            f"{b.get('factors', 0):,.0f} | {ball.get('decompositions', 0):,.0f} | "
            f"{ball.get('gradients', 0):,.0f} | "
            f"{max(m['decompositions'] for m in mem) / 2**20:.2f} | "
            f"{max(m['total'] for m in mem) / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = harness.parser(__doc__, harness.RESULTS / "distributed.json")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=8, help="samples per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3, help="iterations per round")
    parser.add_argument("--inv-update-steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None, help="config names to run")
    ns = parser.parse_args()
    args = {
        "batch": ns.batch,
        "warmup": ns.warmup,
        "rounds": ns.rounds,
        "iters": ns.iters,
        "inv_update_steps": ns.inv_update_steps,
        "only": ns.only,
    }
    rows: list[dict[str, Any]] = []
    for world in ns.worlds:
        start = time.perf_counter()
        rows += _summarise(world, _run_world(world, args), args)
        print(f"world {world}: {time.perf_counter() - start:.1f}s", flush=True)
    result = {
        "model": "resnet32 (CIFAR shapes, 32x32 synthetic inputs)",
        "settings": {**args, "threads_per_rank": 1, "backend": "gloo", "device": "cpu"},
        "rows": rows,
        "targets": _targets(rows),
    }
    harness.write(ns.out, "distributed", result, script="bench/distributed/distributed.py",
                  indent=2)
    print(_markdown(rows))
    print(json.dumps(result["targets"], indent=2))


def _skip_factor_allreduce(comm: Any) -> None:
    """Benchmark only: factor allreduces return the local value (not the average)."""
    original = comm.allreduce_mean

    def local(tensor: torch.Tensor, *, symmetric: bool = False,
              kind: str = "factors") -> Any:
        if kind == "factors":
            return kaisa.distributed.protocol.DoneHandle(tensor)
        return original(tensor, symmetric=symmetric, kind=kind)

    comm.allreduce_mean = local


if __name__ == "__main__":
    main()

