"""The curvature core that every product stands on, and nothing above it.

:class:`~kaisa.core.curvature.KFACCurvature` builds the blocks, the statistics recorder
(:mod:`kaisa.core.hooks`), the distributed engine and the method, and runs the phases
(factors, decompositions, preconditioning) with damping and decay given as arguments
(its parts: :mod:`kaisa.core.recording`, :mod:`kaisa.core.directions`,
:mod:`kaisa.core.state`); :class:`~kaisa.core.optimizer.CurvatureOptimizer` is the base of
the products that step every parameter themselves (EKFAC, KFACMuon);
:class:`~kaisa.core.config.KFACConfig` is its validated configuration,
:mod:`kaisa.core.clipping` writes preconditioned directions back (KL clip, non-finite
guard) and :mod:`kaisa.core.coverage` says which parameters the blocks cover.
"""

from __future__ import annotations

from kaisa.core.config import KFACConfig
from kaisa.core.curvature import KFACCurvature

__all__ = ["KFACConfig", "KFACCurvature"]
