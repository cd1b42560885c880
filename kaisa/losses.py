"""The losses :class:`kaisa.KFAC` understands (``loss="mse"``, ``"cross_entropy"``).

They live in :mod:`kaisa.kfac.losses`; this module keeps ``kaisa.losses`` importable.
"""

from __future__ import annotations

from kaisa.kfac.losses import LOSSES as LOSSES
from kaisa.kfac.losses import CrossEntropyLoss as CrossEntropyLoss
from kaisa.kfac.losses import Loss as Loss
from kaisa.kfac.losses import LossKind as LossKind
from kaisa.kfac.losses import MSELoss as MSELoss
from kaisa.kfac.losses import Reduction as Reduction
from kaisa.kfac.losses import Share as Share
