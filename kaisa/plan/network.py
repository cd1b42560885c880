"""The network a plan runs on: links, nodes, and the spec strings and presets that name them.

A :class:`NetworkSpec` has ``gpus_per_node`` ranks per node joined by an intra-node link
(NVLink, or loopback) and nodes joined by ``inter_links`` inter-node links each
(InfiniBand NICs). Each link is an alpha-beta pair: ``latency_s`` (alpha, seconds per message step)
and ``bandwidth_Bps`` (``1/beta``, bytes per second per rank for the intra-node link, per
NIC for the inter-node one).

Spec strings (:func:`parse_network`) read like the hardware sheet::

    "8x900GB/s,4x200Gb/s"            8 GPUs a node, NVLink 900 GB/s, 4 NICs of 200 Gb/s
    "8x600GB/s@2us,8x200Gb/s@5us"    with alpha per link
    "1x10Gb/s@50us"                  one rank a node, one 10 Gb/s link (no second term)

``B`` is bytes and ``b`` bits; ``K``/``M``/``G``/``T`` are powers of 1000. The named
:data:`PRESETS` are the clusters of the KAISA and SPD-KFAC papers and a few others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PRESETS", "Link", "NetworkSpec", "parse_network"]

#: alpha of an intra-node step when the spec gives none (NVLink/NCCL, a few µs).
DEFAULT_INTRA_LATENCY_S = 2e-6
#: alpha of an inter-node step when the spec gives none (InfiniBand verbs through NCCL).
DEFAULT_INTER_LATENCY_S = 5e-6

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_TERM = re.compile(
    r"^\s*(?P<count>\d+)\s*[x\u00d7*]\s*(?P<bw>[\d.]+)\s*(?P<prefix>[kKmMgGtT]?)(?P<unit>[bB])"
    r"(?:ps|/s)\s*(?:@\s*(?P<lat>[\d.]+)\s*(?P<tunit>s|ms|us|µs|ns))?\s*$"
)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One alpha-beta link.

    Attributes:
        bandwidth_Bps: Bytes per second (``1/beta``).
        latency_s: Seconds per message step (alpha).
    """

    bandwidth_Bps: float  # noqa: N815 (the unit is part of the name)
    latency_s: float

    def __post_init__(self) -> None:
        """Checks the link is physical."""
        if self.bandwidth_Bps <= 0 or self.latency_s < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth_Bps


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """Ranks on nodes, and the links inside and between nodes.

    Attributes:
        gpus_per_node: Ranks per node (consecutive ranks share a node).
        intra: The link between two ranks of one node.
        inter: One inter-node link (one NIC).
        inter_links: Inter-node links per node (their bandwidths add up).
        name: What the spec was built from (a preset name or the spec string).
    """

    gpus_per_node: int
    intra: Link
    inter: Link
    inter_links: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        """Checks the node shape."""
        if self.gpus_per_node < 1 or self.inter_links < 1:
            raise ValueError(f"gpus_per_node and inter_links must be >= 1, got {self}")

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.gpus_per_node

    def group_link(self, ranks: tuple[int, ...]) -> Link:
        """The alpha-beta link a collective over ``ranks`` sees.

        Inside one node it is the intra-node link. Across nodes alpha is the inter-node
        latency, and the bandwidth is the node's NIC bandwidth shared by the groups
        of this shape that run at once: a group with ``m`` members on a node shares the
        node's NICs with ``gpus_per_node / m`` others (kaisa starts the collectives of
        all its worker or receiver groups together), capped by the intra-node link.

        Args:
            ranks: The group's ranks.

        Returns:
            The link.
        """
        nodes: dict[int, int] = {}
        for r in ranks:
            nodes[self.node_of(r)] = nodes.get(self.node_of(r), 0) + 1
        if len(nodes) <= 1:
            return self.intra
        per_node = max(nodes.values())
        share = self.inter.bandwidth_Bps * self.inter_links * per_node / self.gpus_per_node
        return Link(bandwidth_Bps=min(self.intra.bandwidth_Bps, share),
                    latency_s=self.inter.latency_s)

    def describe(self) -> str:
        """One line: the node shape and both links."""
        return (
            f"{self.name or 'network'}: {self.gpus_per_node} ranks/node, intra "
            f"{self.intra.bandwidth_Bps / 1e9:.3g} GB/s alpha={self.intra.latency_s * 1e6:.3g} µs, "
            f"inter {self.inter_links}x{self.inter.bandwidth_Bps * 8 / 1e9:.3g} Gb/s "
            f"alpha={self.inter.latency_s * 1e6:.3g} µs"
        )


def _term(text: str, default_latency: float) -> tuple[int, Link]:
    m = _TERM.match(text)
    if m is None:
        raise ValueError(
            f"cannot read network term {text!r}: expected COUNTxBANDWIDTH[@LATENCY] such as "
            "'8x900GB/s' or '4x200Gb/s@5us'"
        )
    bw = float(m["bw"]) * _UNITS[m["prefix"].lower()] / (1.0 if m["unit"] == "B" else 8.0)
    lat = default_latency if m["lat"] is None else float(m["lat"]) * _TIME_UNITS[m["tunit"]]
    return int(m["count"]), Link(bandwidth_Bps=bw, latency_s=lat)


#: Named clusters. ``dgx-a100`` (alias ``a100-ib``): NVIDIA DGX A100 nodes as NVIDIA
#: specifies them, 8 A100 with NVLink 3 (600 GB/s) and 8 HDR InfiniBand NICs of 200 Gb/s
#: (the node type of KAISA's A100 runs; alpha values are assumptions, not measurements);
#: ``h100-ib``: DGX H100 (NVLink 4, 900 GB/s; 8 NDR NICs of 400 Gb/s); ``ethernet-10g``: one
#: rank a node on 10 Gb/s Ethernet.
PRESETS: dict[str, str] = {
    "dgx-a100": "8x600GB/s@2us,8x200Gb/s@5us",
    "a100-ib": "8x600GB/s@2us,8x200Gb/s@5us",
    "h100-ib": "8x900GB/s@2us,8x400Gb/s@5us",
    "ethernet-10g": "1x10Gb/s@50us",
}


def parse_network(spec: str) -> NetworkSpec:
    """Reads a preset name or a spec string (see the module docstring).

    Args:
        spec: ``"8x900GB/s,4x200Gb/s"``-style terms (GPUs a node x intra-node bandwidth,
            then NICs a node x NIC bandwidth), or a name in :data:`PRESETS`.

    Returns:
        The network. With one term, every rank is a node and the term's link joins them.

    Raises:
        ValueError: If the spec cannot be read.
    """
    text = PRESETS.get(spec.strip().lower(), spec)
    terms = [t for t in text.split(",") if t.strip()]
    if len(terms) == 1:
        count, link = _term(terms[0], DEFAULT_INTER_LATENCY_S)
        return NetworkSpec(gpus_per_node=1, intra=link, inter=link, inter_links=count,
                           name=spec)
    if len(terms) != 2:
        raise ValueError(f"a network spec has one or two terms, got {spec!r}")
    gpus, intra = _term(terms[0], DEFAULT_INTRA_LATENCY_S)
    links, inter = _term(terms[1], DEFAULT_INTER_LATENCY_S)
    return NetworkSpec(gpus_per_node=gpus, intra=intra, inter=inter, inter_links=links,
                       name=spec)
