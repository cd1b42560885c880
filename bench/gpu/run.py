"""A GPU day in one command: build, test, sanitize and time kaisa's CUDA kernels.

Runs on a machine with one CUDA GPU, nvcc and PyTorch (no network), in at most
``--budget`` seconds (default 480), as stages in separate processes, each under its own
time cap, so one slow or crashing stage cannot take the others with it:

============  ====  ==================================================================
stage         cap   what it does
============  ====  ==================================================================
environment    15   GPU, driver, nvcc, torch, CuPy, compute-sanitizer: what is there
build         150   ``python setup.py build_ext --inplace`` for the card's capability
                    (``TORCH_CUDA_ARCH_LIST``), ``MAX_JOBS`` = all cores; then the
                    extension must load with a CUDA kernel for every op
tests          90   ``pytest -m gpu tests`` (``tests/ops/test_cuda_ops.py`` and the other
                    CUDA suites on the ``cuda`` backend), each parameter value of each
                    test once (every op, dtype and shape class; ``--all-tests``: all
                    of them), 30 s a test, resumed past a test that crashes the
                    process (``bench/gpu/gpu_tests.py``)
sanitizer      60   ``compute-sanitizer`` memcheck, racecheck and synccheck (a third of
                    the cap each) over ``bench/gpu/sanitize_cases.py``: every op and
                    eigh routine once, small shapes; resumed past a case that stops
                    the sanitizer (``bench/gpu/sanitize.py``)
kernels        75   ``bench/kernels/bench_kernels_gpu.py``: covariance (fused / GEMM, TF32 off
                    and on), conv covariance, batched eigh (kaisa, torch, CuPy), the
                    syevj knee, preconditioning, the cheaper decompositions (Cholesky
                    / Newton-Schulz inverses, eigh / warm refresh); each row with its
                    floor and gap
step_cost      90   ``bench/gpu/step_cost.py``: optimizer step cost as ratios in one
                    process (ResNet-50 K-FAC+SGD / SGD, GPT EKFAC / AdamW / Muon,
                    autoencoder KFAC / Adam)
============  ====  ==================================================================

The caps are shares of the budget (scaled to ``--budget``; they sum to 480 s): stage k
must end by the start plus the caps of stages 1..k, so time a stage leaves unused goes to
the ones after it. A stage whose predecessor it needs failed (no extension) is recorded
as not run. The end prints what
ran and what did not, and ``--out`` receives::

    gpu-<device>-<date>.json   every figure (schema: bench/gpu/schema.py)
    table.md                   the same, short
    log-<stage>.txt            each stage's output

``--dry-run`` (CI, no GPU) runs the same plumbing on the CPU at tiny sizes: the build
stage only checks that the installed extension loads, the gpu-marked tests the CPU
collects run (and skip),
the sanitizer cases run without compute-sanitizer, and the benchmarks run on the CPU;
the JSON must still validate::

    bash bench/gpu/run.sh --out /tmp/gpu                 # on the GPU machine
    python bench/gpu/run.py --dry-run --out /tmp/gpu-dry # anywhere
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import sanitize  # noqa: E402
import toolchain  # noqa: E402
from gpu_tests import collect, representative, run_resumable  # noqa: E402
from schema import validate  # noqa: E402
from table import render  # noqa: E402

from bench.harness import portable  # noqa: E402


@dataclass(frozen=True)
class Stage:
    """One stage: its name, time cap in seconds and the stage it needs."""

    name: str
    cap_s: float
    needs: str | None = None


STAGES = (
    Stage("environment", 15),
    Stage("build", 150),
    Stage("tests", 90, needs="build"),
    Stage("sanitizer", 60, needs="build"),
    Stage("kernels", 75, needs="build"),
    Stage("step_cost", 90, needs="build"),
)


@dataclass
class Outcome:
    """What one subprocess did."""

    rc: int | None  # None: killed at its time cap
    seconds: float
    output: str


def run_capped(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Outcome:
    """Runs ``cmd`` in its own process group; kills the whole group at ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
            str(ROOT), os.environ.get("PYTHONPATH")])), **(env or {})},
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return Outcome(rc, time.monotonic() - start, out or "")


def _probe(cmd: list[str]) -> str | None:
    """First line of ``cmd``'s output, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (res.stdout or res.stderr).strip().splitlines()
    return lines[0].strip() if res.returncode == 0 and lines else None


def sanitizer_path() -> str | None:
    """The ``compute-sanitizer`` executable: on PATH, else in the usual toolkit places."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    places = [Path(nvcc).resolve().parent] if nvcc else []
    places += [Path("/usr/local/cuda/bin"), Path("/usr/local/cuda/compute-sanitizer")]
    places += sorted(Path("/opt/nvidia").glob("**/compute-sanitizer")) if Path(
        "/opt/nvidia").exists() else []
    for p in places:
        exe = p / "compute-sanitizer" if p.is_dir() else p
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    return None


_PY_INFO = """
import json, torch
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1))
try:
    import cupy
    info["cupy"] = cupy.__version__
except Exception as err:
    info["cupy"] = None
print(json.dumps(info))
"""


def stage_environment(ctx: Context, timeout: float) -> dict[str, Any]:
    """What the machine has."""
    out = run_capped([sys.executable, "-c", _PY_INFO], timeout)
    ctx.log("environment", out.output)
    info: dict[str, Any] = json.loads(out.output.strip().splitlines()[-1]) if out.rc == 0 else {}
    info.update(
        python=platform.python_version(), cpus=os.cpu_count(),
        driver=_probe(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        nvcc=_probe(["sh", "-c", "nvcc --version | grep release"]),
        compute_sanitizer=sanitizer_path(),
    )
    ctx.env = info
    ok = out.rc == 0 and (ctx.dry_run or bool(info.get("cuda_available")))
    return {"status": "passed" if ok else "failed", "detail": info}


_LOAD_CHECK = """
import json, kaisa.ops as o
print(json.dumps({"backend": o.backend(), "cuda_kernels_error": o.cuda_kernels_error(),
                  "ops": {op: list(o.kernels(op)) for op in o.OPS}}))
"""


def stage_build(ctx: Context, timeout: float) -> dict[str, Any]:
    """Builds the extension in place for this card, then checks that it loads and that an
    argument check's error message comes back as an error (not a crash)."""
    cap = ctx.env.get("capability")
    compiler = toolchain.choose(ctx.cxx)
    env = {"MAX_JOBS": str(os.cpu_count() or 2), **toolchain.build_env(compiler)}
    if cap:
        env["TORCH_CUDA_ARCH_LIST"] = str(cap)
    result: dict[str, Any] = {"arch": env.get("TORCH_CUDA_ARCH_LIST"), "jobs": env["MAX_JOBS"],
                              "compiler": compiler}
    if ctx.dry_run:
        result["build"] = "not run (dry run): the installed extension is checked"
    else:
        build = run_capped([sys.executable, "setup.py", "build_ext", "--inplace"], timeout - 20,
                           env)
        ctx.log("build", build.output)
        result["build_s"] = round(build.seconds, 1)
        if build.rc != 0:
            result["error"] = "timed out" if build.rc is None else f"exit code {build.rc}"
            return {"status": "failed", "detail": result}
    load = run_capped([sys.executable, "-c", _LOAD_CHECK], 20)
    ctx.log("build", load.output)
    try:
        info = json.loads(load.output.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        result["error"] = "the extension check printed no JSON"
        return {"status": "failed", "detail": result}
    result.update(info)
    check = run_capped([sys.executable, "-c", toolchain.ERROR_PATH], 30)
    ctx.log("build", check.output)
    result["error_path"] = (check.output.strip().splitlines() or [""])[-1] if check.rc == 0 else (
        f"crashed (exit code {check.rc})")
    want_cuda = not ctx.dry_run
    ok = info["backend"] == "ext" and (not want_cuda or info["cuda_kernels_error"] is None)
    return {"status": "passed" if ok else "failed", "detail": result}


def stage_tests(ctx: Context, timeout: float) -> dict[str, Any]:
    """The gpu-marked tests on the cuda backend, resumed past any test that crashes pytest.

    In a dry run the same runner runs the gpu-marked tests the CPU collects (they skip).
    """
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--timeout", "30"]

    def run(args: list[str], seconds: float) -> Outcome:
        return run_capped([*base, *args], seconds, {"PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "bench" / "gpu")])})

    t0 = time.monotonic()
    every, listing = collect(run, ["tests", "-m", "gpu", "--continue-on-collection-errors"],
                             min(60.0, timeout / 2))
    ctx.log("tests", listing)
    ids = every if ctx.all_tests else representative(every)
    result = run_resumable(run, ids, timeout - (time.monotonic() - t0),
                           lambda text: ctx.log("tests", text))
    detail = {"command": " ".join([*base[1:], "-m gpu tests (ids in run order)"]),
              "gpu_tests": len(every),
              "chosen": "every gpu test" if ctx.all_tests else
              "each parameter value of each test once (gpu_tests.representative)",
              **result.summary()}
    if result.timed_out:
        return {"status": "timed out", "detail": detail}
    ran = detail["passed"] + detail["skipped"]
    ok = bool(ids) and detail["not_run"] == 0 and ran == len(ids) and (
        ctx.dry_run or detail["passed"] > 0)
    return {"status": "passed" if ok else "failed", "detail": detail}


SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


def stage_sanitizer(ctx: Context, timeout: float) -> dict[str, Any]:
    """compute-sanitizer's three tools over the small kernel cases (``sanitize.py``)."""
    cases = [sys.executable, "bench/gpu/sanitize_cases.py"]
    exe = ctx.env.get("compute_sanitizer")
    listing = run_capped([*cases, "--list"], 30)
    names = listing.output.split("\n")[:-1] if listing.rc == 0 else []
    if ctx.dry_run or not exe:
        out = run_capped([*cases, "--device", "cpu" if ctx.dry_run else "cuda"], timeout)
        ctx.log("sanitizer", out.output)
        why = "dry run" if ctx.dry_run else "compute-sanitizer not found"
        tools = {t: {"status": f"not run ({why})"} for t in SANITIZER_TOOLS}
        status = ("passed" if out.rc == 0 and names else "failed") if ctx.dry_run else "not run"
        return {"status": status, "detail": {"cases": names, "cases_rc": out.rc, "tools": tools}}
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # exact allocations: every overrun is seen

    def run(args: list[str], seconds: float) -> Outcome:
        return run_capped(args, seconds, env)

    deadline = time.monotonic() + timeout
    tools = {}
    for i, tool in enumerate(SANITIZER_TOOLS):
        share = (deadline - time.monotonic()) / (len(SANITIZER_TOOLS) - i)
        cmd = [exe, "--tool", tool, "--error-exitcode", str(sanitize.ERROR_EXIT),
               "--print-limit", "20"]
        if tool != "memcheck":  # shared-memory hazards and barriers: kaisa's kernels only
            cmd += ["--kernel-name", "kns=kaisa"]
        tools[tool] = sanitize.run_tool(run, [*cmd, *cases, "--device", "cuda"], names, share,
                                        lambda text: ctx.log("sanitizer", text))
    ok = bool(names) and all(t["status"] == "passed" for t in tools.values())
    return {"status": "passed" if ok else "failed", "detail": {"cases": names, "tools": tools}}


def _json_stage(ctx: Context, name: str, cmd: list[str], timeout: float,
                env: dict[str, str]) -> dict[str, Any]:
    """Runs a benchmark that writes a JSON file; the file's content is the stage's detail."""
    path = ctx.work / f"{name}.json"
    path.unlink(missing_ok=True)
    out = run_capped(cmd, timeout, {**env, "KAISA_BENCH_OUT": str(path)})
    ctx.log(name, out.output)
    detail: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    detail["seconds"] = round(out.seconds, 1)
    if out.rc is None:
        return {"status": "timed out", "detail": detail}
    ok = out.rc == 0 and path.exists()
    return {"status": "passed" if ok else "failed", "detail": detail}


def stage_kernels(ctx: Context, timeout: float) -> dict[str, Any]:
    """The kernel benchmarks (pytest-benchmark module), their JSON as the detail."""
    env = {"KAISA_BENCH_DEVICE": "cpu", "KAISA_BENCH_TINY": "1"} if ctx.dry_run else {}
    env["KAISA_BENCH_DEADLINE"] = str(time.time() + timeout - 10)
    cmd = [sys.executable, "-m", "pytest", "bench/kernels/bench_kernels_gpu.py", "-q",
           "-p", "no:cacheprovider", "--timeout", str(int(timeout))]
    return _json_stage(ctx, "kernels", cmd, timeout, env)


def stage_step_cost(ctx: Context, timeout: float) -> dict[str, Any]:
    """Optimizer step-cost ratios on the GPU."""
    cmd = [sys.executable, "bench/gpu/step_cost.py", "--budget", str(int(timeout - 10))]
    if ctx.dry_run:
        cmd += ["--device", "cpu", "--tiny"]
    return _json_stage(ctx, "step_cost", cmd, timeout, {})


RUNNERS: dict[str, Callable[[Context, float], dict[str, Any]]] = {
    "environment": stage_environment, "build": stage_build, "tests": stage_tests,
    "sanitizer": stage_sanitizer, "kernels": stage_kernels, "step_cost": stage_step_cost,
}


@dataclass
class Context:
    """What the stages share."""

    out: Path
    work: Path
    dry_run: bool
    env: dict[str, Any]
    cxx: str | None = None
    all_tests: bool = False

    def log(self, stage: str, text: str) -> None:
        """Appends ``text`` to the stage's log file (its last 4 MB kept)."""
        path = self.out / f"log-{stage}.txt"
        with path.open("a", encoding="utf-8") as f:
            f.write(text[-4_000_000:])
            f.write("\n")


def device_slug(name: str) -> str:
    """A file-name form of a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def main(argv: list[str] | None = None) -> int:
    """Runs the stages and writes the JSON and table; exit code 0 when every stage passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all stages")
    parser.add_argument("--dry-run", action="store_true", help="CPU plumbing check, tiny sizes")
    parser.add_argument("--all-tests", action="store_true",
                        help="the tests stage runs every gpu test (default: each parameter "
                        "value of each test once)")
    parser.add_argument("--cxx", default=None,
                        help="C++ compiler for the build (default: bench/gpu/toolchain.py)")
    parser.add_argument("--stages", default=",".join(s.name for s in STAGES),
                        help="comma-separated subset (environment always runs)")
    args = parser.parse_args(argv)
    wanted = {"environment", *(s.strip() for s in args.stages.split(","))}
    unknown = wanted - set(RUNNERS)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {list(RUNNERS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / ".work"
    work.mkdir(exist_ok=True)
    ctx = Context(out=args.out, work=work, dry_run=args.dry_run, env={}, cxx=args.cxx,
                  all_tests=args.all_tests)
    start = time.monotonic()
    deadline = start + args.budget
    started = datetime.datetime.now(datetime.timezone.utc)
    stages: dict[str, Any] = {}
    todo = [s for s in STAGES if s.name in wanted]
    scale = args.budget / sum(s.cap_s for s in todo)
    for k, stage in enumerate(todo):
        # each stage ends by its share of the budget summed so far: time a stage leaves
        # unused goes to the next ones
        ends = start + scale * sum(s.cap_s for s in todo[: k + 1])
        timeout = min(ends, deadline) - time.monotonic()
        need = stages.get(stage.needs or "", {}).get("status", "passed")
        if stage.needs and need != "passed":
            stages[stage.name] = {"status": f"not run ({stage.needs} {need})", "seconds": 0.0}
        elif timeout < 5:
            stages[stage.name] = {"status": "not run (no time left)", "seconds": 0.0}
        else:
            t0 = time.monotonic()
            print(f"=== {stage.name} (cap {timeout:.0f} s)", flush=True)
            try:
                stages[stage.name] = RUNNERS[stage.name](ctx, timeout)
            except Exception as err:  # a broken stage is recorded, the others still run
                stages[stage.name] = {"status": "failed", "detail": {"error": repr(err)}}
            stages[stage.name]["seconds"] = round(time.monotonic() - t0, 1)
            stages[stage.name]["cap_s"] = round(timeout, 1)
        print(f"    {stage.name}: {stages[stage.name]['status']}", flush=True)
    result = {
        "schema": 1,
        "dry_run": args.dry_run,
        "date": started.strftime("%Y-%m-%d"),
        "started_utc": started.isoformat(timespec="seconds"),
        "device": ctx.env.get("device", "cpu (dry run)" if args.dry_run else "unknown"),
        "environment": ctx.env,
        "budget_s": args.budget,
        "seconds": round(time.monotonic() - start, 1),
        "stages": stages,
    }
    problems = validate(result)
    result["schema_problems"] = problems
    name = f"gpu-{device_slug(str(result['device']))}-{result['date']}.json"
    # no path of the GPU machine's folders (its output folder) in what gets committed
    (args.out / name).write_text(portable(json.dumps(result, indent=1, sort_keys=True)) + "\n")
    table = render(result)
    (args.out / "table.md").write_text(table)
    shutil.rmtree(work, ignore_errors=True)
    print(table)
    print(f"wrote {args.out / name}")
    if problems:
        print("schema problems:", *problems, sep="\n  ")
        return 2
    return 0 if all(s["status"] == "passed" for s in stages.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
