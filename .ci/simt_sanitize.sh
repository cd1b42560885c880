#!/usr/bin/env bash
# Builds the SIMT emulator (tools/simt: csrc/cuda/*.cu compiled as host C++) with
# AddressSanitizer + UndefinedBehaviorSanitizer and runs the emulated CUDA kernel tests
# (FILES below: every test in them, whatever its marker) under it. An out-of-bounds access
# of a kernel or of the host code (device memory is host memory here), a use after free
# (e.g. a workspace freed before the queued work that uses it ran), or undefined
# behaviour aborts the run. This is their one run in CI: .ci/run's last step ignores FILES
# (--list prints them) and runs, plainly, only emulator tests in other files.
#
# The built library is cached between runs (when the cache directory survives), keyed by the
# hash of everything the build reads (tools/simt/build.py, KAISA_SIMT_CACHE): a fresh virtual
# environment makes ninja rebuild every object, an unchanged csrc + tools/simt need not.
#
# Usage: .ci/simt_sanitize.sh [--list]   (PYTHON, CXX select the interpreter and compiler;
#   KAISA_CI_CACHE the cache directory, default ${XDG_CACHE_HOME:-$HOME/.cache}/kaisa-ci)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FILES=(tests/ops/test_simt.py
  tests/ops/test_cuda_host_work.py
  tests/ops/test_cuda_eigh_status.py
  tests/ops/test_cuda_ops.py
  tests/ops/test_cuda_covariance_gemm.py)
if [[ "${1:-}" == --list ]]; then
  printf '%s\n' "${FILES[@]}"
  exit 0
fi
PYTHON="${PYTHON:-python}"
CXX="${CXX:-c++}"
ASAN_RT="$("$CXX" -print-file-name=libasan.so)"
STDCXX="$("$CXX" -print-file-name=libstdc++.so.6)"
if [[ ! -f "$ASAN_RT" ]]; then
  echo "simt_sanitize: $CXX has no AddressSanitizer runtime" >&2
  exit 2
fi
# The ASan runtime must come first; libstdc++ with it, so that ASan finds the real
# __cxa_throw (python itself does not link libstdc++).
PRELOAD="$ASAN_RT $STDCXX"
export KAISA_SIMT_SANITIZE=1 OMP_NUM_THREADS=1
export KAISA_SIMT_CACHE="${KAISA_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kaisa-ci}/simt"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

t0=$(date +%s)
LD_PRELOAD="$PRELOAD" "$PYTHON" -m tools.simt.build --sanitize
t1=$(date +%s)
echo "simt_sanitize: ASan + UBSan build ready in $((t1 - t0))s"
# -s: a sanitizer report goes to the terminal, not into pytest's captured output.
LD_PRELOAD="$PRELOAD" "$PYTHON" -m pytest -q -s -p no:cacheprovider -m "" "${FILES[@]}"
echo "simt_sanitize: tests passed under ASan + UBSan in $(($(date +%s) - t1))s"
