"""bench/influence/usefulness.py in its --quick form (tiny sizes; no claims)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from tests.support.bench import load_bench


def test_usefulness_quick(tmp_path: Path) -> None:
    module = load_bench("usefulness")
    out = tmp_path / "influence_usefulness.json"
    results = module.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["benchmark"] == "influence_usefulness"
    assert doc["command"].startswith("python bench/influence/usefulness.py --quick")
    assert {"environment", "quick", "settings", "lds", "mislabel", "wall_s", "table"} <= doc.keys()
    assert doc["lds"] == json.loads(json.dumps(results["lds"]))
    settings = doc["settings"]
    assert doc["quick"] and (settings["train"], settings["queries"], settings["subsets"]) == (
        200, 20, 8)
    kronfluence = importlib.util.find_spec("kronfluence") is not None
    lds, mislabel = doc["lds"], doc["mislabel"]
    assert set(lds["methods"]) == {"kaisa_ekfac", "identity", "kronfluence_ekfac"}
    same = {"kaisa_same_draws", "kronfluence_same_draws"} if kronfluence else {
        "kronfluence_same_draws"}
    assert set(mislabel["methods"]) == {"kaisa_ekfac", "identity", "kronfluence_ekfac",
                                        "loss"} | same
    assert mislabel["recipe"]["seeds"] == 1 and len(mislabel["runs"]) == 1
    for name, entry in [*lds["methods"].items(), *mislabel["methods"].items()]:
        if "kronfluence" in name and not kronfluence:
            assert "skipped" in entry
            continue
        assert entry["wall_s"] >= 0, name
    for entry in lds["methods"].values():
        if "lds" in entry:
            assert -1 <= entry["lds"] <= 1 and math.isfinite(entry["se"])
            assert {"median", "positive_fraction"} <= entry.keys()
    run = mislabel["runs"][0]
    for name, entry in mislabel["methods"].items():
        if "recall_at_top" in entry:
            assert 0 <= entry["recall_at_top"] <= 1 and 0 <= entry["auc"] <= 1
            assert entry["per_seed_recall"] == [entry["recall_at_top"]]
            assert run["methods"][name]["top_k"] == 20
    if kronfluence:  # the same Fisher labels: the same scores, the same examples found
        assert (mislabel["methods"]["kaisa_same_draws"]["per_seed_recall"]
                == mislabel["methods"]["kronfluence_same_draws"]["per_seed_recall"])
    assert run["flipped"] == 20 and lds["subset_size"] == 100
    for part in (lds, run):
        assert {"train_s", "test_accuracy"} <= part["model"].keys()
        assert part["agreement"]["kaisa_float32_vs_float64"]["relative_difference"] < 1e-2
        assert ("kaisa_vs_kronfluence" in part["agreement"]) == kronfluence
    assert "| kaisa_ekfac |" in doc["table"]

