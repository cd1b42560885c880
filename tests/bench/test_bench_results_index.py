"""bench/results/README.md indexes every committed result, and only those."""

from __future__ import annotations

import json
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


#: Result files written before the envelope (``bench.harness.write``) existed or by scripts
#: that predate it; every other result must carry the envelope.
_BEFORE_THE_ENVELOPE = frozenset([
    "before_after_one_path", "before_after_since_687fc8b",
    "before_after_since_687fc8b_before_mend", "cnn", "cnn_lr_tuning_16px",
    "conv_covariance_memory", "conv_factor", "convergence-main-job", "convergence",
    "convergence_kfac_v3", "distributed", "fsdp_memory", "gpt", "gpt_after_fixes",
    "gpt_anchors_150", "gpt_blocks", "gpt_ekfac_reduce", "gpt_ekfac_rows256",
    "gpt_kfac_reduce", "gpt_lr_transfer_150", "gpt_lr_transfer_300", "jvp_cost",
    "jvp_linearize", "kernels_cpu", "kernels_cpu_1thread", "kfac_step_cost",
    "plan_dgx_a100_h100profile", "precondition_batching", "step_cost", "step_cost_after",
    "step_cost_ekfac_levers", "step_cost_ekfac_reduce", "step_cost_gpt_inverse",
    "step_cost_kfac_after", "step_cost_kfac_before", "step_cost_kfac_jvp",
    "step_cost_kfac_reduce", "step_cost_memory", "step_cost_resnet_quiet", "step_floor",
    "step_overhead_ext", "step_overhead_torch",
])


def _rows() -> dict[str, list[str]]:
    rows = [line for line in (RESULTS / "README.md").read_text().splitlines()
            if line.startswith("| `")]
    return {re.match(r"\| `([^`]+)` \|", r).group(1):  # type: ignore[union-attr]
            [c.strip() for c in r.strip("|").split(" | ")] for r in rows}


def test_no_result_names_a_machines_own_folders() -> None:
    """No work tree, temporary or output folder of the machine that made a result."""
    from bench.harness import MACHINE_PATH

    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".json", ".md"):
            found = MACHINE_PATH.findall(path.read_text())
            assert not found, f"{path.name} records {found[:3]}"


def test_new_results_carry_the_envelope_and_their_row_says_its_commit() -> None:
    rows = _rows()
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        if path.stem in _BEFORE_THE_ENVELOPE:
            continue
        assert isinstance(doc, dict) and doc.get("schema") == 1, f"{path.name}: no envelope"
        if path.name.startswith("gpu-"):  # the GPU script's own schema (bench/gpu/schema.py)
            assert {"device", "environment", "stages"} <= doc.keys(), path.name
            continue
        assert {"benchmark", "command", "environment"} <= doc.keys(), path.name
        commit = doc["environment"]["commit"]
        row = rows[path.name]
        assert commit.removesuffix("+dirty").startswith(row[2]), (path.name, commit, row[2])
        if commit.endswith("+dirty"):
            assert "uncommitted" in row[3], f"{path.name}: made from a dirty tree, unsaid"
