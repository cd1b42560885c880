"""bench/results/README.md indexes every committed result, and only those."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_every_result_is_indexed_and_every_entry_exists() -> None:
    rows = [line for line in (RESULTS / "README.md").read_text().splitlines()
            if line.startswith("| `")]
    indexed = [re.match(r"\| `([^`]+)` \|", line).group(1) for line in rows]  # type: ignore[union-attr]
    assert len(indexed) == len(set(indexed)), "a file indexed twice"
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert sorted(indexed) == files
    for line in rows:  # file | command | commit | machine | date
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 5 and all(cells), line
        assert re.fullmatch(r"[0-9a-f]{7,40}", cells[2]), line
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[4]), line
