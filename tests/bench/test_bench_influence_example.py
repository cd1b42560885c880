"""bench/influence/example.py in a small form: the JSON's numbers and the picture."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench import load_bench


def test_influence_example_smoke(tmp_path: Path) -> None:
    out = tmp_path / "example.json"
    doc = load_bench("example").main(["--train", "200", "--epochs", "3", "--out", str(out)])
    assert out.with_suffix(".png").is_file()
    assert doc["flipped"] == 20 and set(doc["recall_at_10_percent"]) == {
        "self_influence", "loss"}
    assert all(len(q["most_helpful"]) == len(q["most_harmful"]) == 5
               for q in doc["queries"].values())
