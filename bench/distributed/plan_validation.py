"""Measured against predicted per-phase times of kaisa's engine on gloo ranks (kaisa.plan).

Each rank lives in its own network namespace, joined to the others by veth pairs on one
bridge; each rank's egress is shaped with ``tc tbf`` to a rate (two settings). This
machine's kernel has no ``netem``, so latency is not shaped: it is whatever the
veth/bridge/gloo path gives, and the planner uses the alpha and beta that
:func:`kaisa.plan.measure_link` fits on the process group (the "measured" route of the
issue). Without namespaces (not root, no ``ip``), ``--loopback`` runs the ranks on
127.0.0.1 unshaped.

For every valid fraction at 2 and 4 ranks, a 5-layer MLP's blocks (factors and gradients
set, as the engine's unit tests do) go through the engine's three distributed phases
(rank ``r`` pinned to core ``r mod cores``). After a warm-up, each of 7 rounds
(``--rounds``) measures the kernels (:func:`kaisa.plan.microbenchmark`, every rank at
once, ``shared``) and then times every phase once on every rank; a phase's time is the
median over the rounds of the slowest rank's, and its prediction the median of the
rounds' predictions:

* ``factor allreduce``: every A and G through the communicator's fused allreduce;
* ``decomposition broadcast`` and ``gradient broadcast``: the engine's broadcasts (its
  placement, groups, payload shapes and buckets) without the compute around them;
* ``decompose + broadcast``: :meth:`DistributedEngine.update_decompositions`;
* ``precondition + broadcast``: :meth:`DistributedEngine.precondition`.

The prediction is :class:`kaisa.plan.IterationModel` on the same placement, with each
round's compute profile (so the load of the machine when the phases ran is in it) and
the measured link. Single collectives (an allreduce, a broadcast from rank 0; 64 KiB to
4 MiB) are timed alone too, as evidence for the collective models.

    python bench/distributed/plan_validation.py               # as root: namespaces + tc
    python bench/distributed/plan_validation.py --loopback    # anywhere
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "plan_validation.json"
NS, BRIDGE, SUBNET = "kplan", "br-kplan", "10.77.0."
WIDTHS = [256, 384, 256, 256, 128, 10]
ROWS, DAMPING = 64, 0.01


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True)


def setup_namespaces(n: int) -> None:
    teardown_namespaces(n)
    _sh(f"ip link add {BRIDGE} type bridge && ip link set {BRIDGE} up")
    for r in range(n):
        ns, dev = f"{NS}{r}", f"kp{r}"
        _sh(f"ip netns add {ns} && ip link add {dev} type veth peer name {dev}b && "
            f"ip link set {dev} netns {ns} && ip link set {dev}b master {BRIDGE} && "
            f"ip link set {dev}b up && ip netns exec {ns} ip addr add {SUBNET}{r + 1}/24 dev {dev}"
            f" && ip netns exec {ns} ip link set {dev} up && ip netns exec {ns} ip link set lo up")


def shape(n: int, rate: str) -> None:
    mbit = float(rate.removesuffix("mbit")) if rate.endswith("mbit") else \
        float(rate.removesuffix("gbit")) * 1000
    burst = max(16 * 1024, int(mbit * 1e6 / 8 / 1000))  # 1 ms of traffic
    for r in range(n):
        _sh(f"ip netns exec {NS}{r} tc qdisc replace dev kp{r} root tbf rate {rate} "
            f"burst {burst} latency 200ms")


def teardown_namespaces(n: int) -> None:
    for r in range(n):
        subprocess.run(f"ip netns del {NS}{r}", shell=True, capture_output=True)
    subprocess.run(f"ip link del {BRIDGE}", shell=True, capture_output=True)


def _mlp():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), torch.randn(ROWS, WIDTHS[0])


def _wait_all(comm, handles) -> None:  # type: ignore[no-untyped-def]
    comm.flush()
    for h in handles:
        h.wait()


def _phases(engine, blocks, grads, method, rank, world):  # type: ignore[no-untyped-def]
    """The timed phases of one engine: name -> callable."""
    import torch

    comm, grid = engine.communicator, engine.grid
    receivers = {w: grid.receiver_groups()[grid.receiver_group_of(w)] for w in range(world)}

    def decomposition_broadcasts() -> None:  # the engine's broadcasts, without compute
        handles = []
        for b in blocks.values():
            lp = engine.placement[b.name]
            if rank not in lp.grad_workers:
                continue
            for src, n in ((lp.a_rank, lp.a_dim), (lp.g_rank, lp.g_dim)):
                for shape in method.payload_shapes(1, n, diagonal=False):
                    handles.append(comm.broadcast(torch.zeros(shape), src, lp.grad_workers))
        _wait_all(comm, handles)

    def gradient_broadcasts() -> None:  # the engine's gradient broadcasts
        handles = []
        for name, grad in grads.items():
            lp = engine.placement[name]
            src = lp.grad_source(rank)
            if rank in lp.grad_workers and not lp.grad_receivers[rank]:
                continue
            handles.append(comm.broadcast(torch.zeros(grad.numel() + 1), src, receivers[src],
                                          kind="gradients"))
        _wait_all(comm, handles)

    def factors() -> None:
        _wait_all(comm, [comm.allreduce_mean(t) for b in blocks.values() for t in (b.a, b.g)])

    return {"factor allreduce": factors,
            "decomposition broadcast": decomposition_broadcasts,
            "gradient broadcast": gradient_broadcasts,
            "decompose + broadcast": lambda: engine.update_decompositions(DAMPING),
            "precondition + broadcast": lambda: engine.precondition(grads, DAMPING)}


def _single_collectives() -> dict[str, dict[str, float]]:
    """One allreduce, and one broadcast from rank 0, alone: the slowest rank's median of 5."""
    import torch
    import torch.distributed as dist

    out: dict[str, dict[str, float]] = {"allreduce": {}, "broadcast": {}}
    for nbytes in (1 << 16, 1 << 20, 1 << 22):
        buf = torch.zeros(nbytes // 4)
        for name, fn in (("allreduce", lambda b=buf: dist.all_reduce(b)),
                         ("broadcast", lambda b=buf: dist.broadcast(b, 0))):
            fn()
            times = []
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out[name][str(nbytes)] = float(worst.item())
    return out


def worker(rank: int, world: int, master: str, port: int, out: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from kaisa.blocks import register_blocks
    from kaisa.distributed import DistributedEngine, EngineConfig, valid_fractions
    from kaisa.methods import make_method
    from kaisa.plan import measured_network, microbenchmark
    from kaisa.utils.enums import ComputeMethod

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=world)
    net = measured_network(sizes=(1 << 10, 1 << 16, 1 << 20, 1 << 22), repeats=3)
    single = _single_collectives()
    model, _ = _mlp()
    method = make_method(ComputeMethod.EIGEN)
    blocks = register_blocks(model)
    gen = torch.Generator().manual_seed(1)
    for block in blocks.values():
        block.method = method
        a_dim, g_dim = block.dims
        for side, n in (("a", a_dim), ("g", g_dim)):
            x = torch.randn(n, n + 8, generator=gen)
            setattr(block.factors, side, (x @ x.T / n + 0.1 * torch.eye(n)).unsqueeze(0))
        block.weight.grad = torch.randn(block.weight.shape, generator=gen)
        if block.bias is not None:
            block.bias.grad = torch.randn(block.bias.shape, generator=gen)
    rows = []
    for fraction in valid_fractions(world):
        engine = DistributedEngine(blocks, EngineConfig(grad_worker_fraction=float(fraction)),
                                   method)
        grads = {n: b.gradient_matrix() for n, b in blocks.items()}
        phases = _phases(engine, blocks, grads, method, rank, world)
        for fn in phases.values():  # warm-up
            fn()
        # The load of this shared machine drifts: each round measures the kernels again
        # (every rank at once, back to back, as the phases run) and then every phase once.
        profiles, timed = [], []
        for _ in range(rounds):
            dist.barrier()
            profiles.append(microbenchmark("cpu", quick=True, repeats=5, shared=True).to_json())
            times = []
            for fn in phases.values():
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            worst = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank
            timed.append(dict(zip(phases, worst.tolist(), strict=True)))
        rows.append({"world_size": world, "fraction": str(fraction),
                     "strategy": engine.grid.strategy_name, "rounds_s": timed,
                     "measured_s": {k: statistics.median(r[k] for r in timed) for k in phases},
                     "profiles": profiles})
    if rank == 0:
        Path(out).write_text(json.dumps({
            "link": {"bandwidth_Bps": net.inter.bandwidth_Bps, "latency_s": net.inter.latency_s},
            "single_collectives_s": single, "rows": rows}, indent=1))
    dist.destroy_process_group()


def predict(res: dict[str, Any], algorithm: str) -> None:
    """Adds ``predicted_s[algorithm]`` to every row: the plan for the measured link and kernels."""
    from kaisa.distributed import WorkerGrid
    from kaisa.plan import (
        Algorithm,
        ComputeProfile,
        IterationModel,
        Link,
        NetworkSpec,
        PlanConfig,
        workload_from_module,
    )

    link = Link(**res["link"])
    net = NetworkSpec(gpus_per_node=1, intra=link, inter=link, name="measured")
    model, example = _mlp()
    workload = workload_from_module(model, example)
    for row in res["rows"]:
        world = row["world_size"]
        grid = WorkerGrid(world, int(Fraction(row["fraction"]) * world))
        preds = []
        for profile in row["profiles"]:
            plan = IterationModel(workload=workload, network=net,
                                  compute=ComputeProfile.from_json(profile),
                                  config=PlanConfig(algorithm=Algorithm(algorithm)))
            p = plan.cost(grid).phases
            preds.append({
                "factor allreduce": plan.factor_allreduce_seconds(world),
                "decomposition broadcast": p["decomposition_comm"],
                "gradient broadcast": p["gradient_comm"],
                "decompose + broadcast": p["decomposition"] + p["decomposition_comm"],
                "precondition + broadcast": p["precondition"] + p["gradient_comm"],
            })
        row.setdefault("predicted_s", {})[algorithm] = {
            k: statistics.median(pr[k] for pr in preds) for k in preds[0]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def launch(world: int, *, netns: bool, tmp: Path, rounds: int) -> dict[str, Any]:
    port = _free_port()
    master = f"{SUBNET}1" if netns else "127.0.0.1"
    out = tmp / f"rank0-{world}-{port}.json"
    procs = []
    for r in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        # rank r on core r mod cores: at 4 ranks two share each core, always the same two
        cmd = ["taskset", "-c", str(r % (os.cpu_count() or 1)), sys.executable, __file__,
               "--worker", str(r), "--world", str(world), "--master", master,
               "--rounds", str(rounds),
               "--port", str(port), "--out", str(out)]
        if netns:
            env["GLOO_SOCKET_IFNAME"] = f"kp{r}"
            cmd = ["ip", "netns", "exec", f"{NS}{r}", *cmd]
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=1200) != 0:
            raise RuntimeError(f"a rank failed ({p.returncode})")
    return json.loads(out.read_text())


def _err(p: float, m: float) -> str:
    if m < 1e-3 and p < 1e-3:  # both nothing (under a millisecond): no error to speak of
        return "0 (none)"
    return f"{(p - m) / m:+.0%}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| setting | ranks | strategy | phase | measured ms | predicted ms (gloo) | "
             "error | predicted ms (NCCL-like) | error |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for res in results:
        for row in res["rows"]:
            for phase, m in row["measured_s"].items():
                g = row["predicted_s"]["gloo"][phase]
                a = row["predicted_s"]["auto"][phase]
                lines.append(f"| {res['setting']} | {row['world_size']} | {row['strategy']} "
                             f"({row['fraction']}) | {phase} | {m * 1e3:.1f} | {g * 1e3:.1f} | "
                             f"{_err(g, m)} | {a * 1e3:.1f} | {_err(a, m)} |")
    return "\n".join(lines)


_COMM = ("factor allreduce", "decomposition broadcast", "gradient broadcast")
_COMPUTE = ("decompose + broadcast", "precondition + broadcast")


def summary(results: list[dict[str, Any]]) -> str:
    """Phases within 25% and the median absolute error, communication and compute apart."""
    lines = ["| phases | model | within 25% | median abs. error |", "| --- | --- | --- | --- |"]
    for kind, names in (("communication only", _COMM), ("with compute", _COMPUTE)):
        for algorithm, label in (("gloo", "gloo"), ("auto", "NCCL-like")):
            errors = [abs(row["predicted_s"][algorithm][n] - row["measured_s"][n])
                      / row["measured_s"][n]
                      for res in results for row in res["rows"] for n in names
                      if max(row["measured_s"][n], row["predicted_s"][algorithm][n]) >= 1e-3]
            within = sum(e <= 0.25 for e in errors)
            lines.append(f"| {kind} | {label} | {within} / {len(errors)} | "
                         f"{statistics.median(errors):.0%} |")
    return "\n".join(lines)


def main() -> None:
    sys.path.insert(0, str(ROOT))  # this checkout's kaisa, for the predictions
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--master", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--rates", default="1gbit,200mbit")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--loopback", action="store_true")
    ap.add_argument("--rounds", type=int, default=7,
                    help="calibration + measurement rounds per fraction (the median is kept)")
    ap.add_argument("--recompute", action="store_true",
                    help="recompute the predictions of --out from its measurements")
    args = ap.parse_args()
    if args.recompute:
        data = json.loads(Path(args.out).read_text())
        for res in data["results"]:
            for algorithm in ("gloo", "auto"):
                predict(res, algorithm)
        data.pop("schema", None)  # the envelope is written again
        command, env = data.pop("command", None), data.pop("environment", None)
        data.pop("benchmark", None)
        harness.write(args.out, "plan_validation", data,
                      script="bench/distributed/plan_validation.py",
                      recomputed_from={"command": command, "environment": env})
        print(table(data["results"]))
        print(summary(data["results"]))
        return
    if args.worker is not None:
        worker(args.worker, args.world, args.master, args.port, args.out, args.rounds)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    netns = not args.loopback
    if netns:
        try:
            setup_namespaces(max(worlds))
        except (subprocess.CalledProcessError, FileNotFoundError) as err:
            print(f"no network namespaces ({err}); falling back to loopback")
            netns = False
    settings = args.rates.split(",") if netns else ["loopback"]
    tmp = Path("/tmp/kaisa-plan-validation")
    tmp.mkdir(exist_ok=True)
    results = []
    try:
        for setting in settings:
            if netns:
                shape(max(worlds), setting)
            for world in worlds:
                t0 = time.perf_counter()
                res = launch(world, netns=netns, tmp=tmp, rounds=args.rounds)
                res["setting"] = f"tbf {setting}" if netns else "loopback"
                res["world_size"] = world
                results.append(res)
                print(f"{setting} world {world}: {time.perf_counter() - t0:.0f} s; link "
                      f"{res['link']['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s, "
                      f"alpha {res['link']['latency_s'] * 1e6:.0f} us", flush=True)
    finally:
        if netns:
            teardown_namespaces(max(worlds))
    for res in results:
        for algorithm in ("gloo", "auto"):
            predict(res, algorithm)
    harness.write(args.out, "plan_validation", {"netns": netns, "results": results},
                  script="bench/distributed/plan_validation.py")
    print(table(results))
    print(summary(results))


if __name__ == "__main__":
    main()
