"""The library never imports the training app (``kaisa.train``) or its model zoo.

The app (``kaisa/train/``, with the models under ``kaisa/train/models/``) sits beside the
library inside the ``kaisa`` package: it may import the library, never the other way round.
Every module of ``kaisa/`` outside ``kaisa/train/`` is parsed and each import it names —
at module level or inside a function, absolute or relative, ``from kaisa import train``,
and ``importlib.import_module``/``__import__`` with a literal name — is resolved to an
absolute module name and checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kaisa

LIBRARY = Path(kaisa.__file__).resolve().parent
APP = "kaisa.train"  # the application package: its models live at kaisa.train.models


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_modules() -> list[Path]:
    app = LIBRARY / "train"
    return sorted(p for p in LIBRARY.rglob("*.py") if app not in p.parents)


def _imported_names(source: str, module: str, *, is_package: bool) -> list[tuple[int, str]]:
    """Absolute names of everything ``source`` (module ``module``) imports, with lines.

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule).
    """
    package = module if is_package else module.rpartition(".")[0]
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.append((node.lineno, prefix))
            names += [(node.lineno, f"{prefix}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = (func.attr if isinstance(func, ast.Attribute)
                      else func.id if isinstance(func, ast.Name) else "")
            arg = node.args[0]
            if (called in {"import_module", "__import__"} and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                names.append((node.lineno, arg.value))
    return names


def _is_app(name: str) -> bool:
    return name == APP or name.startswith(APP + ".")


def _violations(path: Path) -> list[str]:
    module = _module_name(path)
    found = _imported_names(path.read_text(encoding="utf-8"), module,
                            is_package=path.name == "__init__.py")
    rel = path.relative_to(LIBRARY.parent)
    return [f"{rel}:{line} imports {name}" for line, name in found if _is_app(name)]


def test_the_walk_sees_the_library_and_not_the_app() -> None:
    modules = _library_modules()
    names = {_module_name(p) for p in modules}
    assert "kaisa" in names and len(names) > 20, names
    assert not any(_is_app(n) for n in names)
    assert (LIBRARY / "train" / "models" / "__init__.py").is_file()  # the zoo is the app's


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("import kaisa.train", "kaisa.curvature", False),
        ("import kaisa.train.models.gpt as g", "kaisa.curvature", False),
        ("from kaisa import train", "kaisa.curvature", False),
        ("from kaisa.train.models import resnet32", "kaisa.curvature", False),
        ("from .train import cli", "kaisa.curvature", False),
        ("from . import train", "kaisa", True),
        ("from ..train.models import gpt", "kaisa.methods.kfac", False),
        ("def f():\n    from kaisa.train import models\n", "kaisa.curvature", False),
        ("import importlib\nimportlib.import_module('kaisa.train.cli')", "kaisa.x", False),
    ],
)
def test_the_check_catches_every_spelling(source: str, module: str, is_package: bool) -> None:
    found = _imported_names(source, module, is_package=is_package)
    assert any(_is_app(name) for _, name in found), found


def test_library_spellings_are_not_flagged() -> None:
    source = "import kaisa.ops\nfrom kaisa import checkpoint, training_utils\nfrom .trains import x\n"
    found = _imported_names(source, "kaisa.curvature", is_package=False)
    assert not any(_is_app(name) for _, name in found), found


def test_the_library_imports_nothing_from_the_app() -> None:
    bad = [v for path in _library_modules() for v in _violations(path)]
    assert not bad, "the library must not import the app or its models:\n" + "\n".join(bad)
