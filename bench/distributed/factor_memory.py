"""K-FAC's bytes at the peaks of a factor step on 1, 2 and 4 gloo ranks, against the model.

``kaisa.KFACPreconditioner`` (eigen, float32, factors every step) on ResNet-50 at ImageNet
shapes (1000 classes; the factors' sizes do not depend on the image, so the inputs are
32x32, batch 2 per rank) trains on spawned CPU processes (gloo on 127.0.0.1, one thread
each), at every valid ``grad_worker_fraction`` of each world size. The first step
decomposes; the second is a factor step, measured

* ``peak``: after its backward pass, before ``step()``: the running factors (the step's
  statistics already folded in), the decompositions and, under FSDP2, the batch factors
  reduced to the rank;
* ``step``: the largest inside its ``step()``: what ``peak`` holds plus the largest net
  increase of live tensor storage after an operator call (:mod:`step_memory`: new storages,
  less the held ones freed; the model's parameters and gradients not counted), with the
  peak of each phase of ``step()`` (``update_factors``, ``precondition_grouped``,
  ``write_directions``), the rank's gradient bytes (``grad_mb``) and, with ``--breakdown``,
  the shapes live at the peak;
* ``between``: after its ``step()``: what stays from one step to the next.

"Held" is every tensor storage reachable from the preconditioner object (the Python object
graph, counted once per storage), not through the model (its modules, parameters and
gradients are the model's memory): the same walk finds the blocks' state, the
communicator's buckets and the pending collectives' buffers. The storages of the blocks'
running factors are ``factors``, of their decomposition entries ``decompositions``;
``batch`` is the rest. The model is ``pre.memory_estimates()``
(``kaisa.distributed.memory``) for the run's fraction and rank: ``factors``,
``decompositions``, ``buffers`` (after the backward pass) and ``step_buffers`` (inside
``step()``); the table compares each moment with its modelled sum (:func:`modelled`).

    python bench/distributed/factor_memory.py             # bench/results/factor_memory.json
    python bench/distributed/factor_memory.py --smoke --out /tmp/m.json   # ResNet-20, 1-2 ranks
"""

from __future__ import annotations

import datetime
import gc
import importlib
import json
import os
import sys
import types
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness
from bench.distributed import ranks, step_memory

_MB = 2**20


def held_storages(root: object, model: nn.Module) -> dict[int, int]:
    """Bytes of each tensor storage reachable from ``root``, not through ``model``.

    A breadth-first walk of the object graph (``gc.get_referents``) that does not enter
    modules, parameters, functions, classes or Python modules; a tensor counts its
    storage once (views of one storage are one), its gradient is not followed.

    Returns:
        ``storage data pointer -> bytes``.
    """
    blocked = {id(model)} | {id(m) for m in model.modules()}
    blocked |= {id(p) for p in model.parameters()}
    blocked |= {id(p.grad) for p in model.parameters() if p.grad is not None}
    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo: list[object] = [root]
    skip = (nn.Module, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.ModuleType, type)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in blocked:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and not isinstance(obj, nn.Parameter):
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, skip):
            continue
        todo.extend(gc.get_referents(obj))
    return storages


def _measure(pre: Any, model: nn.Module, held: dict[int, int] | None = None
             ) -> dict[str, float]:
    """MB held: the running factors' storages, the decompositions', and the rest (batch)."""
    held = held_storages(pre, model) if held is None else held
    kinds: dict[str, set[int]] = {"factors": set(), "decompositions": set()}
    for layer in pre.layers.values():
        for t in (layer.factors.a, layer.factors.g):
            if t is not None:
                kinds["factors"].add(t.untyped_storage().data_ptr())
        for t in layer.decomposition.values():
            kinds["decompositions"].add(t.untyped_storage().data_ptr())
    out = {f"{kind}_mb": sum(held.get(p, 0) for p in ptrs) / _MB for kind, ptrs in kinds.items()}
    out["held_mb"] = sum(held.values()) / _MB
    out["batch_mb"] = out["held_mb"] - out["factors_mb"] - out["decompositions_mb"]
    return out


def _shard(model: nn.Module) -> None:
    """FSDP2: ``fully_shard`` on every residual block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for module in [m for m in model.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")]:
        fully_shard(module)
    fully_shard(model)


def _grad_mb(pre: Any) -> float:
    """MB of this rank's gradients (local shards) of the preconditioner's blocks' parameters."""
    seen: dict[int, int] = {}
    for layer in pre.layers.values():
        for p in layer.parameters():
            if p.grad is not None:
                grad = step_memory.unwrap(p.grad)
                seen[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(seen.values()) / _MB


#: The phases of ``KFACCurvature`` that ``step()`` calls, each labelled in the breakdown.
_PHASES = ("update_factors", "update_decompositions", "precondition_grouped")


def _labelled(peak: step_memory.StepPeak, name: str, call: Any) -> Any:
    """``call`` with ``peak.phase`` set to ``name`` while it runs (``write`` after it)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        peak.phase = name
        try:
            return call(*args, **kwargs)
        finally:
            peak.phase = "write_directions"
    return run


def _step(pre: Any, model: nn.Module, breakdown: bool) -> dict[str, Any]:
    """``pre.step()`` under :class:`~step_memory.StepPeak`: the largest bytes held inside it.

    ``held_mb`` is what the walk from ``pre`` finds at the start plus the largest net
    increase of the live storages (new ones, less the held ones freed) after an operator
    call; the model's parameters and gradients are not counted.
    """
    held = held_storages(pre, model)
    grad_mb = _grad_mb(pre)
    params = list(model.parameters())
    curvature = pre._curvature
    peak = step_memory.StepPeak(held, lambda: step_memory.model_storages(params),
                                breakdown=breakdown)
    with peak:
        for name in _PHASES:  # each phase's peak apart (one label for the calls in it)
            setattr(curvature, name, _labelled(peak, name, getattr(curvature, name)))
        try:
            pre.step()
        finally:
            for name in _PHASES:
                delattr(curvature, name)
    out = peak.summary()
    out["start_mb"] = sum(held.values()) / _MB
    out["held_mb"] = out["start_mb"] + out["extra_mb"]
    out["grad_mb"] = grad_mb
    return out


def _run(model_name: str, fraction: Fraction, rank: int, world: int,
         fsdp: bool = False, storage: str = "dense", breakdown: bool = False
         ) -> dict[str, Any]:
    import kaisa
    from kaisa.train import models

    torch.manual_seed(0)
    model = models.resnet20(num_classes=10) if model_name == "resnet20" else models.resnet50()
    classes = 10 if model_name == "resnet20" else 1000
    if fsdp:
        _shard(model)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10**6,
                                   grad_worker_fraction=float(fraction), factor_storage=storage)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    y = torch.randint(0, classes, (2,), generator=gen)
    out: dict[str, Any] = {"rank": rank}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(F.cross_entropy(model(x), y))
        if step == 1:
            out["peak"] = _measure(pre, model)
            out["step"] = _step(pre, model, breakdown)
        else:
            pre.step()
    out["between"] = _measure(pre, model)
    modelled = pre.memory_estimates()[fraction].per_rank[rank]
    out["model"] = {k: v / _MB for k, v in modelled.items()}
    return out


def _worker(rank: int, world: int, port: int, model_name: str, fractions: list[str],
            fsdp: bool, storage: str, breakdown: bool, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=1800))
    rows = [_run(model_name, Fraction(f), rank, world, fsdp, storage, breakdown)
            for f in fractions]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _spawnable_worker() -> Any:
    """:func:`_worker` from a module the spawned processes import by name."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("factor_memory")._worker


def run_world(world: int, model_name: str, timeout: float, fsdp: bool = False,
              storage: str = "dense", breakdown: bool = False) -> list[dict[str, Any]]:
    """Every valid fraction of ``world`` ranks: per fraction, every rank's measurements."""
    from kaisa.distributed.strategy import valid_fractions

    fractions = [str(f) for f in valid_fractions(world)]
    per_rank = ranks.spawn_ranks(_spawnable_worker(), world,
                                 (model_name, fractions, fsdp, storage, breakdown), timeout)
    return [{"world": world, "fraction": f, "fsdp": fsdp, "factor_storage": storage,
             "ranks": [per_rank[r][i] for r in range(world)]} for i, f in enumerate(fractions)]


def modelled(model: dict[str, float]) -> tuple[float, float]:
    """The model's MB at the two moments: after the backward pass, and inside ``step()``."""
    base = model["factors"] + model["decompositions"]
    return base + model["buffers"], base + model["step_buffers"]


def table(rows: list[dict[str, Any]]) -> str:
    """Per world and fraction: the rank holding the most inside ``step()``, measured and modelled.

    MB after the backward pass (of which batch factors and buckets) and at the peak inside
    ``step()`` (its increase over the start, as a multiple of the rank's gradient bytes),
    between steps, and each moment against the model's.
    """
    lines = ["| ranks | fraction | backward | of which batch | step | step increase / grads "
             "| between steps | model backward | model step | backward / model "
             "| step / model |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        top = max(row["ranks"], key=lambda r: r["step"]["held_mb"])
        backward, step = modelled(top["model"])
        ranks_label = (f"{row['world']}{' FSDP2' if row.get('fsdp') else ''}"
                       f"{' packed' if row.get('factor_storage') == 'packed' else ''}")
        got = top["step"]
        lines.append(
            f"| {ranks_label} | {row['fraction']} | {top['peak']['held_mb']:.0f} | "
            f"{top['peak']['batch_mb']:.0f} | {got['held_mb']:.0f} | "
            f"{got['extra_mb'] / got['grad_mb']:.2f} | {top['between']['held_mb']:.0f} | "
            f"{backward:.0f} | {step:.0f} | {top['peak']['held_mb'] / backward:.3f} | "
            f"{got['held_mb'] / step:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures every world size of ``--worlds``; writes the JSON and prints the table."""
    p = harness.parser(__doc__, harness.RESULTS / "factor_memory.json")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--fsdp-worlds", default="2,4",
                   help="world sizes also measured under FSDP2 (fully_shard per block)")
    p.add_argument("--packed-worlds", default="1,4",
                   help="world sizes also measured with factor_storage='packed'")
    p.add_argument("--smoke", action="store_true",
                   help="ResNet-20 (CIFAR), 1 and 2 ranks, 2 under FSDP2, 1 packed")
    p.add_argument("--breakdown", action="store_true",
                   help="record the tensor shapes live at the peak inside step()")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per world size")
    args = p.parse_args(argv)
    model_name = "resnet20" if args.smoke else "resnet50"
    def listed(text: str) -> list[int]:
        return [int(w) for w in text.split(",") if w]

    worlds = [(1, False, "dense"), (2, False, "dense"), (2, True, "dense"),
              (1, False, "packed")] if args.smoke else (
        [(w, False, "dense") for w in listed(args.worlds)]
        + [(w, True, "dense") for w in listed(args.fsdp_worlds)]
        + [(w, False, "packed") for w in listed(args.packed_worlds)])
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for w, fsdp, storage in worlds:  # written after each: a run cut short keeps what it has
        try:
            rows += run_world(w, model_name, args.timeout, fsdp, storage, args.breakdown)
        except (RuntimeError, TimeoutError) as err:  # e.g. a rank killed for memory
            if args.smoke:
                raise
            errors[f"{w}{' fsdp' if fsdp else ''} {storage}"] = str(err)
        harness.write(args.out, "factor_memory",
                      {"model": model_name, "rows": rows, "errors": errors},
                      argv=argv, script="bench/distributed/factor_memory.py")
    print(table(rows))
    for label, message in errors.items():
        print(f"{label} ranks: {message}")
    return {"rows": rows, "errors": errors}


if __name__ == "__main__":
    main()
