"""The preemption recipe of docs/guide.md, run as written: stopped by SIGTERM at a random
step and started again, it ends with the checkpoint of one uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
STEPS = 400


def _recipe() -> str:
    text = (ROOT / "docs" / "guide.md").read_text()
    match = re.search(r"<!-- preemption-recipe: [^>]*-->\n```python\n(.*?)```", text, re.S)
    assert match is not None, "docs/guide.md lost its preemption recipe"
    return match.group(1)


def _start(script: Path, checkpoint: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), str(checkpoint), str(STEPS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=script.parent)


def _contents(checkpoint: Path) -> dict[str, Any]:
    out = checkpoint.with_name(checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, out)
    state: dict[str, Any] = torch.load(out, weights_only=False)
    state["loop"] = torch.load(checkpoint / "loop.pt", weights_only=True)
    return state


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_stopped_at_a_random_step_resumes_bit_for_bit(tmp_path: Path) -> None:
    script = tmp_path / "recipe.py"
    script.write_text(_recipe())
    whole = _start(script, tmp_path / "whole")
    out, err = whole.communicate(timeout=200)
    assert whole.returncode == 0 and out.splitlines()[-1] == "done", err

    stopped = _start(script, tmp_path / "split")
    assert stopped.stdout is not None
    assert stopped.stdout.readline().strip() == "training from step 0"
    time.sleep(random.Random(3).uniform(0.05, 0.4))
    stopped.send_signal(signal.SIGTERM)
    out, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 75, err
    step = int(re.fullmatch(r"stopped by SIGTERM at step (\d+)", out.strip()).group(1))  # type: ignore[union-attr]
    assert 0 < step < STEPS
    again = _start(script, tmp_path / "split")
    out, err = again.communicate(timeout=200)
    assert again.returncode == 0, err
    assert out.splitlines() == [f"training from step {step}", "done"]
    _same(_contents(tmp_path / "split"), _contents(tmp_path / "whole"))
