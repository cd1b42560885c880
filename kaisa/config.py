"""The validated configuration of :class:`kaisa.KFACPreconditioner`, :class:`KFACConfig`.

It lives in :mod:`kaisa.core.config` (:class:`DistributedConfig`, the engine's part, in
:mod:`kaisa.distributed.config`); this module keeps ``kaisa.config`` importable.
"""

from __future__ import annotations

from kaisa.core.config import HYPERPARAMETERS as HYPERPARAMETERS
from kaisa.core.config import REFERENCE_KINDS as REFERENCE_KINDS
from kaisa.core.config import KFACConfig as KFACConfig
from kaisa.distributed.config import DistributedConfig as DistributedConfig
