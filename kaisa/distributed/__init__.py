"""Distributed K-FAC: KAISA strategies, placement, fused communication and the engine."""

from kaisa.distributed.engine import BlockRule, DistributedEngine
from kaisa.distributed.local import LocalCommunicator
from kaisa.distributed.memory import (
    LARGE_FACTOR_DIM,
    FactorSize,
    MemoryEstimate,
    choose_fraction,
    decomposition_numel,
    estimate_memory,
    factor_sizes,
)
from kaisa.distributed.packing import pack_symmetric, packed_numel, unpack_symmetric
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

__all__ = [
    "BlockRule",
    "LARGE_FACTOR_DIM",
    "CommHandle",
    "CommStats",
    "Communicator",
    "DistributedEngine",
    "DistributedStrategy",
    "FactorSize",
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
