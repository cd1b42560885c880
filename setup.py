"""Build script of the ``kaisa._C`` C++/CUDA extension.

Project metadata lives in ``pyproject.toml``; this file only declares the
extension. Build against the installed torch with::

    pip install --no-build-isolation -e .   # or: pip install --no-build-isolation .

* CPU kernels (``csrc/kaisa.cpp``, ``csrc/cpu/*.cpp``) are always built.
* CUDA kernels (``csrc/cuda/*.cu``, linked with cuBLAS and cuSOLVER) are added
  when the installed torch has CUDA (``torch.version.cuda``) and a CUDA toolkit
  is found (``CUDA_HOME``); ``TORCH_CUDA_ARCH_LIST`` selects the architectures
  (handled by ``torch.utils.cpp_extension``).
* A failing extension build fails the installation. ``KAISA_NO_EXT=1`` skips
  the extension entirely (``kaisa.ops`` then falls back to the torch backend).
"""

from __future__ import annotations

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(pattern: str) -> list[str]:
    """Returns the sorted files matching ``pattern``, relative to the project root."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extensions() -> tuple[list[object], dict[str, object]]:
    """Declares the extension modules and the build_ext command class."""
    if os.environ.get("KAISA_NO_EXT", "0") not in ("", "0"):
        print("kaisa: KAISA_NO_EXT set, skipping the kaisa._C extension")
        return [], {}

    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = _rel("csrc/kaisa.cpp") + _rel("csrc/cpu/*.cpp")
    cuda_sources = _rel("csrc/cuda/*.cu") + _rel("csrc/cuda/*.cpp")
    cxx_flags = ["-O2", "-g0", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    define_macros = [("KAISA_PYTHON_MODULE", None)]
    with_cuda = bool(torch.version.cuda) and CUDA_HOME is not None and bool(cuda_sources)
    if with_cuda:
        print(f"kaisa: building CPU + CUDA kernels (CUDA_HOME={CUDA_HOME})")
        ext = CUDAExtension(
            name="kaisa._C",
            sources=sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[*define_macros, ("KAISA_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O2"]},
            extra_link_args=["-fopenmp"],
            libraries=["cusolver", "cublas"],
        )
    else:
        reason = (
            "torch has no CUDA"
            if not torch.version.cuda
            else "no CUDA toolkit (CUDA_HOME)"
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
