"""``kaisa.KFACMuon``: Muon with K-FAC's curvature (``docs/conventions.md``, "KFACMuon").

The package owns Muon's arithmetic as pure functions (:mod:`kaisa.muon.newton_schulz`), the
block state of the input curvature (:mod:`kaisa.muon.methods`), the configuration and the
optimizer.
"""

from kaisa.muon.config import MUON_KINDS, KFACMuonConfig, MuonCurvature
from kaisa.muon.optimizer import KFACMuon

__all__ = ["MUON_KINDS", "KFACMuon", "KFACMuonConfig", "MuonCurvature"]
