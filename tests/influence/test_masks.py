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


class _TwoSequences(torch.nn.Module):
    """An encoder over the masked source and a decoder over another sequence of the same
    length (the mask is not the decoder's)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(3, 4)
        self.dec = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, source: torch.Tensor, attention_mask: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        memory = (self.enc(source) * attention_mask[..., None]).sum(1, keepdim=True)
        return self.head(torch.tanh(self.dec(target) + memory))  # type: ignore[no-any-return]


def test_masked_names_the_layers_the_mask_applies_to() -> None:
    """With ``masked=["enc"]`` the decoder's gradients are its own (equal to one backward
    pass per example); without, its rows at the source's padded positions would be
    dropped."""
    torch.manual_seed(0)
    model = _TwoSequences().double()
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    inputs = {"source": torch.randn(3, 4, 3, generator=g, dtype=F64), "attention_mask": mask,
              "target": torch.randn(3, 4, 3, generator=g, dtype=F64)}
    targets = torch.randint(0, 5, (3, 4), generator=g)
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64, masked=["enc"])
    with influence._observer.installed():
        passed = influence._observer.run(
            inputs, lambda out: torch.nn.functional.cross_entropy(
                out.reshape(-1, 5), targets.reshape(-1), reduction="sum"))
    got = sum(p.matrices() for p in influence._parts(passed)["dec"])
    for n in range(3):
        one = {k: v[n:n + 1] for k, v in inputs.items()}
        loss = torch.nn.functional.cross_entropy(model(**one).reshape(-1, 5),
                                                 targets[n], reduction="sum")
        w, b = torch.autograd.grad(loss, [model.dec.weight, model.dec.bias])
        assert _rel(got[n, 0], torch.cat([w, b[:, None]], dim=1)) < 1e-12  # type: ignore[index]


def test_token_scores_of_batches_of_other_lengths_and_an_empty_training_set() -> None:
    model, seqs = _model(), _sequences()
    batches = [_padded(seqs[:4]), _padded(seqs[4:6]), _padded(seqs[6:])]  # 12, 12, 3 wide
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64, skip=["wpe"])
    influence.fit(lambda: iter(batches))
    tokens = influence.token_scores(batches[:1], batches)
    assert tokens.shape == (4, 7, 12) and bool((tokens[:, 6, 3:] == 0).all())
    assert _rel(tokens.sum(-1), influence.pairwise_scores(batches[:1], batches)) < 1e-10
    assert influence.pairwise_scores(batches[:1], []).shape == (4, 0)
    assert influence.token_scores(batches[:1], []).shape == (4, 0, 1)


def test_scores_under_autocast_are_in_the_fits_dtype() -> None:
    """Under the caller's autocast the model runs as asked; the influence's own products
    stay in its dtype."""
    model, seqs = _model(), _sequences()
    model.float()
    batches = [_padded(seqs[:4]), _padded(seqs[4:])]
    influence = EKFACInfluence(model, fisher="empirical", skip=["wpe"])
    influence.fit(lambda: iter(batches))
    plain = influence.pairwise_scores(batches[:1], batches)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = influence.pairwise_scores(batches[:1], batches)
    assert mixed.dtype == torch.float32 and plain.dtype == torch.float32
    assert _rel(mixed, plain) < 0.2  # the bfloat16 forward's difference, not a dtype leak
