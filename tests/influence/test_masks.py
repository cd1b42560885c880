"""Attention masks: a padded batch scores as its sequences alone (Hugging Face GPT-2).

Inputs given as keyword tensors (``model(**inputs)``) with an ``attention_mask``: the
masked positions' rows leave the covariances (their count too) and the examples'
gradients, so a right-padded batch (targets ``-100`` at the padding) gives the fit and the
scores of each sequence in a batch of its own, unpadded, in float64. A layer called once
for the whole batch (GPT-2's position embedding) is refused in one line, and left out with
``skip``.
"""

from __future__ import annotations

import pytest
import torch

from kaisa.influence import EKFACInfluence
from tests.influence.test_anchor import _rel

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

F64 = torch.float64
LENGTHS = (10, 7, 12, 5, 9, 12, 3)


def _model() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 40, (n,), generator=g) for n in LENGTHS]


def _alone(ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    return {"input_ids": ids[None]}, targets[None]


def _padded(seqs: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
        targets[i, :len(s) - 1] = s[1:]
    return {"input_ids": ids, "attention_mask": mask}, targets


def test_a_padded_batch_scores_as_its_sequences_alone() -> None:
    model, seqs = _model(), _sequences()
    alone = [_alone(s) for s in seqs]
    padded = [_padded(seqs[:4]), _padded(seqs[4:])]
    results = []
    for batches in (alone, padded):
        influence = EKFACInfluence(model, fisher="empirical", dtype=F64, skip=["wpe"])
        influence.fit(lambda b=batches: iter(b))
        results.append((influence.pairwise_scores(padded[:1], batches),
                        influence.self_scores(batches), influence))
    kinds = set(results[0][2].coverage().values())
    assert {"linear", "embedding", "scale_shift", "first-order"} <= kinds  # wpe: first-order
    assert _rel(results[1][0], results[0][0]) < 1e-10
    assert _rel(results[1][1], results[0][1]) < 1e-10
    tokens = results[1][2].token_scores(padded[:1], padded)
    assert tokens.shape == (4, 7, 12)
    assert _rel(tokens.sum(-1), results[1][0]) < 1e-10
    assert bool((tokens[:, 1, 7:] == 0).all())  # the padding of a 7-token sequence


def test_a_layer_called_once_for_the_batch_is_refused_in_one_line() -> None:
    influence = EKFACInfluence(_model(), fisher="empirical", dtype=F64)
    with pytest.raises(ValueError, match=r"'transformer\.wpe' is called on 1 rows.*skip="):
        influence.fit(lambda: iter([_padded(_sequences()[:3])]))
