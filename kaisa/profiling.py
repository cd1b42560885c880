"""Timed regions of a step, and the opt-in profile of exclusive seconds by phase.

::

    with kaisa.profiling.PhaseProfile() as profile:
        optimizer.step(closure)
    profile.seconds  # {("forward",): ..., ("backward", "factors"): ..., ...}

They live in :mod:`kaisa.utils.profiling`; this module keeps ``kaisa.profiling``
importable.
"""

from __future__ import annotations

from kaisa.utils.profiling import PhaseProfile as PhaseProfile
from kaisa.utils.profiling import phase as phase
from kaisa.utils.profiling import timed as timed
