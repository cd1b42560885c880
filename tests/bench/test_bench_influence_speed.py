"""bench/influence/vs_kronfluence.py in its smoke form (no timing claim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import load_bench


@pytest.mark.slow
def test_influence_speed_smoke(tmp_path: Path) -> None:
    pytest.importorskip("kronfluence", reason="kronfluence 1.0.1 is not installed")
    out = tmp_path / "vs.json"
    doc = load_bench("vs_kronfluence").main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text())["kaisa_over_kronfluence"] == doc["kaisa_over_kronfluence"]
    assert set(doc["seconds"]) == {"kaisa", "kronfluence"}
    assert doc["settings"]["train"] == 64 and doc["seconds"]["kaisa"]["samples"] == 1


@pytest.mark.slow
def test_influence_speed_smoke_gpt(tmp_path: Path) -> None:
    """The byte GPT: kaisa scores every block kind, Kronfluence its Linear layers."""
    pytest.importorskip("kronfluence", reason="kronfluence 1.0.1 is not installed")
    out = tmp_path / "vs.json"
    doc = load_bench("vs_kronfluence").main(["--model", "gpt", "--tiny", "--out", str(out)])
    assert doc["benchmark"] == "influence_vs_kronfluence_gpt"
    covered = doc["parameters_scored"]
    assert covered["kaisa"] > 0.98 and 0.5 < covered["kronfluence"] < 0.8
    assert doc["settings"]["train"] == 32 and doc["seconds"]["kaisa"]["samples"] == 1
