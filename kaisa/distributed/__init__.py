"""Distributed K-FAC: one engine for every world size, which moves payloads it never reads.

The engine (:mod:`kaisa.distributed.engine`, given an :class:`EngineConfig`) with the
KAISA strategies, the placement and the per-rank memory model; factor averaging, the
decompositions' broadcasts and, under FSDP2, the blocks preconditioned one at a time
(:mod:`kaisa.distributed.fsdp`); the communicators behind one protocol (a single
process's, and fused asynchronous buckets on ``torch.distributed``); and ``J v``'s dual
parameters inside FSDP2's units (:mod:`kaisa.distributed.fsdp_tangents`).
"""

from kaisa.distributed.config import DistributedConfig, EngineConfig
from kaisa.distributed.engine import BlockRule, DistributedEngine
from kaisa.distributed.local import LocalCommunicator
from kaisa.distributed.memory import (
    LARGE_FACTOR_DIM,
    FactorSize,
    FractionCost,
    MemoryEstimate,
    choose_fraction,
    decomposition_numel,
    estimate_memory,
    factor_sizes,
)
from kaisa.distributed.placement import LayerPlacement, Placement, factor_cost, place_layers
from kaisa.distributed.protocol import CommHandle, Communicator
from kaisa.distributed.stats import CommStats
from kaisa.distributed.strategy import (
    DistributedStrategy,
    FractionSpec,
    WorkerGrid,
    resolve_grad_workers,
    strategy_fraction,
    valid_fractions,
)
from kaisa.distributed.torch_comm import TorchDistCommunicator, make_communicator
from kaisa.utils.packing import pack_symmetric, packed_numel, unpack_symmetric

__all__ = [
    "BlockRule",
    "LARGE_FACTOR_DIM",
    "CommHandle",
    "CommStats",
    "Communicator",
    "DistributedConfig",
    "EngineConfig",
    "DistributedEngine",
    "DistributedStrategy",
    "FactorSize",
    "FractionCost",
    "FractionSpec",
    "LayerPlacement",
    "LocalCommunicator",
    "MemoryEstimate",
    "Placement",
    "TorchDistCommunicator",
    "WorkerGrid",
    "choose_fraction",
    "decomposition_numel",
    "estimate_memory",
    "factor_cost",
    "factor_sizes",
    "make_communicator",
    "pack_symmetric",
    "packed_numel",
    "place_layers",
    "resolve_grad_workers",
    "strategy_fraction",
    "unpack_symmetric",
    "valid_fractions",
]
