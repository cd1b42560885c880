"""DDP vs FSDP2 under K-FAC: per-rank memory, step time and communication, 1/2/4 gloo ranks.

The byte-level GPT of ``kaisa.train.models`` (tied embedding and head, pre-norm Transformer
blocks; ``layer_kinds="all"``: attention, feed-forward, embedding and LayerNorm blocks)
trains with ``kaisa.KFACPreconditioner`` + SGD (momentum 0.9) on random bytes, float32,
on 1, 2 and 4 spawned CPU processes (gloo on 127.0.0.1, one thread each). Four
configurations per world size, one after the other in the same processes:

* ``ddp``: ``DistributedDataParallel`` (every rank holds the whole model, its gradients
  and the optimizer state);
* ``fsdp2``: ``fully_shard`` on every Transformer block and on the root (parameters,
  gradients and optimizer state sharded on dim 0; K-FAC gathers each block's gradient to
  its gradient workers only, ``kaisa.distributed.fsdp``);

each with ``grad_worker_fraction`` MEM-OPT (each block's decompositions on one rank) and
COMM-OPT (on every rank). With one rank, MEM-OPT and COMM-OPT are the same.

Per rank and configuration it measures

* tensor bytes held after the timed steps: parameters, gradients and optimizer state
  (the local shards under FSDP2), K-FAC running factors and decompositions
  (``pre.memory_usage()``);
* the peak RSS above the RSS before the configuration was built (``VmHWM`` of
  ``/proc/self/status`` after resetting it through ``/proc/self/clear_refs``; glibc's
  mmap threshold is fixed at 128 KiB so freed tensors leave the RSS): everything the
  configuration allocated at its peak, transient buffers included (FSDP2's unsharded
  blocks, DDP's buckets, K-FAC's batch factors and gathered gradients), over the whole
  run (building, the decomposition step, the steps) and over the timed steps alone
  (``steady``);
* the step time (forward, backward, ``pre.step()``, ``optimizer.step()``; an iteration's
  time is the slowest rank's), median over the timed steps; decompositions are computed
  at the first (untimed) step only, so the timed steps are the steady state between two
  decompositions;
* the bytes each rank sends per step: the model's data-parallel traffic (DDP's
  allreduce buckets, counted in a communication hook; FSDP2's all-gathers and
  reduce-scatters, counted by wrapping ``torch.distributed.all_gather_single`` and
  ``reduce_scatter_single``) and K-FAC's (``pre.communicator.stats``), as the bytes a
  ring algorithm sends: ``2(k-1)/k`` of an allreduce's buffer, ``(k-1)/k`` of an
  all-gather's output or a reduce-scatter's input (``k`` ranks), the whole buffer of a
  reduce (FSDP2's factor reduce to the owners: a reduce-scatter and a gather to the
  owner); a broadcast counts on
  its source; an all-to-all counts what goes to other ranks. The decompositions' broadcast
  (at the first step) is reported apart, per decomposition.

    python bench/distributed/fsdp_memory.py            # bench/results/fsdp_memory.json/.png
    python bench/distributed/fsdp_memory.py --smoke --out /tmp/f.json   # tiny sizes, 2 ranks

The machine is shared and oversubscribed at 4 ranks (2 cores): step times are noisy;
the memory and byte counts are not.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import json
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import kaisa
from kaisa.train.models import GPT

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness
from bench.distributed import ranks

RESULTS = harness.RESULTS
CONFIGS = (("ddp", "mem_opt"), ("ddp", "comm_opt"), ("fsdp2", "mem_opt"), ("fsdp2", "comm_opt"))
SIZES: dict[str, dict[str, int]] = {
    "full": dict(d_model=192, n_layers=4, n_heads=4, context=64, batch=4, warmup=2, steps=5),
    "smoke": dict(d_model=32, n_layers=1, n_heads=2, context=16, batch=2, warmup=1, steps=2),
}
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "factors", "decompositions")


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class _Traffic:
    """Bytes the model's data-parallel collectives send from this rank (ring estimates)."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self._gather = dist.all_gather_single
        self._scatter = dist.reduce_scatter_single
        dist.all_gather_single = self._all_gather  # type: ignore[assignment]
        dist.reduce_scatter_single = self._reduce_scatter  # type: ignore[assignment]

    def _share(self, t: torch.Tensor, group: Any) -> None:
        k = dist.get_world_size(group)
        self.bytes += _nbytes(t) * (k - 1) / k

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, *args: Any,
                    **kwargs: Any) -> Any:
        self._share(output, kwargs.get("group"))
        return self._gather(output, input, *args, **kwargs)

    def _reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        self._share(kwargs["input"], kwargs.get("group"))
        return self._scatter(*args, **kwargs)

    def ddp_hook(self, bucket: Any) -> Any:
        """DDP's allreduce, counted."""
        k = dist.get_world_size()
        self.bytes += 2 * _nbytes(bucket.buffer()) * (k - 1) / k
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def _kfac_bytes(stats: dict[str, float], world: int) -> dict[str, float]:
    """K-FAC's counters as bytes sent: the factor allreduce as a ring sends it
    (``2(k-1)/k``), the factor reduce to the owners (FSDP2) as a reduce-scatter and a
    gather to the owner (``(k-1)/k + 1/k``: the whole buffer)."""
    return {kind: n * (2 * (world - 1) / world if kind == "factors" else 1.0)
            for kind, n in stats.items()}


def _measure(wrap: str, strategy: str, rank: int, world: int, size: dict[str, int],
             traffic: _Traffic) -> dict[str, Any]:
    gc.collect()
    rss0 = _status_kb("VmRSS")
    _reset_peak()
    torch.manual_seed(0)
    model = GPT(vocab_size=256, d_model=size["d_model"], n_layers=size["n_layers"],
                n_heads=size["n_heads"], context=size["context"])
    net: torch.nn.Module = model
    if wrap == "ddp":
        ddp = DistributedDataParallel(model)
        # A lambda: DDP refuses a hook whose annotations are not GradBucket and Future.
        ddp.register_comm_hook(None, lambda state, bucket: traffic.ddp_hook(bucket))
        net = ddp
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    pre = kaisa.KFACPreconditioner(net, grad_worker_fraction=strategy, layer_kinds="all",
                                   factor_update_steps=1, inv_update_steps=10**6, lr=0.05,
                                   damping=0.01, kl_clip=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    stats = pre.communicator.stats
    losses: list[float] = []

    def step() -> None:
        tokens = torch.randint(0, 256, (size["batch"], size["context"] + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        pre.step()
        opt.step()
        losses.append(float(loss))

    stats.reset()
    step()  # decomposes
    decomposition_bytes = stats.bytes_sent.get("decompositions", 0)
    for _ in range(size["warmup"] - 1):
        step()
    stats.reset()
    traffic.bytes = 0.0
    peak = (_status_kb("VmHWM") - rss0) * 1024  # building, decomposing, warm-up steps
    _reset_peak()
    times = []
    for _ in range(size["steps"]):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    steady = (_status_kb("VmHWM") - rss0) * 1024  # the timed steps
    usage = pre.memory_usage()
    memory = {
        "parameters": sum(_nbytes(p) for p in model.parameters()),
        "gradients": sum(_nbytes(p.grad) for p in model.parameters()),
        "optimizer": sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor)),
        "factors": usage["factors"],
        "decompositions": usage["decompositions"],
    }
    steps = size["steps"]
    out = {
        "wrap": wrap,
        "strategy": strategy,
        "fraction": float(pre.curvature.engine.grid.fraction),
        "memory": memory,
        "tensor_bytes": sum(memory.values()),
        "peak_rss_delta": max(peak, steady),
        "steady_peak_rss_delta": steady,
        "times": times,
        "model_bytes_per_step": traffic.bytes / steps,
        "kfac_bytes_per_step": {k: v / steps for k, v in
                                _kfac_bytes({k: float(v) for k, v in stats.bytes_sent.items()},
                                            world).items()},
        "decomposition_bytes": decomposition_bytes,
        "loss": losses[-1],
    }
    pre.remove_hooks()
    return out  # everything built here is freed (the next configuration collects first)


def _worker(rank: int, world: int, port: int, size: dict[str, int], out_dir: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    traffic = _Traffic()
    for wrap in ("ddp", "fsdp2"):  # one-time costs (libraries, threads) before measuring
        _measure(wrap, "comm_opt", rank, world, SIZES["smoke"], traffic)
    rows = [_measure(wrap, strategy, rank, world, size, traffic) for wrap, strategy in CONFIGS]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _spawnable_worker() -> Any:
    """:func:`_worker` from a module the spawned processes can import by name.

    Also when this file was loaded by path (``tests/support/bench.py``): spawn pickles a
    function by its module's name and passes ``sys.path`` on.
    """
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("fsdp_memory")._worker


def _run_world(world: int, size: dict[str, int], timeout: float) -> list[list[dict[str, Any]]]:
    # Freed tensors above 128 KiB go back to the OS, so the RSS follows what is held.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    return ranks.spawn_ranks(_spawnable_worker(), world, (size,), timeout)


def _summarise(world: int, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for i, (wrap, strategy) in enumerate(CONFIGS):
        reps = [per_rank[r][i] for r in range(world)]
        iters = [max(t) for t in zip(*(rep["times"] for rep in reps), strict=True)]
        kinds = sorted({k for rep in reps for k in rep["kfac_bytes_per_step"]})
        rows.append({
            "world": world,
            "wrap": wrap,
            "strategy": strategy,
            "grad_worker_fraction": reps[0]["fraction"],
            "step_median_s": statistics.median(iters),
            "memory_max_rank": {k: max(rep["memory"][k] for rep in reps) for k in MEMORY_KINDS},
            "tensor_bytes_max_rank": max(rep["tensor_bytes"] for rep in reps),
            "tensor_bytes_per_rank": [rep["tensor_bytes"] for rep in reps],
            "peak_rss_delta_max_rank": max(rep["peak_rss_delta"] for rep in reps),
            "peak_rss_delta_per_rank": [rep["peak_rss_delta"] for rep in reps],
            "steady_peak_rss_delta_max_rank": max(rep["steady_peak_rss_delta"] for rep in reps),
            "model_bytes_per_step_max_rank": max(rep["model_bytes_per_step"] for rep in reps),
            "kfac_bytes_per_step_max_rank": {
                k: max(rep["kfac_bytes_per_step"].get(k, 0.0) for rep in reps) for k in kinds},
            "kfac_bytes_per_step_max_rank_total": max(
                sum(rep["kfac_bytes_per_step"].values()) for rep in reps),
            "decomposition_bytes_all_ranks": sum(rep["decomposition_bytes"] for rep in reps),
            "final_loss_rank0": reps[0]["loss"],
        })
    return rows


def table(results: dict[str, Any]) -> str:
    """The results as a markdown table (MiB, ms, KiB)."""
    mib, kib = 2**20, 2**10
    lines = [
        "| ranks | wrap | strategy | params+grads+opt MiB | factors MiB | decomp. MiB | "
        "tensors MiB | peak RSS delta MiB (steady) | step median ms | model KiB/step | "
        "K-FAC KiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        m = r["memory_max_rank"]
        lines.append(
            f"| {r['world']} | {r['wrap']} | {r['strategy']} | "
            f"{(m['parameters'] + m['gradients'] + m['optimizer']) / mib:.2f} | "
            f"{m['factors'] / mib:.2f} | {m['decompositions'] / mib:.2f} | "
            f"{r['tensor_bytes_max_rank'] / mib:.2f} | {r['peak_rss_delta_max_rank'] / mib:.1f} "
            f"({r['steady_peak_rss_delta_max_rank'] / mib:.1f}) | "
            f"{1000 * r['step_median_s']:.0f} | {r['model_bytes_per_step_max_rank'] / kib:,.0f} | "
            f"{r['kfac_bytes_per_step_max_rank_total'] / kib:,.0f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Per-rank memory (tensors, peak RSS) and bytes per step against the world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {("ddp", "mem_opt"): ("tab:blue", "--"), ("ddp", "comm_opt"): ("tab:blue", ":"),
              ("fsdp2", "mem_opt"): ("tab:red", "-"), ("fsdp2", "comm_opt"): ("tab:red", "-.")}
    panels = (
        ("tensor_bytes_max_rank", 2**20, "tensors held per rank (MiB)\n"
         "params + grads + optimizer + K-FAC factors + decompositions"),
        ("peak_rss_delta_max_rank", 2**20, "peak RSS above the start (MiB)"),
        ("bytes_per_step", 2**20, "MiB sent per rank per step\n(model + K-FAC, ring estimate)"),
    )
    for ax, (key, unit, title) in zip(axes, panels, strict=True):
        for (wrap, strategy), (color, line) in styles.items():
            rows = [r for r in results["rows"] if r["wrap"] == wrap and r["strategy"] == strategy]
            worlds = [r["world"] for r in rows]
            if key == "bytes_per_step":
                values = [(r["model_bytes_per_step_max_rank"]
                           + r["kfac_bytes_per_step_max_rank_total"]) / unit for r in rows]
            else:
                values = [r[key] / unit for r in rows]
            ax.plot(worlds, values, line, color=color, marker="o",
                    label=f"{wrap.upper() if wrap == 'ddp' else 'FSDP2'} "
                          f"{strategy.replace('_', '-').upper()}")
        if key == "tensor_bytes_max_rank":  # the part DDP does not divide
            factors = max(r["memory_max_rank"]["factors"] for r in results["rows"]) / unit
            ax.axhline(factors, color="gray", linestyle="--", linewidth=1)
            ax.annotate("K-FAC running factors (DDP: every rank; FSDP2: 1/world)", (1, factors),
                        fontsize=7, color="gray", xytext=(0, 3), textcoords="offset points")
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({r["world"] for r in results["rows"]}))
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"K-FAC on the byte GPT (d_model {s['d_model']}, {s['n_layers']} layers, "
                 f"context {s['context']}, batch {s['batch']}/rank), gloo CPU: per-rank "
                 "maximum", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns what it writes to ``--out``."""
    parser = harness.parser(__doc__, RESULTS / "fsdp_memory.json")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 ranks")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    args = parser.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    worlds = args.worlds or ([2] if args.smoke else [1, 2, 4])
    rows: list[dict[str, Any]] = []
    for world in worlds:
        start = time.perf_counter()
        rows += _summarise(world, _run_world(world, size, args.timeout))
        print(f"world {world}: {time.perf_counter() - start:.1f}s", flush=True)
    results = {
        "model": "kaisa.train.models.GPT (byte vocabulary, tied embedding/head), float32",
        "settings": {**size, "smoke": args.smoke, "threads_per_rank": 1, "backend": "gloo",
                     "layer_kinds": "all", "optimizer": "SGD momentum 0.9",
                     "decompositions": "first step only (untimed)"},
        "rows": rows,
    }
    results = harness.write(args.out, "fsdp_memory", results, argv,
                            script="bench/distributed/fsdp_memory.py", indent=2)
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
