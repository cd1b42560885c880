"""bench/step_cost.py in its smoke form (tiny sizes, a few steps; no timing claims)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import load_bench


def test_step_cost_smoke(tmp_path: Path) -> None:
    module = load_bench("step_cost")
    out = tmp_path / "step_cost.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert out.with_suffix(".png").stat().st_size > 0
    tasks = results["tasks"]
    assert set(tasks) == {"resnet32", "autoencoder", "gpt"}
    assert set(tasks["gpt"]) == {"adamw", "adam", "kfac_pre 10/100 + adamw",
                                 "kfac_pre 10/100 inverse + adamw", "kfac adaptive", "ekfac"}
    for entries in tasks.values():
        for name, entry in entries.items():
            split = entry["ms_by_category"]
            assert entry["ms_per_step"] > 0 and split["forward"] > 0 and split["backward"] > 0
            if entry["baseline"] is None:
                assert split["factor statistics"] == 0 and "ratio" not in entry, name
            else:
                assert entry["ratio"] > 0 and entry["kfac_state_mib"] > 0, name
                assert split["preconditioning"] > 0, name
                if "10/100" not in name:  # its timed smoke steps record no factors
                    assert split["factor statistics"] > 0, name
    adaptive = tasks["autoencoder"]["kfac adaptive"]["ms_by_category"]
    assert adaptive["quadratic model"] > 0 and adaptive["curvature backward (MC)"] > 0
    assert "| gpt | ekfac |" in module.table(results)


@pytest.mark.distributed
def test_fsdp_memory_smoke(tmp_path: Path) -> None:
    """bench/fsdp_memory.py --smoke: 2 gloo ranks, DDP and FSDP2, MEM-OPT and COMM-OPT."""
    module = load_bench("fsdp_memory")
    out = tmp_path / "fsdp_memory.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert out.with_suffix(".png").stat().st_size > 0
    rows = {(r["wrap"], r["strategy"]): r for r in results["rows"]}
    assert set(rows) == set(module.CONFIGS) and all(r["world"] == 2 for r in rows.values())
    for wrap in ("ddp", "fsdp2"):
        mem, comm = rows[(wrap, "mem_opt")], rows[(wrap, "comm_opt")]
        assert mem["grad_worker_fraction"] == 0.5 and comm["grad_worker_fraction"] == 1.0
        # MEM-OPT keeps each block's decompositions on one rank, COMM-OPT on both.
        assert mem["memory_max_rank"]["decompositions"] < comm["memory_max_rank"]["decompositions"]
        assert mem["memory_max_rank"]["factors"] == comm["memory_max_rank"]["factors"] > 0
        assert mem["model_bytes_per_step_max_rank"] > 0
    # FSDP2 shards parameters, gradients and momentum (the position table's one row is not
    # split: at most 60% of DDP's on any rank); the math is the same.
    shard_kinds = ("parameters", "gradients", "optimizer")
    for strategy in ("mem_opt", "comm_opt"):
        ddp, fsdp = rows[("ddp", strategy)], rows[("fsdp2", strategy)]
        for kind in shard_kinds:
            assert fsdp["memory_max_rank"][kind] < 0.6 * ddp["memory_max_rank"][kind], kind
        assert abs(fsdp["final_loss_rank0"] - ddp["final_loss_rank0"]) < 1e-4
    # FSDP2 reduces each Kronecker block's factors to its owners (the diagonal blocks' are
    # still averaged to every rank), so a rank keeps fewer running factors than under DDP.
    for strategy in ("mem_opt", "comm_opt"):
        assert (rows[("fsdp2", strategy)]["memory_max_rank"]["factors"]
                < rows[("ddp", strategy)]["memory_max_rank"]["factors"]), strategy
    # Gradient traffic: FSDP2 gathers to the workers (and sends rows back under MEM-OPT).
    assert set(rows[("fsdp2", "mem_opt")]["kfac_bytes_per_step_max_rank"]) == {
        "factor_reduce", "factors", "gradient_gather", "gradients"}
    assert set(rows[("fsdp2", "comm_opt")]["kfac_bytes_per_step_max_rank"]) == {
        "factor_reduce", "factors", "gradient_gather"}
    assert set(rows[("ddp", "comm_opt")]["kfac_bytes_per_step_max_rank"]) == {"factors"}
    assert "| 2 | fsdp2 | mem_opt |" in module.table(results)
