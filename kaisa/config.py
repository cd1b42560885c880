"""The validated configuration of :class:`kaisa.KFACPreconditioner`, :class:`KFACConfig`.

It lives in :mod:`kaisa.core.config`; this module keeps ``kaisa.config`` importable.
"""

from __future__ import annotations

from kaisa.core.config import HYPERPARAMETERS as HYPERPARAMETERS
from kaisa.core.config import REFERENCE_KINDS as REFERENCE_KINDS
from kaisa.core.config import DistributedConfig as DistributedConfig
from kaisa.core.config import KFACConfig as KFACConfig
