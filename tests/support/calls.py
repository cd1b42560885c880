"""Operator calls a piece of code dispatches: each is at least one kernel launch on a GPU."""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Calls"]


class Calls(TorchDispatchMode):
    """Counts, by operator name, every call that reaches the dispatcher (views included).

    Use as a context manager; ``calls`` holds the counts (``aten._local_scalar_dense`` is a
    read of a tensor's value on the host: a synchronisation on a GPU).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
