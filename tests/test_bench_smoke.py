"""bench/step_cost.py in its smoke form (tiny sizes, a few steps; no timing claims)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.bench import load_bench


def test_step_cost_smoke(tmp_path: Path) -> None:
    module = load_bench("step_cost")
    out = tmp_path / "step_cost.json"
    results = module.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert out.with_suffix(".png").stat().st_size > 0
    tasks = results["tasks"]
    assert set(tasks) == {"resnet32", "autoencoder", "gpt"}
    assert set(tasks["gpt"]) == {"adamw", "adam", "kfac_pre 10/100 + adamw", "kfac adaptive",
                                 "ekfac"}
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
