#!/usr/bin/env bash
# Configures the CMake build of the kaisa CPU kernels against the installed
# libtorch (the torch Python wheel), builds it and runs the C++ tests with ctest.
# Usage: .ci/cmake_ctest.sh [build-dir]   (default: a fresh temporary directory)
# Exits non-zero if configuring, building or any test fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
JOBS="${JOBS:-2}"

if [[ $# -ge 1 ]]; then
  BUILD_DIR="$1"
  mkdir -p "$BUILD_DIR"
else
  BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kaisa-cmake.XXXXXX")"
  trap 'rm -rf "$BUILD_DIR"' EXIT
fi

TORCH_PREFIX="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
  GENERATOR=(-G Ninja)
fi

echo "kaisa: configuring in $BUILD_DIR (torch cmake prefix: $TORCH_PREFIX)"
cmake -S "$ROOT" -B "$BUILD_DIR" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX"
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure
