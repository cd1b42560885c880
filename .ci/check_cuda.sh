#!/usr/bin/env bash
# Compile-check every CUDA source under csrc/ with nvcc, without a GPU and
# without a CUDA build of torch.
#
# What it does:
#   * finds every csrc/**/*.cu file;
#   * fetches the cuSOLVER / cuBLAS / cuSPARSE headers (torch's
#     ATen/cuda/CUDAContextLight.h includes all three) from their PyPI wheels
#     with `pip download --no-deps`, unpacks only nvidia/cu13/include into
#     .ci/cuda-headers (cached: reruns skip the download);
#   * writes the stub c10/cuda/impl/cuda_cmake_macros.h that a CPU wheel of
#     torch lacks into .ci/include-stub;
#   * runs `nvcc -c` for sm_80 and sm_90 with the flags torch's CUDAExtension
#     uses, two files at a time, objects into a temp dir.
#
# Usage: .ci/check_cuda.sh [file.cu ...]   (default: every csrc/**/*.cu)
#
# Exits non-zero if nvcc is missing, a header cannot be fetched or any file
# fails to compile. Environment knobs:
#   NVCC            nvcc to use (default: nvcc on PATH)
#   CHECK_CUDA_JOBS parallel compiles (default 2)
#   CHECK_CUDA_STD  C++ standard (default c++17)
#   PYTHON          python with torch installed (default: python, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NVCC="${NVCC:-nvcc}"
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
JOBS="${CHECK_CUDA_JOBS:-2}"
# C++17 keeps the sources portable to older torch; torch 2.13's CUDAExtension
# itself builds with -std=c++20 (CHECK_CUDA_STD=c++20 checks that too).
CXX_STD="${CHECK_CUDA_STD:-c++17}"
HDR_DIR="$ROOT/.ci/cuda-headers"
STUB_DIR="$ROOT/.ci/include-stub"
# Versions of the library wheels that match the CUDA 13.0 toolkit (nvcc 13.0):
# cuSOLVER 12.0.x, cuBLAS 13.1.x (CUDA 13.0 update 2), cuSPARSE 12.6.x.
WHEELS=("nvidia-cusolver==12.0.4.66" "nvidia-cublas==13.1.1.3" "nvidia-cusparse==12.6.3.3")

start=$(date +%s)

if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda: nvcc not found (set NVCC=...)" >&2
  exit 2
fi
echo "check_cuda: $("$NVCC" --version | tail -n 2 | head -n 1)"

# ---------------------------------------------------------------- headers --
need_fetch=0
for h in cusolverDn.h cublas_v2.h cublasLt.h cusparse.h; do
  [[ -f "$HDR_DIR/$h" ]] || need_fetch=1
done
if [[ $need_fetch -eq 1 ]]; then
  echo "check_cuda: fetching ${WHEELS[*]} headers into .ci/cuda-headers"
  dl="$(mktemp -d)"
  trap 'rm -rf "$dl"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps "${WHEELS[@]}" -d "$dl"
  mkdir -p "$HDR_DIR"
  "$PYTHON" - "$dl" "$HDR_DIR" <<'EOF'
import pathlib
import sys
import zipfile

src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
count = 0
for whl in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            parts = name.split("/")
            # nvidia/cu13/include/<header> (also accept nvidia/<lib>/include/)
            if "include" in parts and not name.endswith("/"):
                rel = parts[parts.index("include") + 1 :]
                out = dst.joinpath(*rel)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
                count += 1
print(f"check_cuda: unpacked {count} headers")
EOF
  rm -rf "$dl"
  trap - EXIT
fi
for h in cusolverDn.h cublas_v2.h cublasLt.h cusparse.h; do
  if [[ ! -f "$HDR_DIR/$h" ]]; then
    echo "check_cuda: header $h missing after fetch" >&2
    exit 2
  fi
done

# ------------------------------------------------------------------- stub --
mkdir -p "$STUB_DIR/c10/cuda/impl"
stub="$STUB_DIR/c10/cuda/impl/cuda_cmake_macros.h"
if [[ ! -f "$stub" ]]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub"
fi

# ------------------------------------------------------------------ flags --
mapfile -t TORCH_INFO < <("$PYTHON" - <<'EOF'
import torch
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(" ".join(COMMON_NVCC_FLAGS))
for p in include_paths():
    print(p)
EOF
)
if [[ ${#TORCH_INFO[@]} -lt 3 ]]; then
  echo "check_cuda: could not query torch with $PYTHON (is torch installed?)" >&2
  exit 2
fi
ABI="${TORCH_INFO[0]}"
read -r -a COMMON <<<"${TORCH_INFO[1]}"
INCLUDES=(-I"$ROOT/csrc" -I"$STUB_DIR")
for p in "${TORCH_INFO[@]:2}"; do
  INCLUDES+=(-I"$p")
done
INCLUDES+=(-I"$HDR_DIR")

FLAGS=(
  -c -std="$CXX_STD" -O2
  -gencode arch=compute_80,code=sm_80
  -gencode arch=compute_90,code=sm_90
  -Xcompiler -fPIC
  # torch's own headers use C++20 bit-field initialisers; silence only that.
  -Xcudafe --diag_suppress=3306 -Xcompiler -Wno-c++20-extensions
  -Xcompiler -Wno-interference-size
  "${COMMON[@]}"
  -DTORCH_API_INCLUDE_EXTENSION_H
  -DTORCH_EXTENSION_NAME=_C
  -D_GLIBCXX_USE_CXX11_ABI="$ABI"
  "${INCLUDES[@]}"
)

# ------------------------------------------------------------------ files --
if [[ $# -gt 0 ]]; then
  FILES=("$@")  # explicit subset (for iterating on one file)
else
  mapfile -t FILES < <(find csrc -name '*.cu' -type f | sort)
fi
if [[ ${#FILES[@]} -eq 0 ]]; then
  echo "check_cuda: no .cu files under csrc/" >&2
  exit 1
fi

OBJ_DIR="$(mktemp -d)"
trap 'rm -rf "$OBJ_DIR"' EXIT
export NVCC OBJ_DIR
printf '%s\0' "${FLAGS[@]}" >"$OBJ_DIR/flags"

compile_one() {
  local f="$1"
  local obj log t0
  obj="$OBJ_DIR/$(echo "$f" | tr '/' '_').o"
  log="$obj.log"
  t0=$(date +%s)
  mapfile -d '' -t flags <"$OBJ_DIR/flags"
  if "$NVCC" "${flags[@]}" "$f" -o "$obj" >"$log" 2>&1; then
    echo "check_cuda: OK   $f ($(($(date +%s) - t0))s)"
    # Warnings are shown too: a clean compile prints nothing.
    if [[ -s "$log" ]]; then sed 's/^/    /' "$log"; fi
  else
    echo "check_cuda: FAIL $f"
    sed 's/^/    /' "$log"
    return 1
  fi
}
export -f compile_one

echo "check_cuda: compiling ${#FILES[@]} file(s) for sm_80, sm_90 with $JOBS job(s)"
status=0
printf '%s\0' "${FILES[@]}" | xargs -0 -n 1 -P "$JOBS" bash -c 'compile_one "$0"' || status=1

echo "check_cuda: checked ${FILES[*]}"
echo "check_cuda: $([[ $status -eq 0 ]] && echo passed || echo FAILED) in $(($(date +%s) - start))s"
exit $status
