"""Mutation check of the emulated CUDA kernel tests: do they catch a broken kernel?

Each mutation edits one line of a copy of ``csrc`` (never the project's own files),
builds the emulator from that copy (``KAISA_SIMT_CSRC``) and runs
``tests/ops/test_cuda_ops.py`` and ``tests/ops/test_simt.py`` on it: first the plain build
(every failing test is recorded), then, when the plain run misses the mutation, the
AddressSanitizer + UndefinedBehaviorSanitizer build (which stops at the first report).
The table it prints is the one in ``docs/cuda-kernels.md``.

Usage: ``python -m tools.simt.mutate [--only ID ...] [--json FILE]`` (minutes per mutation).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.simt.build import CSRC_ENV, ROOT, asan_runtime

WORK = ROOT / "build" / "simt-mutant-src" / "csrc"
TESTS = ["tests/ops/test_cuda_ops.py", "tests/ops/test_cuda_host_work.py",
         "tests/ops/test_cuda_eigh_status.py", "tests/ops/test_cuda_covariance_gemm.py",
         "tests/ops/test_simt.py"]


@dataclass(frozen=True)
class Mutation:
    """One edit of one file of ``csrc``."""

    id: str
    kind: str
    file: str
    old: str
    new: str
    what: str


MUTATIONS = [
    Mutation("barrier-compute", "removed barrier", "cuda/covariance.cu",
             "    if (!diag) load(Bs, j0, kTile);\n    __syncthreads();\n",
             "    if (!diag) load(Bs, j0, kTile);\n",
             "gram_tile_kernel: no __syncthreads between staging a slab and the FMAs"),
    Mutation("barrier-trailing", "removed barrier", "cuda/covariance.cu",
             "      }\n    }\n    __syncthreads();\n  }\n", "      }\n    }\n  }\n",
             "gram_tile_kernel: no __syncthreads before the next slab overwrites shared memory"),
    Mutation("barrier-conv-rows", "removed barrier", "cuda/covariance.cu",
             "above.\n      __syncthreads();\n", "above.\n",
             "gram_tile_kernel (conv): no __syncthreads after decoding a slab's rows"),
    Mutation("barrier-finalize", "removed barrier", "cuda/covariance.cu",
             "    tile[r][threadIdx.x] = s;\n  }\n  __syncthreads();\n",
             "    tile[r][threadIdx.x] = s;\n  }\n",
             "finalize_kernel: no __syncthreads between filling and mirroring the tile"),
    Mutation("bound-column", "off-by-one bound", "cuda/covariance.cu",
             "if (j < g.d) out[", "if (j <= g.d) out[",
             "gram_tile_kernel writes column j == d (one past the row) of its partial tile"),
    Mutation("bound-image", "off-by-one bound", "cuda/covariance.cu",
             "static_cast<unsigned>(ih) < static_cast<unsigned>(g.H)",
             "static_cast<unsigned>(ih) <= static_cast<unsigned>(g.H)",
             "conv gather reads input row ih == H instead of zero padding"),
    Mutation("bound-elementwise", "off-by-one bound", "cuda/precondition.cu",
             "e < mn; e += step)", "e <= mn; e += step)",
             "divide_kernel processes element e == m * n (one past the matrix)"),
    Mutation("stride-batch", "wrong stride", "cuda/precondition.cu",
             "const T* dab = da + static_cast<int64_t>(b) * n;",
             "const T* dab = da + static_cast<int64_t>(b) * m;",
             "divide_kernel steps over da's batch by m instead of n"),
    Mutation("bound-direct", "off-by-one bound", "cuda/covariance.cu",
             "if (j >= g.d) continue;\n        const scalar_t v", "if (j > g.d) continue;\n"
             "        const scalar_t v",
             "gram_tile_kernel without split-K writes column j == d of the output"),
    Mutation("no-mirror", "missing write", "cuda/covariance.cu",
             "        if (!diag) o[static_cast<int64_t>(j) * g.d + i] = v;\n", "",
             "gram_tile_kernel without split-K never writes the lower triangle"),
    Mutation("stride-rows", "wrong stride", "cuda/covariance.cu",
             "x[r * g.d_data + col]", "x[r * g.d + col]",
             "linear gather uses d (with the bias column) as the row stride of x"),
    Mutation("stride-splits", "wrong stride", "cuda/covariance.cu",
             "p[static_cast<int64_t>(sp) * groups * dd]", "p[static_cast<int64_t>(sp) * dd]",
             "finalize_kernel steps over splits by one group's slab, not all groups'"),
    Mutation("ld-cusolver", "wrong leading dimension", "cuda/eigh.cu",
             "return cusolverDnSsyevd(h, kJobz, kUplo, n, a, n, w, work, lwork, info);",
             "return cusolverDnSsyevd(h, kJobz, kUplo, n, a, n + 1, w, work, lwork, info);",
             "float syevd gets lda = n + 1 for n x n matrices"),
    Mutation("ld-cublas", "wrong leading dimension", "cuda/precondition.cu",
             "const int ldb = tb ? k : n;", "const int ldb = tb ? n : k;",
             "gemm_rm swaps the leading dimension of B"),
    Mutation("info-ignored", "ignored info", "cuda/eigh.cu",
             "const int code = st[2 * b];", "const int code = 0;",
             "batched_eigh ignores cuSOLVER's per-matrix info"),
    Mutation("status-info-ignored", "ignored info", "cuda/eigh.cu",
             "return at::stack({info, nonfinite}, 1);", "return at::stack({nonfinite, nonfinite}, 1);",
             "batched_eigh_status's device status drops cuSOLVER's per-matrix info"),
    Mutation("uplo", "wrong triangle", "cuda/eigh.cu",
             "kUplo = CUBLAS_FILL_MODE_UPPER;", "kUplo = CUBLAS_FILL_MODE_LOWER;",
             "batched_eigh reads the row-major upper triangle"),
    Mutation("no-join", "missing stream join", "cuda/eigh.cu",
             "  const JoinStreams join{main, side};  // joins even if a call below throws\n", "",
             "syevd fan-out never makes the current stream wait for its side streams"),
    Mutation("no-rebind", "stale stream", "cuda/eigh.cu",
             "  TORCH_CUSOLVER_CHECK(cusolverDnSetStream(h, stream.stream()));\n", "",
             "cuSOLVER handles are never bound to the current stream"),
    Mutation("workspace", "short workspace", "cuda/eigh.cu",
             "at::Tensor work = at::empty({std::max(lwork, 1)}, like.options());",
             "at::Tensor work = at::empty({std::max(lwork / 2, 1)}, like.options());",
             "syevjBatched workspace allocated at half the queried size"),
    Mutation("host-workspace", "use after free", "cuda/eigh.cu",
             "run_xsyev_batched<T>(a, w, inf, n, batch, vecs_cm, host_ws);",
             "{ std::vector<std::vector<char>> ws; "
             "run_xsyev_batched<T>(a, w, inf, n, batch, vecs_cm, ws); }",
             "XsyevBatched's host workspaces freed before the queued calls run"),
    Mutation("gemm-beta", "lost accumulation", "cuda/covariance.cu",
             "const acc_t* beta = r0 == 0 ? &zero : &one;", "const acc_t* beta = &zero;",
             "covariance GEMM path: beta = 0 on every chunk (each chunk overwrites the sum)"),
    Mutation("gemm-ldc", "wrong leading dimension", "cuda/covariance.cu",
             "beta, cp, c_type, g.d, c.compute", "beta, cp, c_type, g.d - 1, c.compute",
             "covariance GEMM path: ldc = d - 1 for the d x d accumulator"),
    Mutation("gemm-chunk-offset", "wrong offset", "cuda/covariance.cu",
             "const scalar_t* a = xp + r0 * g.d_data;", "const scalar_t* a = xp;",
             "covariance GEMM path (linear, no bias): every chunk reads the first rows of x"),
    Mutation("pack-padding", "off-by-one bound", "cuda/covariance.cu",
             "      if (static_cast<unsigned>(ih) < static_cast<unsigned>(g.H) &&\n"
             "          static_cast<unsigned>(iw) < static_cast<unsigned>(g.W)) {\n"
             "        v = x[n * g.C",
             "      if (static_cast<unsigned>(ih) <= static_cast<unsigned>(g.H) &&\n"
             "          static_cast<unsigned>(iw) < static_cast<unsigned>(g.W)) {\n"
             "        v = x[n * g.C",
             "pack_patches_kernel reads input row ih == H instead of zero padding"),
    Mutation("mixed-barrier", "removed barrier", "cuda/precondition.cu",
             "            (j < n && kb < k) ? static_cast<float>(bp[kb * B.si + j * B.sj]) : 0.0f;\n"
             "      }\n      __syncthreads();\n",
             "            (j < n && kb < k) ? static_cast<float>(bp[kb * B.si + j * B.sj]) : 0.0f;\n"
             "      }\n",
             "mixed_gemm_kernel (16-bit precondition): no __syncthreads between staging and FMAs"),
    Mutation("mixed-transpose", "wrong stride", "cuda/precondition.cu",
             "return {v.p, v.sb, v.sj, v.si};", "return {v.p, v.sb, v.si, v.sj};",
             "16-bit precondition: transposed() returns the view untransposed (QG g, t QA)"),
]


def _sync_tree(mutation: Mutation | None) -> None:
    """Makes WORK a copy of csrc with ``mutation`` applied; unchanged files keep their mtime."""
    src = ROOT / "csrc"
    for path in sorted(src.rglob("*")):
        if path.is_dir():
            continue
        rel = path.relative_to(src)
        text = path.read_text()
        if mutation is not None and str(rel) == mutation.file:
            if text.count(mutation.old) != 1:
                raise ValueError(f"{mutation.id}: the text to mutate is not unique in {rel}")
            text = text.replace(mutation.old, mutation.new)
        target = WORK / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)


def _pytest(sanitize: bool) -> tuple[int, str]:
    env = dict(os.environ, **{CSRC_ENV: str(WORK), "OMP_NUM_THREADS": "1"})
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "", *TESTS]
    if sanitize:
        env.update(KAISA_SIMT_SANITIZE="1", ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
        cxx = os.environ.get("CXX", "c++")
        stdcxx = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True,
                                text=True, check=True).stdout.strip()
        env["LD_PRELOAD"] = f"{asan_runtime()} {stdcxx}"
        args += ["-v", "-s", "-x"]
    else:
        args += ["-v", "-rf"]
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return res.returncode, res.stdout + res.stderr


def _caught_plain(out: str) -> list[str]:
    return re.findall(r"^FAILED (\S+)", out, re.MULTILINE)


def _last_test(out: str) -> str:
    tests = re.findall(r"^(tests/\S+::\S+)", out, re.MULTILINE)
    return f"`{tests[-1]}`" if tests else "?"


def _caught_sanitizer(out: str) -> str:
    report = re.search(r"ERROR: AddressSanitizer: ([\w-]+)|runtime error: ([^\n]+)", out)
    kind = (report.group(1) or report.group(2)) if report else "test failed"
    return f"{_last_test(out)} ({kind})"


def _summary(failed: list[str]) -> str:
    names = sorted({f.split("::")[1].split("[")[0] for f in failed})
    return f"{len(failed)} tests: " + ", ".join(f"`{n}`" for n in names)


def run(mutation: Mutation) -> dict[str, str]:
    """Applies ``mutation`` to the copy, runs the tests, and says what caught it."""
    _sync_tree(mutation)
    t0 = time.time()
    code, out = _pytest(sanitize=False)
    row = {"id": mutation.id, "kind": mutation.kind, "file": mutation.file, "what": mutation.what}
    failed = _caught_plain(out)
    if "Error building extension" in out:
        row["caught"] = "does not compile"
    elif code != 0 and failed:
        row["caught"] = "emulator: " + _summary(failed)
    else:
        # Missed, or the process died (memory corrupted): the sanitizer build says where.
        plain = f"emulator: process died (exit {code}) in {_last_test(out)}; " if code else ""
        code, out = _pytest(sanitize=True)
        row["caught"] = plain + (
            ("ASan/UBSan build: " + _caught_sanitizer(out)) if code != 0 else "NOT CAUGHT")
    row["seconds"] = f"{time.time() - t0:.0f}"
    return row


def main() -> None:
    """Command line: runs the mutations and prints the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation ids")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    try:
        _sync_tree(None)
        code, out = _pytest(sanitize=False)
        if code != 0:
            raise SystemExit(f"the unmutated copy fails its tests:\n{out[-3000:]}")
        print("baseline: the unmutated copy passes", flush=True)
        for m in MUTATIONS:
            if args.only and m.id not in args.only:
                continue
            rows.append(run(m))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        _sync_tree(None)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| mutation | what | caught by |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['kind']} (`{r['file']}`) | {r['what']} | {r['caught']} |")


if __name__ == "__main__":
    main()
