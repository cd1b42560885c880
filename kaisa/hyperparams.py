"""Hyperparameters that may be numbers or callables of the step: checks and evaluation.

They live in :mod:`kaisa.utils.hyperparams`; this module keeps ``kaisa.hyperparams``
importable.
"""

from __future__ import annotations

from kaisa.utils.hyperparams import FLOAT_BOUNDS as FLOAT_BOUNDS
from kaisa.utils.hyperparams import Schedule as Schedule
from kaisa.utils.hyperparams import Schedules as Schedules
from kaisa.utils.hyperparams import check_bounded as check_bounded
from kaisa.utils.hyperparams import check_count as check_count
from kaisa.utils.hyperparams import check_float as check_float
from kaisa.utils.hyperparams import check_int as check_int
from kaisa.utils.hyperparams import evaluate as evaluate
from kaisa.utils.hyperparams import scheduled_float as scheduled_float
from kaisa.utils.hyperparams import scheduled_int as scheduled_int
