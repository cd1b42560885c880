#!/usr/bin/env bash
# Proves the CUDA build without a GPU: builds kaisa exactly as a GPU user would
# (the CUDA-enabled torch wheel, whose cuBLAS/cuSOLVER/cuSPARSE headers and
# libraries come only from its nvidia-* wheels, plus nvcc), then loads it in a
# fresh process and checks that
#   * kaisa.ops.backend() == 'ext' (the extension loaded: no undefined symbol,
#     no abort at registration),
#   * every kaisa:: op has a CPU, a CUDA and a Meta kernel and every registered
#     op has a Python wrapper (kaisa.ops.OPS),
#   * the CPU kernels of the CUDA build agree with the reference,
#   * a CUDA call fails with a catchable error ("no driver"), not an abort,
#   * nvcc emitted PTX (the default TORCH_CUDA_ARCH_LIST ends in +PTX).
#
# Cached between runs (when the cache directory survives):
#   * the CUDA venv with its ~5 GB of wheels, keyed by the torch pin;
#   * the built extension (kaisa/_C.so and the lines of its build log checked
#     below), keyed by the hash of everything its build reads: csrc/, setup.py,
#     pyproject.toml, nvcc's and torch's versions, the build's environment
#     variables. With a hit the package is installed without compiling
#     (KAISA_NO_EXT=1) and the cached library is put in it: the load checks
#     below run on it all the same. KAISA_CI_REBUILD=1 ignores the cache.
#
# Usage: .ci/cuda_build.sh
# Environment:
#   KAISA_CI_CACHE   cache directory (default ${XDG_CACHE_HOME:-$HOME/.cache}/kaisa-ci)
#   CUDA_HOME        toolkit with nvcc (default: the one nvcc on PATH reports)
#   MAX_JOBS         parallel compile jobs (default 2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PIN="torch==2.13.0"
CACHE="${KAISA_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kaisa-ci}"
VENV="$CACHE/cuda-venv-${TORCH_PIN#torch==}"
export MAX_JOBS="${MAX_JOBS:-2}"
start=$(date +%s)

if ! command -v nvcc >/dev/null 2>&1; then
  echo "cuda_build: nvcc not found on PATH" >&2
  exit 2
fi
echo "cuda_build: $(nvcc --version | grep -m1 release)"

# ------------------------------------------------------- the CUDA venv --
if [[ -x "$VENV/bin/python" ]] &&
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(not torch.version.cuda)' 2>/dev/null; then
  echo "cuda_build: reusing cached $VENV"
else
  echo "cuda_build: creating $VENV"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=70" wheel ninja
  # The pip configuration on these machines points at a local directory with
  # a CPU build of torch: bypass it for this one pinned install.
  t0=$(date +%s)
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  echo "cuda_build: CUDA torch wheel installed in $(($(date +%s) - t0))s"
fi
"$VENV/bin/python" -W ignore::UserWarning - <<'EOF'
import torch
assert torch.version.cuda, f"expected a CUDA build of torch, got {torch.__version__}"
print(f"cuda_build: torch {torch.__version__} (CUDA {torch.version.cuda})")
EOF

# ------------------------------------------------------------- the build --
# Build from a copy of the tree so neither the checkout's build/ directory nor
# its in-place kaisa/_C.so (the CPU build) is involved.
SRC="$(mktemp -d "${TMPDIR:-/tmp}/kaisa-cuda-src.XXXXXX")"
LOG="$SRC.log"
trap 'rm -rf "$SRC" "$LOG"' EXIT
tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.so' -cf - . |
  tar -C "$SRC" -xf -
KEY="$(
  cd "$SRC"
  find csrc setup.py pyproject.toml -type f -print0 | sort -z | xargs -0 sha256sum
  nvcc --version
  "$VENV/bin/python" -c 'import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)'
  env | grep -E '^(TORCH_CUDA_ARCH_LIST|CUDA_HOME|CC|CXX|CFLAGS|CXXFLAGS|LDFLAGS|NVCC_FLAGS)=' | sort || true
)"
KEY="$(printf '%s' "$KEY" | sha256sum | cut -c1-24)"
ENTRY="$CACHE/cuda-ext/$KEY"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
t0=$(date +%s)
FROM="cuda_build: "
if [[ "${KAISA_CI_REBUILD:-0}" != 1 && -f "$ENTRY/build-lines.txt" ]] && compgen -G "$ENTRY/_C*.so" >/dev/null; then
  echo "cuda_build: the extension of these inputs is cached ($ENTRY): installing without compiling"
  if ! (cd "$SRC" && KAISA_NO_EXT=1 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps . >"$LOG" 2>&1); then
    tail -n 80 "$LOG" >&2
    echo "cuda_build: FAILED to install kaisa (without the extension) into the CUDA venv" >&2
    exit 1
  fi
  rm -f "$SITE"/kaisa/_C*.so
  cp "$ENTRY"/_C*.so "$SITE/kaisa/"
  cp "$ENTRY/build-lines.txt" "$LOG"
  FROM="cuda_build: (its build log) "
  touch "$ENTRY"  # most recently used
else
  if ! (cd "$SRC" && "$VENV/bin/python" -m pip install -v --no-build-isolation --no-deps . >"$LOG" 2>&1); then
    tail -n 80 "$LOG" >&2
    echo "cuda_build: FAILED to build kaisa against the CUDA torch" >&2
    exit 1
  fi
  rm -rf "$ENTRY"
  mkdir -p "$ENTRY"
  cp "$SITE"/kaisa/_C*.so "$ENTRY/"
  grep -E "kaisa: building|CUDA library headers|code=compute_" "$LOG" > "$ENTRY/build-lines.txt" || true
  # keep the 3 most recently used entries
  ls -1dt "$CACHE"/cuda-ext/*/ | tail -n +4 | xargs -r rm -rf
fi
build_s=$(($(date +%s) - t0))
grep -m1 "kaisa: building" "$LOG" | sed "s/^ */$FROM/"
grep -m1 "CUDA library headers" "$LOG" | sed "s/^ */$FROM/" || true
if ! grep -q "code=compute_" "$LOG"; then
  echo "cuda_build: nvcc was not asked to emit PTX (no code=compute_XX)" >&2
  exit 1
fi
echo "cuda_build: PTX emitted for $(grep -o 'code=compute_[0-9]*' "$LOG" | sort -u | tr '\n' ' ')"
echo "cuda_build: extension ready in ${build_s}s"

# --------------------------------------------------- load it and check it --
RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kaisa-cuda-run.XXXXXX")"
trap 'rm -rf "$SRC" "$LOG" "$RUN_DIR"' EXIT
cd "$RUN_DIR" # an empty directory: import the installed package, not a source tree
"$VENV/bin/python" -W ignore::UserWarning - <<'EOF'
import torch

import kaisa
import kaisa.ops as ops
from kaisa.ops import _reference as ref

assert ops.backend() == "ext", f"backend {ops.backend()}: {ops.extension_error()}"
registered = sorted(
    n.removeprefix("kaisa::")
    for n in torch._C._dispatch_get_all_op_names()
    if n.startswith("kaisa::")
)
assert registered == sorted(ops.OPS), (registered, ops.OPS)
for op in ops.OPS:
    keys = ops.kernels(op)
    assert keys == ("CPU", "CUDA", "Meta"), f"kaisa::{op} has kernels for {keys}"
assert ops.cuda_kernels_error() is None, ops.cuda_kernels_error()

x = torch.randn(2, 6, 9, 9, dtype=torch.float64)
got = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 0.1)
want = ref.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 0.1)
torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

try:
    torch.ops.kaisa.covariance(torch.ones(4, 3, device="cuda"), 1.0, False)
except RuntimeError as err:  # no GPU here: a catchable error, not an abort
    print(f"cuda_build: CUDA call without a GPU raises RuntimeError: {str(err)[:60]}...")
else:
    print("cuda_build: a CUDA device is present; CUDA kernel call succeeded")
print(f"cuda_build: kaisa {kaisa.__version__}: backend ext, ops {', '.join(ops.OPS)}: "
      "CPU + CUDA + Meta kernels")
EOF
echo "cuda_build: passed in $(($(date +%s) - start))s"
