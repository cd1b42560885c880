"""Gives every optimizer step of a test run a minimum wall time, whatever the machine.

Loaded by Python at start-up when this folder is on ``PYTHONPATH`` and
``KAISA_TEST_MIN_STEP_SECONDS`` is set: a global ``torch.optim`` step post-hook sleeps
until at least that many seconds have passed since the previous step ended. The stop-signal
tests send SIGTERM at random wall-clock moments "inside the run"; on a fast machine a
whole run can end before the signal does. The pause changes no arithmetic: the paced run
equals an unpaced one bit for bit, and where steps already take longer it sleeps nothing.
"""

from __future__ import annotations

import os

_SECONDS = os.environ.get("KAISA_TEST_MIN_STEP_SECONDS")
if _SECONDS:
    import time
    from typing import Any

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _minimum = float(_SECONDS)
    _last = [time.monotonic()]

    def _pace(*_: Any) -> None:
        wait = _last[0] + _minimum - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        _last[0] = time.monotonic()

    register_optimizer_step_post_hook(_pace)
