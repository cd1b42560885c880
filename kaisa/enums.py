"""The enumerations kaisa's constructors accept (each also as its name or value, a string).

They live in :mod:`kaisa.utils.enums`; this module keeps ``kaisa.enums`` importable.
"""

from __future__ import annotations

from kaisa.utils.enums import AssignmentStrategy as AssignmentStrategy
from kaisa.utils.enums import BasisRefresh as BasisRefresh
from kaisa.utils.enums import ComputeMethod as ComputeMethod
from kaisa.utils.enums import DistributedStrategy as DistributedStrategy
from kaisa.utils.enums import FactorStorage as FactorStorage
from kaisa.utils.enums import KFACApprox as KFACApprox
from kaisa.utils.enums import LossKind as LossKind
from kaisa.utils.enums import Reduction as Reduction
from kaisa.utils.enums import Side as Side
from kaisa.utils.enums import parse_enum as parse_enum
from kaisa.utils.enums import parse_grad_worker_fraction as parse_grad_worker_fraction
