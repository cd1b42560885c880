"""Builds the SIMT emulator: the unmodified ``csrc/cuda/*.cu`` compiled as host C++.

Each ``.cu`` file is copied into the build directory with one change: a launch
``kernel<<<grid, block, shmem, stream>>>(args)`` (which no host compiler parses)
becomes ``kernel ^ ::simt::Config("kernel", grid, block, shmem, stream) ^
::simt::args(args)``, an ordinary C++ expression that queues the launch
(``tools/simt/include/simt/simt.h``). Line breaks are kept and a ``#line``
directive names the original file, so diagnostics point into ``csrc/cuda``.
The copy is compiled with ``tools/simt/include`` first on the include path (the
fake CUDA runtime, cuBLAS, cuSOLVER and ATen/c10 CUDA headers) and
``simt/prelude.h`` included first; ``csrc/kaisa.cpp`` (the schemas and argument
checks) is compiled the same way. The ops register as ``torch.ops.kaisa_simt.*``
(CUDA dispatch key), the emulator's controls as ``torch.ops.simt.*``.

``torch.utils.cpp_extension.load`` builds and caches the library in
``build/kaisa_simt`` (``build/kaisa_simt_asan`` for the AddressSanitizer +
UndefinedBehaviorSanitizer build); only changed sources are recompiled.
``KAISA_SIMT_CSRC`` builds another copy of ``csrc`` instead (``tools/simt/mutate.py``).

``KAISA_SIMT_CACHE`` (a directory; CI sets it) keeps built libraries of the project's
``csrc`` keyed by the hash of everything the build reads: ``csrc``, ``tools/simt``'s
headers, runtime and test kernels, this file, the flags, the checkout's path, the
compiler's version, Python's and torch's. ninja cannot reuse ``build/`` across fresh
virtual environments (a reinstalled torch has new header mtimes, so every object is
rebuilt); a library whose inputs are all unchanged is loaded from the cache instead.

Usage: ``python -m tools.simt.build [--sanitize] [--verbose]`` builds, loads and prints
the library path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIMT = ROOT / "tools" / "simt"
KERNEL_SOURCES = SIMT / "kernels"  # the emulator's own test kernels
CSRC_ENV = "KAISA_SIMT_CSRC"
"""Environment variable naming another copy of ``csrc`` to build (the mutation check)."""
CACHE_ENV = "KAISA_SIMT_CACHE"
"""Environment variable naming a directory of built libraries keyed by their inputs."""
CACHE_KEEP = 4
"""Cached libraries kept per build name (the newest)."""
_LOADED: dict[Path, Path] = {}
"""Cache entry -> the library this process loaded for it (loading a second copy of the
same library from another path would register its ops twice)."""
RUNTIME = ["fiber.cpp", "shared.cpp", "stream.cpp", "device.cpp", "cublas.cpp", "cusolver.cpp", "control.cpp"]

_LAUNCH = re.compile(r"<<<(?P<config>.*?)>>>\s*\(", re.DOTALL)


def _kernel_name(text: str, end: int) -> str:
    """The name of the kernel whose template-id or name ends at ``text[:end]``."""
    i = end
    while i > 0 and text[i - 1].isspace():
        i -= 1
    if i > 0 and text[i - 1] == ">":  # skip the template argument list
        depth = 0
        while i > 0:
            i -= 1
            if text[i] == ">":
                depth += 1
            elif text[i] == "<":
                depth -= 1
                if depth == 0:
                    break
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_:"):
        j -= 1
    name = text[j:i].split("::")[-1]
    if not name:
        raise ValueError(f"cannot find the kernel name before the launch at offset {end}")
    return name


def rewrite_launches(text: str) -> str:
    """Rewrites every ``<<<...>>>(`` launch into the emulator's launch expression.

    Args:
        text: CUDA C++ source.

    Returns:
        The source with every launch rewritten and every line break kept.
    """
    out: list[str] = []
    last = 0
    for match in _LAUNCH.finditer(text):
        name = _kernel_name(text, match.start())
        out.append(text[last : match.start()])
        out.append(f' ^ ::simt::Config("{name}", {match.group("config")}) ^ ::simt::args(')
        last = match.end()
    out.append(text[last:])
    return "".join(out)


def _write_if_changed(path: Path, content: str) -> None:
    if not path.exists() or path.read_text() != content:
        path.write_text(content)


def csrc() -> Path:
    """The ``csrc`` tree to build: the project's, or the copy named by ``KAISA_SIMT_CSRC``."""
    return Path(os.environ.get(CSRC_ENV, str(ROOT / "csrc"))).resolve()


def generate(out_dir: Path, source: Path) -> list[Path]:
    """Writes the host-C++ copies of the CUDA sources (and of kaisa.cpp) into ``out_dir``.

    Args:
        out_dir: directory for the generated sources (created).
        source: the ``csrc`` tree.

    Returns:
        The generated source files.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    generated: list[Path] = []
    cuda = sorted((source / "cuda").glob("*.cu"))
    for cu in cuda + sorted(KERNEL_SOURCES.glob("*.cu")):
        body = rewrite_launches(cu.read_text())
        target = out_dir / f"{cu.parent.name}_{cu.stem}.cpp"
        _write_if_changed(
            target, f'#include <simt/prelude.h>\n#line 1 "{cu}"\n{body}'
        )
        generated.append(target)
    schemas = out_dir / "kaisa_schemas.cpp"
    _write_if_changed(
        schemas, f'#include <simt/prelude.h>\n#include "{source / "kaisa.cpp"}"\n'
    )
    generated.append(schemas)
    return generated


def _cache_key(source: Path, cflags: list[str], ldflags: list[str]) -> str:
    """Hash of every input of the build of ``source`` (see the module docstring)."""
    import torch

    digest = hashlib.sha256()

    def add(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    for tree in (source, SIMT / "include", SIMT / "src", KERNEL_SOURCES):
        for path in sorted(p for p in tree.rglob("*") if p.is_file()):
            add(str(path.relative_to(tree)).encode())
            add(path.read_bytes())
    add(Path(__file__).read_bytes())
    cxx = os.environ.get("CXX", "c++")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    env = [os.environ.get(v, "") for v in ("CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS")]
    add(repr((str(ROOT), str(source), cflags, ldflags, env, version.stdout, sys.version,
              torch.__version__, torch.version.git_version, torch.__file__)).encode())
    return digest.hexdigest()[:24]


def load(sanitize: bool = False, verbose: bool = False) -> Path:
    """Builds the emulator library if a source changed, loads it and returns its path.

    Args:
        sanitize: the AddressSanitizer + UndefinedBehaviorSanitizer build; the
            process must preload the ASan runtime (``LD_PRELOAD``, see
            :func:`asan_runtime`).
        verbose: show the compiler commands.

    Returns:
        Path of the loaded shared library.

    Raises:
        RuntimeError: ``sanitize`` without the ASan runtime preloaded.
    """
    if sanitize and "libasan" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError(
            f"the sanitizer build needs LD_PRELOAD={asan_runtime()} (and ASAN_OPTIONS="
            "detect_leaks=0) in the environment of the Python process"
        )
    from torch.utils import cpp_extension

    source = csrc()
    name = "kaisa_simt" + ("" if source == ROOT / "csrc" else "_mutant") + (
        "_asan" if sanitize else "")
    build_dir = ROOT / "build" / name
    sources = generate(build_dir / "gen", source) + [SIMT / "src" / s for s in RUNTIME]
    cflags = ["-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
              "-Wno-unknown-pragmas", "-ffp-contract=off"]
    ldflags: list[str] = []
    if sanitize:
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        cflags += ["-O1", "-g1", "-fno-omit-frame-pointer", *san]
        ldflags += san
    else:
        cflags += ["-O2"]
    cache_dir = os.environ.get(CACHE_ENV, "")
    cached: Path | None = None
    if cache_dir and source == ROOT / "csrc":  # never a mutant
        cached = Path(cache_dir) / f"{name}-{_cache_key(source, cflags, ldflags)}.so"
        if cached in _LOADED:
            return _LOADED[cached]
        if cached.is_file():
            import torch

            torch.ops.load_library(str(cached))  # type: ignore[no-untyped-call]
            _LOADED[cached] = cached
            return cached
    build_dir.mkdir(parents=True, exist_ok=True)
    # The compilers must not run with the ASan runtime preloaded into them (slow).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        path = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(SIMT / "include"), str(source / "cuda"),
                                 str(KERNEL_SOURCES), str(source)],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(str(path), partial)
        os.replace(partial, cached)
        older = sorted(cached.parent.glob(f"{name}-*.so"), key=lambda p: p.stat().st_mtime)
        for stale in older[:-CACHE_KEEP]:
            stale.unlink(missing_ok=True)
        _LOADED[cached] = Path(str(path))
    return Path(str(path))


def asan_runtime() -> str:
    """Path of the compiler's AddressSanitizer runtime (to LD_PRELOAD)."""
    cxx = os.environ.get("CXX", "c++")
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def main() -> None:
    """Command line: builds the library and prints its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitize", action="store_true", help="ASan + UBSan build")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    print(load(sanitize=args.sanitize, verbose=args.verbose))


if __name__ == "__main__":
    main()
