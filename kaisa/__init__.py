"""kaisa: distributed K-FAC gradient preconditioning for PyTorch.

Quickstart::

    import kaisa
    pre = kaisa.KFACPreconditioner(model)
    loss.backward(); pre.step(); optimizer.step()
"""

from __future__ import annotations

from kaisa import checkpoint, ops
from kaisa.blocks import KFACLayer
from kaisa.blocks.declared import Like, declare_module
from kaisa.core import KFACConfig
from kaisa.distributed.config import DistributedConfig
from kaisa.ekfac import EKFAC, BasisRefresh
from kaisa.kfac import KFAC, Curvature, JacobianMethod
from kaisa.muon import KFACMuon, MuonCurvature
from kaisa.preconditioner import KFACPreconditioner, LambdaParamScheduler
from kaisa.utils.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, KFACApprox

__all__ = [
    "EKFAC",
    "KFAC",
    "AssignmentStrategy",
    "BasisRefresh",
    "ComputeMethod",
    "Curvature",
    "DistributedConfig",
    "DistributedStrategy",
    "JacobianMethod",
    "KFACApprox",
    "KFACConfig",
    "KFACLayer",
    "KFACMuon",
    "KFACPreconditioner",
    "LambdaParamScheduler",
    "Like",
    "MuonCurvature",
    "checkpoint",
    "declare_module",
    "ops",
]

__version__ = "0.1.0"
