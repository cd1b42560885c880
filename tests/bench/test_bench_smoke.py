"""bench/step_cost/step_cost.py in its smoke form (tiny sizes, a few steps; no timing claims)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import load_bench


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_step_cost_smoke(tmp_path: Path) -> None:
    module = load_bench("step_cost")
    out = tmp_path / "step_cost.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert out.with_suffix(".png").stat().st_size > 0
    tasks = results["tasks"]
    assert set(tasks) == {"resnet32", "autoencoder", "gpt"}
    assert set(tasks["gpt"]) == {"adamw", "adam", "kfac_pre 10/100 + adamw",
                                 "kfac_pre 10/100 inverse + adamw", "kfac adaptive",
                                 "kfac adaptive double_backward", "kfac adaptive reduce",
                                 "ekfac", "ekfac reduce", "ekfac rows256",
                                 "ekfac rows256 linear only", "ekfac rows256 qr",
                                 "ekfac rows256 o256", "ekfac rows256 o256 f2",
                                 "ekfac rows256 o256 b20"}
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
    """bench/distributed/fsdp_memory.py --smoke: 2 gloo ranks, DDP and FSDP2, MEM-OPT and COMM-OPT."""
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


def test_step_floor_smoke(tmp_path: Path) -> None:
    """bench/step_cost/step_floor.py --smoke on the committed step-cost runs: a row per target."""
    module = load_bench("step_floor")
    out = tmp_path / "step_floor.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    rows = {(r["task"], r["configuration"]): r for r in results["rows"]}
    assert set(rows) == set(module.ROWS)  # every configuration with a target
    for key, r in rows.items():
        assert r["target"] == module.ROWS[key]
        assert 1.0 < r["floor_ratio"] <= r["measured_ratio"], key
        assert r["gpu_projection_ratio"] > 1.0 and r["gpu_projection_baseline_ms"] > 0, key
        floor, measured = r["floor_ms_by_category"], r["ms_by_category"]
        assert set(floor) == set(measured) == set(r["floor_rule"]), key
        for cat, (rule, _) in module.RULES.items():
            if rule == "keep":
                assert floor[cat] == measured[cat], (key, cat)
            elif rule == "zero":
                assert floor[cat] == 0.0, (key, cat)
            elif rule in ("flops", "jvp"):
                assert floor[cat] <= measured[cat], (key, cat)
    # The flop counts from the shapes: ResNet-32 is ~69M multiply-adds per 32x32 image,
    # its 31 convolutions and the classifier are the blocks; the GPT's 4 x 4 Linear/MHA
    # blocks and the tied embedding; the autoencoder's first layer A = 785, G = 400.
    resnet = module.shapes("resnet32", False)
    assert 68e6 < resnet.fwd_flops / 2 / 128 < 70e6 and len(resnet.blocks) == 32
    first = module.shapes("autoencoder", False).blocks[0]
    assert (first.rows, first.a, first.g) == (256, 785, 400)
    assert module.factor_flops(first, True) == 2 * 256 * (785 ** 2 + 400 ** 2)
    assert sum(b.tied for b in module.shapes("gpt", False).blocks) == 1
    shifted = [b for b in resnet.blocks if b.a_cpu_flops < 2 * b.rows * b.a ** 2]
    assert len(shifted) == 28  # the stride-1 3x3 layers with >= 8 channels
    # choose_covariance's documented example: d = 576, 2048 rows, TF32 GEMM ~20 us.
    assert abs(module.covariance_s(2048, 576, True) - 20e-6) < 1e-6


@pytest.mark.slow
def test_jvp_linearize_smoke(tmp_path: Path) -> None:
    """bench/experiments/jvp_linearize.py --smoke: every way runs, ``func_linearize`` equals today's J v."""
    module = load_bench("jvp_linearize")
    out = tmp_path / "jvp_linearize.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["probes"]) == {"nested_dual_level", "dual_of_a_dual",
                                      "complex_tangent_through_linear"}
    assert set(results["tasks"]) == {"autoencoder", "gpt"}
    for entry in results["tasks"].values():
        assert all(ms > 0 for ms in entry["median_ms"].values())
        assert set(entry["projected_kfac_step_saving"]) == {"func_linearize",
                                                            "cached_linear_map", "vmap_jvp"}
        assert entry["float64_func_linearize_vs_today_relative"] < 1e-12


@pytest.mark.slow
def test_decomposition_levers_smoke(tmp_path: Path) -> None:
    """bench/experiments/decomposition_levers.py --smoke: every start measured, the set timed."""
    module = load_bench("decomposition_levers")
    out = tmp_path / "decomposition_levers.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["models"]) == {"low_rank", "random"}
    for entry in results["models"].values():
        for s in entry["sizes"].values():
            rule = s["warm"]["rule, 1 fold"]
            assert rule["violates_radius_below_1"] == 0 and rule["diverged"] == 0
            assert rule["iterations_to_target"]["reached"] == s["factors"]
            assert rule["product_error"]["max"] < 1e-3 > s["cholesky"]["product_error"]["max"]
            assert set(s["eigen"]) == {"eigh", "warm_refresh"}
            assert {"cold_identity", "cold_transpose"} <= set(s)
    times = results["models"]["low_rank"]["whole_set_ms"]
    assert all(v > 0 for v in times.values()) and "newton_schulz_cold_identity_projected" in times


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_plan_validation_smoke(tmp_path: Path) -> None:
    """bench/distributed/plan_validation.py --loopback: 2 gloo ranks, every phase measured and predicted."""
    import subprocess
    import sys

    out = tmp_path / "plan_validation.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "distributed" / "plan_validation.py"
    run = subprocess.run([sys.executable, str(script), "--loopback", "--worlds", "2",
                          "--rounds", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["netns"] is False
    (res,) = data["results"]
    assert res["setting"] == "loopback" and res["world_size"] == 2
    assert res["link"]["bandwidth_Bps"] > 0 and res["link"]["latency_s"] >= 0
    assert set(res["single_collectives_s"]) == {"allreduce", "broadcast"}
    assert [row["fraction"] for row in res["rows"]] == ["1", "1/2"]
    for row in res["rows"]:
        assert len(row["rounds_s"]) == len(row["profiles"]) == 2
        phases = set(row["measured_s"])
        assert phases == set(row["predicted_s"]["gloo"]) == set(row["predicted_s"]["auto"])
        assert row["measured_s"]["factor allreduce"] > 0
        assert row["predicted_s"]["auto"]["decompose + broadcast"] > 0
    assert "| communication only | gloo |" in run.stdout


def test_launches_smoke(tmp_path: Path) -> None:
    """bench/step_cost/launches.py --smoke: every phase counted; the grouped plain step stays small."""
    module = load_bench("launches")
    out = tmp_path / "launches.json"
    results = module.main(["--smoke", "--tasks", "gpt", "--products", "sgd,kfac_pre,ekfac",
                           "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(results))
    gpt = results["gpt"]
    assert set(gpt["kfac_pre"]) == {
        "fwd_bwd", "fwd_bwd_factor", "step", "step_sgd", "step_factor", "step_factor_sgd",
        "step_decomposition", "step_decomposition_sgd"}
    assert set(gpt["ekfac"]) == {"fwd_bwd_factor", "step", "step_decomposition"}
    plain = gpt["kfac_pre"]["step"]
    assert plain["launches"] > plain["calls"]  # eigen_precondition counts its GEMMs
    # one preconditioning call per shape: a few dozen calls, not a few dozen per block
    assert plain["calls"] <= 60, plain
    assert gpt["sgd"]["step"]["calls"] <= 10  # foreach: a few calls for every parameter


def test_launches_kfac_muon_smoke(tmp_path: Path) -> None:
    """KFACMuon's input mode: a steady step below Muon's calls, hooks in the forward only."""
    module = load_bench("launches")
    results = module.main(["--smoke", "--tasks", "gpt", "--products",
                           "muon,kfac_muon_input,kfac_muon_eigen",
                           "--out", str(tmp_path / "launches.json")])
    gpt = results["gpt"]
    assert gpt["kfac_muon_input"]["step"]["calls"] < gpt["muon"]["step"]["calls"]
    hooks = gpt["kfac_muon_input"]["fwd_bwd_factor"]["calls"] - gpt["muon"]["fwd_bwd"]["calls"]
    assert 0 < hooks <= 0.2 * gpt["muon"]["fwd_bwd"]["calls"], hooks
    assert set(gpt["kfac_muon_eigen"]) == {"fwd_bwd_factor", "step", "step_decomposition"}


def test_kfac_muon_step_smoke(tmp_path: Path) -> None:
    """bench/step_cost/kfac_muon_step.py --tiny: every configuration timed, phases reported."""
    module = load_bench("kfac_muon_step")
    out = tmp_path / "step.json"
    payload = module.main(["--tiny", "--steps", "2", "--warmup", "1", "--configs",
                           "muon,input-r8-d8,eigen-r8-o8", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(payload["results"]))
    rows = payload["results"]
    assert set(rows) == {"muon", "input-r8-d8", "eigen-r8-o8"} and rows["muon"]["total_vs_first"] == 1
    assert rows["muon"]["phases_ms_per_step"] == {}
    assert rows["input-r8-d8"]["phases_ms_per_step"]["factors"] > 0


@pytest.mark.distributed
def test_factor_memory_smoke(tmp_path: Path) -> None:
    """bench/distributed/factor_memory.py --smoke: ResNet-20 on 1 and 2 gloo ranks, 2 under
    FSDP2 and 1 with packed factors.

    The running factors and the decompositions held are what the memory model counts, to
    the byte, at every fraction; after the backward pass every rank holds the model's
    backward moment (factors, decompositions, buffers) and inside ``step()`` its step moment
    (factors, decompositions, step buffers), each within 3%. No batch factor or bucket copy
    is held after the backward pass (folded where computed and averaged in place, or under
    FSDP2 folded by the ranks that hold them as their averages arrive, by the end of the
    backward pass), nor between steps. Inside ``step()`` the grouped path (every rank a
    worker of every layer, DDP) holds more than two gradient copies on top.
    """
    module = load_bench("factor_memory")
    out = tmp_path / "factor_memory.json"
    results = module.main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(results["rows"]))
    assert sorted((r["world"], r["fraction"], r["fsdp"], r["factor_storage"]) for r in rows) == [
        (1, "1", False, "dense"), (1, "1", False, "packed"), (2, "1", False, "dense"),
        (2, "1", True, "dense"), (2, "1/2", False, "dense"), (2, "1/2", True, "dense")]
    for row in rows:
        for rank in row["ranks"]:
            for moment in ("peak", "between"):
                got = rank[moment]
                assert got["factors_mb"] == pytest.approx(rank["model"]["factors"], rel=1e-9)
                assert got["decompositions_mb"] == pytest.approx(
                    rank["model"]["decompositions"], rel=1e-9), (row["world"], row["fraction"])
            assert rank["between"]["batch_mb"] < 0.01  # nothing of the step is left
            # The folds' 0-d counters only: no batch factor is left after the backward pass
            # (under FSDP2 the holders folded the averages as they arrived).
            assert rank["peak"]["batch_mb"] < 0.01, row
            backward, step = module.modelled(rank["model"])
            ratios = (rank["peak"]["held_mb"] / backward, rank["step"]["held_mb"] / step)
            assert 0.99 <= ratios[0] <= 1.001, (row, ratios)  # 0-d counts
            assert 0.97 <= ratios[1] <= 1.03, (row, ratios)
            assert rank["step"]["start_mb"] == pytest.approx(rank["peak"]["held_mb"])
            assert 0 < rank["step"]["walks"] < rank["step"]["calls"]
            if not row["fsdp"] and row["fraction"] == "1":
                assert rank["step"]["extra_mb"] > 2 * rank["step"]["grad_mb"], rank["step"]
    assert "| 2 | 1/2 |" in module.table(rows) and "step / model" in module.table(rows)
