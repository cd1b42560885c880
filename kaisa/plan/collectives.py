"""alpha-beta models of the collectives kaisa issues, ring and tree, and the choice NCCL makes.

For ``p`` ranks, ``n`` bytes and a link with latency ``alpha`` and seconds per byte ``beta``:

==============  =================================  ===================================
collective      ring (pipelined)                   tree
==============  =================================  ===================================
allreduce       ``2(p-1)alpha + 2(p-1)/p · nbeta``        ``2⌈log2 p⌉alpha + 2nbeta`` (NCCL's
                                                   pipelined double binary tree)
broadcast       ``(p-1)alpha + nbeta`` (a chain)          ``⌈log2 p⌉(alpha + nbeta)`` (binomial)
reduce          ``(p-1)alpha + nbeta``                    ``⌈log2 p⌉(alpha + nbeta)``
all-to-all      ``(p-1)(alpha + nbeta/p)`` (``n``: the bytes one rank sends, in ``p`` parts)
==============  =================================  ===================================

:attr:`Algorithm.AUTO` takes the faster of the two, as NCCL's tuner does from its own
alpha-beta table. :attr:`Algorithm.GLOO` is gloo's choice: ring allreduce and binomial-tree
broadcasts. Alone, gloo's 4-rank broadcast on links shaped per rank takes ``3 n beta`` (the
root posts its two sends at once, then the second level forwards), but the engine's
broadcasts from several roots overlap two at a time (gloo's two worker threads), which
puts them between the chain and this serial tree (``docs/scaling.md``, "Validation
against measurement"). A single rank costs
nothing. Which link a group sees (inside a node, or across nodes sharing the NICs) is
:meth:`kaisa.plan.network.NetworkSpec.group_link`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from kaisa.plan.network import Link, NetworkSpec

__all__ = ["Algorithm", "Collective", "bucketed_time", "collective_time", "link_time"]


class Collective(enum.Enum):
    """The collectives of a K-FAC step."""

    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"


class Algorithm(enum.Enum):
    """How a collective is run."""

    RING = "ring"
    TREE = "tree"
    AUTO = "auto"  # the faster of the two, as NCCL picks
    GLOO = "gloo"  # ring allreduce, binomial-tree broadcast and reduce (gloo, as measured)


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def link_time(op: Collective, nbytes: float, p: int, link: Link,
              algorithm: Algorithm = Algorithm.AUTO) -> float:
    """Seconds of one collective of ``nbytes`` over ``p`` ranks on ``link``.

    Args:
        op: The collective.
        nbytes: The message size in bytes (for all-to-all, the bytes one rank sends).
        p: Ranks in the group.
        link: The alpha-beta link.
        algorithm: Ring, tree, or the faster (``AUTO``).

    Returns:
        The modelled time (0 for one rank or an empty message).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    a, b = link.latency_s, link.beta
    if op is Collective.ALL_TO_ALL:
        return (p - 1) * (a + nbytes * b / p)
    if op is Collective.ALLREDUCE:
        ring = 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes * b
        tree = 2 * _log2(p) * a + 2 * nbytes * b
    else:
        ring = (p - 1) * a + nbytes * b
        tree = _log2(p) * (a + nbytes * b)
    if algorithm is Algorithm.RING or (algorithm is Algorithm.GLOO
                                       and op is Collective.ALLREDUCE):
        return ring
    if algorithm in (Algorithm.TREE, Algorithm.GLOO):
        return tree
    return min(ring, tree)


def collective_time(op: Collective, nbytes: float, ranks: Sequence[int], net: NetworkSpec,
                    algorithm: Algorithm = Algorithm.AUTO) -> float:
    """Seconds of one collective over the rank set ``ranks`` of ``net``.

    Args:
        op: The collective.
        nbytes: The message size in bytes.
        ranks: The group (its placement on nodes picks the link).
        net: The network.
        algorithm: Ring, tree, or the faster.

    Returns:
        The modelled time.
    """
    group = tuple(ranks)
    if len(group) <= 1:
        return 0.0
    return link_time(op, nbytes, len(group), net.group_link(group), algorithm)


def bucketed_time(op: Collective, nbytes: float, ranks: Sequence[int], net: NetworkSpec,
                  cap_bytes: float, algorithm: Algorithm = Algorithm.AUTO) -> float:
    """Seconds of ``nbytes`` sent as back-to-back buckets of at most ``cap_bytes``.

    kaisa's communicator fuses tensors into buckets of ``allreduce_bucket_cap_mb`` and
    launches a bucket once it is full, so a large payload pays alpha once per bucket.

    Args:
        op: The collective.
        nbytes: Total bytes.
        ranks: The group.
        net: The network.
        cap_bytes: The bucket capacity (``<= 0``: one bucket).
        algorithm: Ring, tree, or the faster.

    Returns:
        The modelled time of all the buckets, one after the other.
    """
    if nbytes <= 0 or len(tuple(ranks)) <= 1:
        return 0.0
    if cap_bytes <= 0 or nbytes <= cap_bytes:
        return collective_time(op, nbytes, ranks, net, algorithm)
    full, rest = divmod(nbytes, cap_bytes)
    time = full * collective_time(op, cap_bytes, ranks, net, algorithm)
    return time + collective_time(op, rest, ranks, net, algorithm)
