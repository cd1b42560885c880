"""Build script of the ``kaisa._C`` C++/CUDA extension.

Project metadata lives in ``pyproject.toml``; this file only declares the
extension. Build against the installed torch with::

    pip install --no-build-isolation .      # or: pip install --no-build-isolation -e .

* CPU kernels (``csrc/kaisa.cpp``, ``csrc/cpu/*.cpp``) are always built.
* CUDA kernels (``csrc/cuda/*.cu``, linked with cuBLAS and cuSOLVER) are added
  when the installed torch has CUDA (``torch.version.cuda``) and nvcc is found
  (``CUDA_HOME``, else the toolkit that the ``nvcc`` on ``PATH`` reports).
* The cuBLAS/cuSOLVER/cuSPARSE headers and libraries may come from a full CUDA
  toolkit or only from the ``nvidia-*`` wheels the CUDA torch wheel depends on
  (``site-packages/nvidia/cu13/{include,lib}``, libraries only as versioned
  ``libX.so.N``): headers the toolkit lacks are made visible through a shim
  include directory holding just those headers, and libraries are linked by
  full path with a run path to their directory.
* ``TORCH_CUDA_ARCH_LIST`` selects the GPU architectures; unset, it defaults to
  :data:`DEFAULT_CUDA_ARCHS` (SASS for Turing to Blackwell, plus PTX of the
  newest so later GPUs JIT-compile instead of failing).
* A failing extension build fails the installation. ``KAISA_NO_EXT=1`` skips
  the extension entirely (``kaisa.ops`` then falls back to the torch backend).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

DEFAULT_CUDA_ARCHS = "7.5;8.0;9.0;10.0;12.0+PTX"
"""Architectures built when ``TORCH_CUDA_ARCH_LIST`` is unset (nvcc 13 supports sm_75+)."""

CUDA_LIBRARIES = ("cusolver", "cublas")
"""Libraries the CUDA kernels call directly."""

LIBRARY_HEADERS = ("cublas*.h", "cusolver*.h", "cusparse*.h", "cublasLt.h")
"""Headers torch's ``ATen/cuda/CUDAContextLight.h`` needs beyond the CUDA runtime."""


def _rel(pattern: str) -> list[str]:
    """Returns the sorted files matching ``pattern``, relative to the project root."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _nvidia_wheel_dirs(kind: str) -> list[str]:
    """``include`` or ``lib`` directories of the installed ``nvidia-*`` wheels."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    found: list[str] = []
    for base in getattr(nvidia, "__path__", []):
        found += sorted(glob.glob(os.path.join(base, "*", kind)))
    return found


def _shim_include_dir(cuda_home: str) -> str | None:
    """A directory of links to the library headers ``cuda_home`` lacks, or None.

    Only headers missing from the toolkit are linked, so the toolkit's own
    runtime headers always win over the wheels' copies.
    """
    toolkit = os.path.join(cuda_home, "include")
    shim = os.path.join(ROOT, "build", "cuda-shim-include")
    linked = 0
    for inc in _nvidia_wheel_dirs("include"):
        for pattern in LIBRARY_HEADERS:
            for header in glob.glob(os.path.join(inc, pattern)):
                name = os.path.basename(header)
                if os.path.exists(os.path.join(toolkit, name)):
                    continue
                os.makedirs(shim, exist_ok=True)
                link = os.path.join(shim, name)
                if os.path.lexists(link):
                    os.remove(link)
                os.symlink(header, link)
                linked += 1
    if linked:
        print(f"kaisa: {linked} CUDA library headers from the nvidia wheels via {shim}")
        return shim
    return None


def _find_library(cuda_home: str, name: str) -> tuple[str, str]:
    """Returns ``(directory, file)`` of ``lib<name>.so``: toolkit first, then the wheels."""
    candidates = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "lib/x64")]
    candidates += [os.path.join(cuda_home, "targets", "x86_64-linux", "lib")]
    for d in candidates:
        if os.path.exists(os.path.join(d, f"lib{name}.so")):
            return d, f"lib{name}.so"
    for d in _nvidia_wheel_dirs("lib"):
        versioned = sorted(glob.glob(os.path.join(d, f"lib{name}.so.[0-9]*")))
        if versioned:
            return d, os.path.basename(min(versioned, key=len))  # libX.so.N, not .N.M.K
    raise RuntimeError(
        f"kaisa: lib{name}.so not found in {cuda_home} nor in the nvidia-* wheels "
        f"({_nvidia_wheel_dirs('lib')}); install the CUDA torch wheel's dependencies or a "
        "CUDA toolkit, or set KAISA_NO_EXT=1 to skip the extension"
    )


def _cuda_link_args(cuda_home: str) -> list[str]:
    """Linker arguments for :data:`CUDA_LIBRARIES` with run paths to their directories."""
    args: list[str] = []
    site = sysconfig.get_paths()["purelib"]
    for name in CUDA_LIBRARIES:
        directory, file = _find_library(cuda_home, name)
        args.append(os.path.join(directory, file))
        rpaths = [directory]
        if directory.startswith(site + os.sep):  # relocatable: kaisa/_C.so -> ../nvidia/...
            rpaths.insert(0, "$ORIGIN/" + os.path.relpath(directory, os.path.join(site, "kaisa")))
        args += [f"-Wl,-rpath,{p}" for p in rpaths if f"-Wl,-rpath,{p}" not in args]
    return args


def _nvcc_toolkit_root() -> str | None:
    """The toolkit directory of the ``nvcc`` on ``PATH``, as nvcc itself reports it.

    torch guesses ``CUDA_HOME`` as the parent of nvcc's directory, which is wrong
    when ``nvcc`` is a wrapper or a link outside the toolkit (``/usr/local/bin``).
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True, text=True, timeout=60, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    if match is None:
        return None
    top = os.path.realpath(match.group(1).strip())
    return top if os.path.exists(os.path.join(top, "include", "cuda_runtime.h")) else None


def _extensions() -> tuple[list[object], dict[str, object]]:
    """Declares the extension modules and the build_ext command class."""
    if os.environ.get("KAISA_NO_EXT", "0") not in ("", "0"):
        print("kaisa: KAISA_NO_EXT set, skipping the kaisa._C extension")
        return [], {}

    import torch

    if torch.version.cuda and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        root = _nvcc_toolkit_root()
        if root is not None:
            os.environ["CUDA_HOME"] = root  # read by torch.utils.cpp_extension at import
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = _rel("csrc/kaisa.cpp") + _rel("csrc/cpu/*.cpp")
    cuda_sources = _rel("csrc/cuda/*.cu")
    cxx_flags = ["-O2", "-g0", "-fopenmp", "-ffp-contract=off"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    define_macros = [("KAISA_PYTHON_MODULE", None)]
    with_cuda = bool(torch.version.cuda) and CUDA_HOME is not None and bool(cuda_sources)
    if with_cuda:
        assert CUDA_HOME is not None
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        print(f"kaisa: building CPU + CUDA kernels (CUDA_HOME={CUDA_HOME}, archs {archs})")
        shim = _shim_include_dir(CUDA_HOME)
        ext = CUDAExtension(
            name="kaisa._C",
            sources=sources + cuda_sources,
            include_dirs=include_dirs + ([shim] if shim else []),
            define_macros=[*define_macros, ("KAISA_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O2"]},
            extra_link_args=["-fopenmp", *_cuda_link_args(CUDA_HOME)],
        )
    else:
        reason = (
            "torch has no CUDA"
            if not torch.version.cuda
            else "no CUDA toolkit (nvcc / CUDA_HOME)"
            if CUDA_HOME is None
            else "no csrc/cuda sources"
        )
        print(f"kaisa: building CPU kernels only ({reason})")
        ext = CppExtension(
            name="kaisa._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
