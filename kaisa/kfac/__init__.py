"""The adaptive K-FAC optimizer, :class:`kaisa.KFAC`, and everything only it needs.

Its configuration (:mod:`kaisa.kfac.config`), the losses it understands
(:mod:`kaisa.kfac.losses`), the backward passes that give G from the predictive
distribution (:mod:`kaisa.kfac.fisher`), the quadratic model and its Jacobian-vector
products (:mod:`kaisa.kfac.quadratic`), the replayed forward pass
(:mod:`kaisa.kfac.replay`), the closure's contract (:mod:`kaisa.kfac.closure`), loss
scaling (:mod:`kaisa.kfac.amp`) and its checkpoint entry (:mod:`kaisa.kfac.state`).
"""

from __future__ import annotations

from kaisa.kfac.config import JacobianMethod
from kaisa.kfac.optimizer import KFAC, Curvature

__all__ = ["KFAC", "Curvature", "JacobianMethod"]
