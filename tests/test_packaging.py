"""The library needs torch only; the app names its missing extra in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK = "import sys\nfor m in ('numpy', 'sklearn', 'tqdm', 'matplotlib'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_library_works_without_the_app_dependencies() -> None:
    res = _run(
        """
        import torch, kaisa
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        pre = kaisa.KFACPreconditioner(model)
        model(torch.randn(5, 4)).sum().backward()
        pre.step()
        import kaisa.models, kaisa.distributed
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
