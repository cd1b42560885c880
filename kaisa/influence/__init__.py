"""Training-data attribution on kaisa's curvature: EK-FAC influence scores.

``docs/conventions.md``, "Influence", is the math (its anchor: Kronfluence 1.0.1)::

    influence = kaisa.influence.EKFACInfluence(model, damping=None)
    influence.fit(lambda: train_batches)             # two passes over the training set
    scores = influence.pairwise_scores(query_batches, train_batches)   # (n_query, n_train)
    self_influence = influence.self_scores(train_batches)              # (n_train,)
    influence.save("results/")                         # results/fit.pt
    save_scores("results/", "pairwise", scores)                        # results/pairwise.pt
"""

from __future__ import annotations

from kaisa.influence.ekfac import EKFACInfluence, Fisher, summed_cross_entropy
from kaisa.influence.results import load_scores, save_scores
from kaisa.influence.rows import running_factors

__all__ = ["EKFACInfluence", "Fisher", "load_scores", "running_factors", "save_scores",
           "summed_cross_entropy"]
