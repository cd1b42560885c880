"""Loading a script of ``bench/`` as a module (the benchmarks are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """Imports ``bench/<folder>/<name>.py`` (or ``bench/<name>.py``; not ``bench/gpu/``'s) as
    ``bench_<name>``."""
    (path,) = [p for p in (BENCH / f"{name}.py", *BENCH.glob(f"*/{name}.py"))
               if p.is_file() and p.parent.name != "gpu"]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module
