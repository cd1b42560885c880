"""Training-data attribution on kaisa's curvature: EK-FAC influence scores.

``docs/conventions.md``, "Influence", is the math (its anchor: Kronfluence 1.0.1)::

    influence = kaisa.influence.EKFACInfluence(model, damping=None)
    influence.fit(lambda: train_batches)             # two passes over the training set
    scores = influence.pairwise_scores(query_batches, train_batches)   # (n_query, n_train)
    self_influence = influence.self_scores(train_batches)              # (n_train,)
"""

from __future__ import annotations

from kaisa.influence.ekfac import EKFACInfluence, Fisher, summed_cross_entropy
from kaisa.influence.rows import running_factors

__all__ = ["EKFACInfluence", "Fisher", "running_factors", "summed_cross_entropy"]
