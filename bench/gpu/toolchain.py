"""Which C++ compiler builds the extension on the GPU machine, and whether its error paths work.

On the first H100 run the extension built with the image's ``c++`` (``/opt/gcc/bin/g++``)
crashed with a segmentation fault whenever an argument check formatted a tensor's sizes
into its error message (``c10::str(..., a.sizes())``, inside libstdc++'s ``ostream``
code), while every result was right: the compiler's libstdc++ headers and the libstdc++
the Python process loads may differ. So the build records the compiler, the libstdc++ it
links against and the one loaded at run time, prefers a compiler whose libstdc++ is the
loaded one when the default's is not, and checks one error path after the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

LOADED_LIBSTDCXX = """
import torch
libs = {line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line}
print(sorted(libs)[0] if libs else "")
"""

ERROR_PATH = """
import torch, kaisa.ops
try:
    torch.ops.kaisa.batched_eigh(torch.zeros(2, 3, 4))
except RuntimeError as err:
    print("raised:", str(err).splitlines()[0][:160])
else:
    print("no error raised")
"""


def _first_line(cmd: list[str]) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (res.stdout or res.stderr).strip().splitlines()
    return lines[0].strip() if res.returncode == 0 and lines else None


def libstdcxx_of(compiler: str) -> str | None:
    """The real path of the libstdc++ that ``compiler`` links against."""
    path = _first_line([compiler, "-print-file-name=libstdc++.so.6"])
    return os.path.realpath(path) if path and os.path.isabs(path) else None


def loaded_libstdcxx() -> str | None:
    """The real path of the libstdc++ a Python process with torch imported has loaded."""
    path = _first_line([sys.executable, "-c", LOADED_LIBSTDCXX])
    return os.path.realpath(path) if path else None


def choose(cxx: str | None) -> dict[str, Any]:
    """The compiler to build with (``cxx`` if given) and why, with what was found."""
    default = os.environ.get("CXX", "c++")
    loaded = loaded_libstdcxx()
    found: dict[str, Any] = {"loaded_libstdcxx": loaded}
    candidates = [default, "/usr/bin/g++", "g++"]
    for c in dict.fromkeys(candidates):
        exe = shutil.which(c)
        if exe:
            found[c] = {"path": exe, "real_path": os.path.realpath(exe),
                        "version": _first_line([exe, "--version"]), "libstdcxx": libstdcxx_of(exe)}
    if cxx:
        return {"cxx": cxx, "why": "given", **found}
    default_lib = found.get(default, {}).get("libstdcxx")
    if loaded and default_lib and default_lib != loaded:
        for c in candidates[1:]:
            if found.get(c, {}).get("libstdcxx") == loaded:
                return {"cxx": found[c]["path"], "why": f"{default}'s libstdc++ is not the one "
                        "Python loads; this one's is", **found}
    return {"cxx": None, "why": "the default", **found}


def build_env(choice: dict[str, Any]) -> dict[str, str]:
    """CXX and CC for the chosen compiler (nothing for the default)."""
    cxx = choice.get("cxx")
    if not cxx:
        return {}
    cc = cxx[:-3] + "gcc" if cxx.endswith("g++") else cxx
    return {"CXX": cxx, "CC": cc}
