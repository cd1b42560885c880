#!/usr/bin/env bash
# The GPU day in one command: build, gpu tests, compute-sanitizer, kernel benchmarks and
# step cost, each stage under its own time cap (bench/gpu/run.py says which).
# Usage: bash bench/gpu/run.sh --out DIR [--budget 480] [--dry-run] [--stages a,b]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python3}"
exec "$PY" bench/gpu/run.py "$@"
