"""The GPU script's parts that run anywhere: its runners, schema, table and results page.

The script itself runs on a GPU (``bench/gpu/run.sh``); CI runs its dry run on the CPU
(``.ci/run``). These tests check what its correctness rests on: a test or sanitizer case
that kills the process is recorded and the run resumes after it, every committed result
file is well formed, and the results page in docs/cuda-kernels.md is the rendering of
the committed runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import gpu_tests  # noqa: E402
import report  # noqa: E402
import sanitize  # noqa: E402
from schema import validate  # noqa: E402
from table import render  # noqa: E402

CRASHING_TESTS = textwrap.dedent(
    """
    import os, signal

    def test_a():
        pass

    def test_b_crashes():
        os.kill(os.getpid(), signal.SIGSEGV)

    def test_c():
        pass

    def test_d_fails():
        assert False, "the message"

    def test_e_crashes_too():
        os.kill(os.getpid(), signal.SIGSEGV)
    """
)


@dataclass
class _Done:
    rc: int | None
    output: str


def _pytest_in(folder: Path) -> gpu_tests.Runner:
    def run(args: list[str], seconds: float) -> _Done:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "bench" / "gpu")}
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=folder,
            capture_output=True, text=True, timeout=seconds, check=False, env=env)
        return _Done(res.returncode, res.stdout + res.stderr)

    return run


def test_a_crashing_test_is_recorded_and_the_run_resumes_after_it(tmp_path: Path) -> None:
    (tmp_path / "test_crash.py").write_text(CRASHING_TESTS)
    run = _pytest_in(tmp_path)
    ids, _ = gpu_tests.collect(run, ["test_crash.py"], 60)
    assert [i.split("::")[1] for i in ids] == ["test_a", "test_b_crashes", "test_c",
                                               "test_d_fails", "test_e_crashes_too"]
    logs: list[str] = []
    result = gpu_tests.run_resumable(run, ids, 120, logs.append)
    got = {i.split("::")[1]: o for i, o in result.outcome.items()}
    assert got == {"test_a": "PASSED", "test_b_crashes": "CRASHED", "test_c": "PASSED",
                   "test_d_fails": "FAILED", "test_e_crashes_too": "CRASHED"}
    assert result.runs == 2 and len(logs) == 2  # the last crash ends the run: no test after it
    summary = result.summary()
    assert (summary["passed"], summary["failed"], summary["crashed"], summary["not_run"]) == (
        2, 1, 2, 0)
    assert "Segmentation fault" in summary["failures"]["test_crash.py::test_b_crashes"]
    assert "the message" in summary["failures"]["test_crash.py::test_d_fails"]


def test_a_sanitizer_stopping_at_a_case_resumes_after_it() -> None:
    names = ["one", "two", "three", "four"]
    outputs = iter([
        _Done(1, "ok    one\n========= Internal Sanitizer Error\n"),  # stopped in "two"
        _Done(sanitize.ERROR_EXIT, "ok    three\nFAIL  four: RuntimeError: x\n"
              "========= ERROR SUMMARY: 2 errors\n"),
    ])
    calls: list[list[str]] = []

    def run(args: list[str], seconds: float) -> _Done:
        calls.append(args)
        return next(outputs)

    result = sanitize.run_tool(run, ["cs", "--tool", "racecheck", "cases"], names, 60,
                               lambda text: None)
    assert result["cases"] == {"one": "ok", "two": "crashed", "three": "ok", "four": "FAIL"}
    assert result["status"] == "errors" and result["errors"] == 2
    assert calls[1][-2:] == ["--after", "two"]


def _committed() -> list[tuple[str, dict]]:
    return report.load_runs()


def test_committed_gpu_runs_are_well_formed_and_render() -> None:
    runs = _committed()
    for file, result in runs:
        assert validate(result) == [], file
        assert result["device"] in render(result)


def test_the_schema_rejects_a_kernel_row_without_its_floor() -> None:
    runs = [r for _, r in _committed() if r["stages"].get("kernels", {}).get("status") ==
            "passed"]
    if not runs:
        pytest.skip("no committed run has kernel results")
    broken = copy.deepcopy(runs[0])
    row = next(iter(broken["stages"]["kernels"]["detail"]["results"]["covariance"].values()))
    del row["floor_ms"]
    assert any("floor_ms" in p for p in validate(broken))
    broken["stages"]["tests"]["status"] = "fine"
    assert any("bad status" in p for p in validate(broken))


def test_the_results_page_is_the_rendering_of_the_committed_runs() -> None:
    doc = (ROOT / "docs" / "cuda-kernels.md").read_text()
    assert report.BEGIN in doc and report.END in doc
    assert report.splice(doc, report.render_docs(_committed())) == doc, (
        "docs/cuda-kernels.md is out of date: python bench/gpu/report.py --write "
        "docs/cuda-kernels.md")


def test_without_runs_the_page_says_never_run_on_a_gpu() -> None:
    assert "Never run on a GPU" in report.render_docs([])


def test_the_step_stage_reports_a_captured_column_and_renders_it(tmp_path: Path) -> None:
    """The dry run's captured entries (on the CPU: why not), the schema and the table."""
    import schema
    import table

    step_cost = _gpu_step_cost()
    out = tmp_path / "s.json"
    assert step_cost.main(["--device", "cpu", "--tiny", "--tasks", "resnet50",
                           "--out", str(out)]) == 0
    detail = json.loads(out.read_text())
    rows = detail["tasks"]["resnet50"]["configs"]
    assert rows["sgd"]["captured"]["label"] == "-"
    assert rows["kfac_pre 10/100 + sgd"]["captured"]["label"] == "-"  # plain: 9 in 10
    assert "CUDA" in rows["sgd"]["captured"]["error"]
    result = {"device": "cpu", "date": "today", "seconds": 1.0, "budget_s": 1.0,
              "stages": {"step_cost": {"status": "passed", "detail": detail}}}
    assert not [p for p in schema._step_cost(detail) if "captured" in p]
    assert "captured" in table.render(result) and "-: not run" in table.render(result)


def test_run_until_steps_to_a_run_of_the_label() -> None:
    step_cost = _gpu_step_cost()
    done: list[int] = []
    c = step_cost.Config("x", None, done.append, {"F": 10, "I": 100})
    assert step_cost.run_until(c, 8, "-", 4) == 11 and done == [8, 9, 10]
    assert step_cost.run_until(c, 11, "-", 4) == 11 and done == [8, 9, 10]


def _gpu_step_cost() -> Any:
    """``bench/gpu/step_cost.py`` (its name is also ``bench/step_cost``'s, a package)."""
    spec = importlib.util.spec_from_file_location("gpu_step_cost",
                                                  ROOT / "bench" / "gpu" / "step_cost.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:  # registered first: its dataclasses look their module up
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def test_the_representative_tests_take_each_parameter_value_of_each_test_once() -> None:
    ids = [f"t.py::f[cuda-{shape}-{dtype}]" for shape in ("1x1", "3x200", "37x5")
           for dtype in ("dtype0", "dtype1")] + ["t.py::g", "t.py::h[cuda-a]", "t.py::h[cuda-b]"]
    chosen = gpu_tests.representative(ids)
    assert chosen == ["t.py::f[cuda-1x1-dtype0]", "t.py::f[cuda-1x1-dtype1]",
                      "t.py::f[cuda-3x200-dtype0]", "t.py::f[cuda-37x5-dtype0]",
                      "t.py::g", "t.py::h[cuda-a]", "t.py::h[cuda-b]"]
    for test in {i.partition("[")[0] for i in ids}:  # every value of every position
        mine = [i.partition("[")[2] for i in chosen if i.startswith(test + "[")]
        theirs = [i.partition("[")[2] for i in ids if i.startswith(test + "[")]
        for pos in range(len(theirs[0].split("-")) if theirs else 0):
            assert {p.split("-")[pos] for p in mine} == {p.split("-")[pos] for p in theirs}
