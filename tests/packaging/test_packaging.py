"""The library needs torch only; the app names its missing extra in one line."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_BLOCK = "import sys\nfor m in ('numpy', 'sklearn', 'tqdm', 'matplotlib'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_library_works_without_the_app_dependencies() -> None:
    res = _run(
        """
        import torch, kaisa
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        pre = kaisa.KFACPreconditioner(model)
        model(torch.randn(5, 4)).sum().backward()
        pre.step()
        import kaisa.distributed
        import kaisa.train.models  # the app's model zoo needs torch only (docs/training.md)
        print("OK", pre.steps)
        """
    )
    assert res.returncode == 0, res.stderr
    assert "OK 1" in res.stdout


def test_app_says_which_extra_is_missing() -> None:
    res = _run("import warnings; warnings.simplefilter('ignore')\n"
               "import kaisa.train\nraise SystemExit(kaisa.train.main(['--help']))\n")
    assert res.returncode == 2
    ours = [line for line in res.stderr.splitlines() if line.startswith("kaisa-train")]
    assert len(ours) == 1 and "kaisa[train]" in ours[0] and "numpy" in ours[0], res.stderr


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_source_tree_shadowing_the_installed_package_says_why_and_what_to_do(
    tmp_path: Path,
) -> None:
    """README flow: non-editable install, then ``python`` in the clone's root."""
    import kaisa

    installed = tmp_path / "site" / "kaisa"  # pip's copy: has the compiled extension
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    (installed / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    clone = tmp_path / "clone"  # the source tree: no extension built in place
    shutil.copytree(Path(kaisa.__file__).parent, clone / "kaisa",
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    code = (  # a development environment's editable-install finder would supply kaisa._C
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "import kaisa, kaisa.ops\nprint(kaisa.__file__, kaisa.ops.backend())\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300, check=False, cwd=clone,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(clone / "kaisa" / "__init__.py"), "torch"], res.stdout
    warning = " ".join(res.stderr.split())
    assert "shadows the installed kaisa at" in warning and str(installed) in warning, warning
    assert "run from another directory" in warning and "-e ." in warning, warning



#: The top-level modules besides ``__init__`` and ``layers`` (the former name of
#: ``kaisa.blocks``): import paths users' code and the docs name, each re-exporting the
#: public names of the module they live in now.
_SHIMS = {
    "kaisa.config": "kaisa.core.config",
    "kaisa.enums": "kaisa.utils.enums",
    "kaisa.hyperparams": "kaisa.utils.hyperparams",
    "kaisa.losses": "kaisa.kfac.losses",
    "kaisa.profiling": "kaisa.utils.profiling",
    "kaisa.scheduler": "kaisa.preconditioner.scheduler",
}

#: Modules moved out of a package, kept at their old path the same way: symmetric packing
#: (``pack_symmetric``, ...) moved from ``kaisa.distributed`` to ``kaisa.utils``.
_MOVED = {
    "kaisa.distributed.packing": "kaisa.utils.packing",
}


def test_old_import_paths_re_export_the_same_objects() -> None:
    import importlib

    import kaisa
    import kaisa.layers

    top = {p.stem for p in Path(kaisa.__file__).parent.glob("*.py")}
    assert top == {"__init__", "layers"} | {name.split(".")[1] for name in _SHIMS}
    for shim_name, home_name in (_SHIMS | _MOVED).items():
        shim, home = importlib.import_module(shim_name), importlib.import_module(home_name)
        for name in home.__all__:
            assert getattr(shim, name) is getattr(home, name), (shim_name, name)
    from kaisa.distributed.packing import pack_symmetric, packed_numel, unpack_symmetric
    from kaisa.utils import packing

    assert pack_symmetric is packing.pack_symmetric is kaisa.distributed.pack_symmetric
    assert packed_numel is packing.packed_numel is kaisa.distributed.packed_numel
    assert unpack_symmetric is packing.unpack_symmetric is kaisa.distributed.unpack_symmetric
    assert kaisa.layers.KFACLayer is kaisa.KFACLayer
    assert kaisa.checkpoint.save is importlib.import_module("kaisa.checkpoint.dcp").save
