"""The same settings on every rank: one digest per setting, compared once.

Ranks that construct K-FAC with different settings (another damping, another
``compute_method``) would run the same collectives on different math and diverge
silently. :func:`check_same_on_ranks` gathers a 56-bit SHA-256 digest of each setting's
canonical form from every rank (one ``all_gather`` of a small integer tensor on the
default process group; nothing with one process) and raises the same ``ValueError`` on
every rank when one differs, naming the first differing setting and each rank's value.
Settings that are callables of the step are compared by their value at step 0 (their
code is not compared); other callables by their qualified name.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["canonical", "check_same_on_ranks"]


def canonical(value: object) -> str:
    """A text form of ``value`` that is equal on two ranks exactly when the values are."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(canonical(v) for v in value) + ")"
    if isinstance(value, torch.Tensor):
        return f"tensor({canonical(value.tolist())})"
    if callable(value) and not isinstance(value, torch.dtype):
        return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"
    return repr(value)


def _digest(name: str, value: object) -> int:
    text = f"{name}={canonical(value)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


def check_same_on_ranks(
    settings: Mapping[str, object], *, what: str, device: torch.device
) -> None:
    """Raises ``ValueError`` on every rank unless ``settings`` are equal on every rank.

    Every rank of the default process group must call it at the same point with the
    same setting names (a no-op without one, or with one rank).

    Args:
        settings: ``{name: value}`` in a fixed order.
        what: What the settings are, for the message (``'KFACPreconditioner
            configuration'``).
        device: Where the gathered tensor lives (CUDA with NCCL).

    Raises:
        ValueError: Naming the first setting that differs and each rank's value.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    names = list(settings)
    mine = torch.tensor(
        [_digest("names", names)] + [_digest(n, settings[n]) for n in names],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()
    differ = (table != table[0]).any(dim=0).tolist()
    if not any(differ):
        return
    if differ[0]:
        raise ValueError(f"kaisa: the {what} has other settings on other ranks (another version?)")
    bad = [n for n, d in zip(names, differ[1:], strict=True) if d]
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, canonical(settings[bad[0]]))
    ranks: dict[object, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    shown = ", ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                      for v, r in ranks.items())
    more = f" (also {', '.join(bad[1:])})" if len(bad) > 1 else ""
    raise ValueError(
        f"kaisa: the {what} differs across ranks: {bad[0]} is {shown}{more}; every rank "
        "must use the same settings"
    )
