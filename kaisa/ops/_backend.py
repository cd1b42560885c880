"""Backend selection for :mod:`kaisa.ops`: the ``kaisa._C`` extension or the reference."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

BACKENDS: tuple[str, ...] = ("ext", "torch")
"""Names accepted by :func:`set_backend`."""

_ENV_VAR = "KAISA_BACKEND"


def _load_extension() -> str | None:
    """Imports ``kaisa._C`` (its static initialisers register the ops); the error or None."""
    try:
        importlib.import_module("kaisa._C")
    except Exception as exc:  # any failure to load the shared object
        return f"{type(exc).__name__}: {exc}"
    return None


_EXT_ERROR: str | None = _load_extension()
_BACKEND: str = "torch"
_OPS: tuple[str, ...] = ()


def _register_fakes(fakes: Mapping[str, Callable[..., object]]) -> str | None:
    """Registers the fake kernels of the loaded extension; the error or None."""
    try:
        for name, fn in fakes.items():
            torch.library.register_fake(f"kaisa::{name}", fn)
    except Exception as exc:  # a build whose schemas do not match this package
        return f"kaisa._C loaded but registering fake kernels failed: {type(exc).__name__}: {exc}"
    return None


def _has_extension(package: Path) -> bool:
    """Whether ``package`` holds a compiled ``_C`` module."""
    return any(
        (package / f"_C{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def _source_tree_hint() -> str:
    """Why ``kaisa._C`` is missing when this ``kaisa`` is an unbuilt source tree, and the fix.

    After a non-editable ``pip install`` the extension lives in site-packages; Python puts
    the current directory first on ``sys.path``, so running from the clone's root imports
    the clone's ``kaisa/`` (no ``_C``) instead. Empty when that is not the case.
    """
    here = Path(__file__).resolve().parent.parent
    if _has_extension(here):
        return ""
    fix = (
        "run from another directory, or install with "
        "'pip install --no-build-isolation -e .' (builds the extension in the source tree)"
    )
    for entry in sys.path:
        candidate = Path(entry or os.getcwd()) / "kaisa"
        with contextlib.suppress(OSError):
            if candidate.resolve() != here and _has_extension(candidate):
                return (
                    f"kaisa is imported from the source tree {here}, which shadows the "
                    f"installed kaisa at {candidate} (the current directory comes first on "
                    f"sys.path); {fix}; "
                )
    if (here.parent / "pyproject.toml").is_file():
        return (
            f"kaisa is imported from the source tree {here}, which has no built extension; "
            f"{fix}; "
        )
    return ""


def _initial_backend() -> str:
    """Picks the backend at import time from the environment and the extension."""
    requested = os.environ.get(_ENV_VAR, "").strip().lower()
    if requested:
        if requested not in BACKENDS:
            raise ValueError(
                f"{_ENV_VAR}={requested!r} is not a valid backend; expected one of {BACKENDS}"
            )
        if requested == "ext" and _EXT_ERROR is not None:
            raise ImportError(
                f"{_ENV_VAR}=ext but the kaisa._C extension could not be loaded: {_EXT_ERROR}"
            )
        return requested
    if _EXT_ERROR is None:
        return "ext"
    warnings.warn(
        "kaisa._C extension could not be loaded, falling back to the pure-PyTorch "
        f"backend: {_source_tree_hint()}set {_ENV_VAR}=torch to silence this ({_EXT_ERROR})",
        RuntimeWarning,
        stacklevel=4,
    )
    return "torch"


def _initialise(fakes: Mapping[str, Callable[..., object]]) -> None:
    """Registers ``fakes`` (when the extension loaded) and picks the backend.

    Called once by :mod:`kaisa.ops` after it has defined every wrapper and fake.
    """
    global _EXT_ERROR, _BACKEND, _OPS
    _OPS = tuple(fakes)
    if _EXT_ERROR is None:
        _EXT_ERROR = _register_fakes(fakes)
    _BACKEND = _initial_backend()


def extension_available() -> bool:
    """Returns whether the compiled ``kaisa._C`` extension loaded successfully."""
    return _EXT_ERROR is None


def extension_error() -> str | None:
    """Returns the error raised while loading ``kaisa._C``, or None if it loaded."""
    return _EXT_ERROR


def kernels(op: str) -> tuple[str, ...]:
    """Dispatch keys (of ``CPU``, ``CUDA``, ``Meta``) with a kernel for ``torch.ops.kaisa.<op>``.

    Args:
        op: operator name, e.g. ``'conv_covariance'``.

    Returns:
        The keys in that order; empty when the extension did not load.
    """
    if _EXT_ERROR is not None:
        return ()
    return tuple(
        key
        for key in ("CPU", "CUDA", "Meta")
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"kaisa::{op}", key)
    )


def cuda_kernels_error() -> str | None:
    """Why the CUDA kernels cannot be used, or None when every op has one.

    GPU tests and benchmarks fail with this message (never skip) when a CUDA
    device is present, so a broken CUDA build cannot look green.
    """
    if _EXT_ERROR is not None:
        return f"the kaisa._C extension did not load: {_EXT_ERROR}"
    missing = [op for op in _OPS if "CUDA" not in kernels(op)]
    if missing:
        return (
            f"kaisa._C has no CUDA kernel for {', '.join(missing)}: it was built without "
            "CUDA (torch without CUDA or no nvcc at build time); rebuild with "
            "`pip install --no-build-isolation .` under a CUDA torch"
        )
    return None


def backend() -> str:
    """Returns the active backend name, ``'ext'`` or ``'torch'``."""
    return _BACKEND


def set_backend(name: str) -> None:
    """Selects the backend used by the ops in this module.

    Args:
        name: ``'ext'`` (compiled extension) or ``'torch'`` (reference code).

    Raises:
        ValueError: if ``name`` is not a known backend.
        RuntimeError: if ``name == 'ext'`` and the extension is not available.
    """
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    if name == "ext" and _EXT_ERROR is not None:
        raise RuntimeError(f"backend 'ext' requested but kaisa._C is unavailable: {_EXT_ERROR}")
    _BACKEND = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager that temporarily switches the backend.

    Args:
        name: backend to use inside the ``with`` block.

    Yields:
        None. The previous backend is restored on exit.
    """
    previous = _BACKEND
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
_WARNED_NO_KERNEL: set[tuple[str, str]] = set()
_HAS_KERNEL: dict[tuple[str, str], bool] = {}  # the dispatcher query costs ~10 us a call


def _use_ext(op: str, device: torch.device) -> bool:
    """Returns whether ``torch.ops.kaisa.<op>`` should run for tensors on ``device``.

    True when the ext backend is active and the extension has a kernel for the
    device (e.g. a CPU-only build given CUDA tensors falls back to the reference
    implementation, with one RuntimeWarning per op and device type).
    """
    if _BACKEND != "ext":
        return False
    if torch.compiler.is_compiling():
        return True  # the dispatcher query is not traceable; fake kernels cover tracing
    key = _DEVICE_KEYS.get(device.type)
    if key is not None:
        has = _HAS_KERNEL.get((op, key))
        if has is None:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"kaisa::{op}", key)
            _HAS_KERNEL[(op, key)] = has
        if has:
            return True
    if (op, device.type) not in _WARNED_NO_KERNEL:
        _WARNED_NO_KERNEL.add((op, device.type))
        warnings.warn(
            f"kaisa._C has no {device.type} kernel for {op}; using the reference implementation",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
