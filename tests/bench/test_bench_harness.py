"""bench/harness.py: interleaved timing, the environment record, the one JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

from bench import harness


def test_interleaved_rotates_the_order_and_times_every_configuration() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    rounds: list[int] = []
    times = harness.interleaved(fns, 3, warmup=1, before_round=rounds.append)
    assert calls == list("abc" "abc" "bca" "cab") and rounds == [0, 1, 2]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    summary = harness.summary({"base": [1.0, 2.0, 3.0], "x": [3.0, 4.0, 5.0]}, baseline="base")
    assert summary["x"] == {"median": 4000.0, "samples": 3, "ratio_to_baseline": 2.0}


def test_write_puts_the_envelope_first_and_returns_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "r.json"
    doc = harness.write(out, "demo", {"rows": [1, 2]}, ["--smoke"], script="bench/x/demo.py")
    assert json.loads(out.read_text()) == doc
    assert list(doc)[:4] == ["schema", "benchmark", "command", "environment"]
    assert doc["command"] == "python bench/x/demo.py --smoke" and doc["rows"] == [1, 2]
    env = doc["environment"]
    assert {"date", "commit", "cpu", "threads", "torch", "host"} <= set(env)
    assert harness.load(out) == doc
