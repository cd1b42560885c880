"""``kaisa.influence.EKFACInfluence``: the conventions in float64, and their anchor.

Against the plain-torch transcription of ``docs/conventions.md``, "Influence"
(``tests/influence/test_anchor.py``) on a digits MLP, any batch size; against Kronfluence
1.0.1 itself (slow, skipped where it is not installed) on the MLP and a small CNN. Saving
and loading a fit, a fit of another model refused, coverage, the true Fisher's draws.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from kaisa.influence import EKFACInfluence
from tests.influence.test_anchor import _digits, _lambda, _rel, conventions_ekfac

F64 = torch.float64


def _batches(data: TensorDataset, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.tensors
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _fixed(model: nn.Module, train: TensorDataset) -> torch.Tensor:
    with torch.no_grad():
        probs = F.softmax(model(train.tensors[0]), dim=-1)
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3))[:, 0]


def _fit(model: nn.Module, train: TensorDataset, labels: torch.Tensor, size: int,
         damping: float | None) -> EKFACInfluence:
    """Fitted with ``labels`` as the Fisher's (the empirical mode on relabelled batches)."""
    influence = EKFACInfluence(model, fisher="empirical", damping=damping, dtype=F64)
    relabelled = TensorDataset(train.tensors[0], labels)
    influence.fit(lambda: iter(_batches(relabelled, size)))
    return influence


@pytest.mark.parametrize(("fixed", "damping", "size"),
                         [(False, None, 64), (True, 1e-3, 200), (True, None, 17)])
def test_scores_equal_the_conventions_float64(fixed: bool, damping: float | None,
                                              size: int) -> None:
    model, train, query = _digits()
    labels = _fixed(model, train) if fixed else train.tensors[1]
    influence = _fit(model, train, labels, size, damping)
    want = conventions_ekfac(model, train, query, damping=damping, factor_labels=labels,
                             lambda_labels=labels)
    for name, f in influence._factors.items():  # the fit, in the reference's bases
        assert f.qa is not None and f.qs is not None
        expected = want["factors"][name]
        assert _rel(f.lam()[0], _lambda(expected["G_lambda"], f.qs[0], f.qa[0])) < 1e-12
        assert abs(influence.block_damping(name) - expected["damping"]) <= (
            1e-12 * expected["damping"])
    pairwise = influence.pairwise_scores(_batches(query, 7), _batches(train, size))
    assert pairwise.shape == (20, 200)
    assert _rel(pairwise, want["pairwise"]) < 1e-10
    assert _rel(influence.self_scores(_batches(train, 33)), want["self"]) < 1e-10


def test_a_fit_saves_loads_and_refuses_another_models(tmp_path: Path) -> None:
    model, train, _ = _digits()
    influence = _fit(model, train, train.tensors[1], 50, None)
    scores = influence.self_scores(_batches(train, 50))
    influence.save(tmp_path / "fit.pt")
    again = EKFACInfluence(model, damping=None, dtype=F64)
    with pytest.raises(RuntimeError, match="call fit"):
        again.self_scores(_batches(train, 50))
    again.load(tmp_path / "fit.pt")
    assert torch.equal(again.self_scores(_batches(train, 50)), scores)
    other = EKFACInfluence(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)))
    with pytest.raises(ValueError, match=r"lam_sum of layer '0' is not \(1, 16, 65\)"):
        other.load(tmp_path / "fit.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a fit")
    with pytest.raises(ValueError, match="not an EKFACInfluence fit"):
        again.load(tmp_path / "junk.pt")


def test_coverage_and_the_true_fishers_draws() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.LayerNorm(16), nn.Linear(16, 10)).double()
    train = _digits()[1]
    influence = EKFACInfluence(model, seed=5, dtype=F64)  # true Fisher: labels drawn
    assert influence.coverage() == {"0.weight": "linear", "0.bias": "linear",
                                    "1.weight": "scale_shift", "1.bias": "scale_shift",
                                    "2.weight": "linear", "2.bias": "linear"}
    assert EKFACInfluence(model, layer_kinds="linear").coverage()["1.weight"] == "first-order"

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(_batches(train, 64))

    influence.fit(batches)
    first = influence.self_scores(batches())
    repeat = EKFACInfluence(model, seed=5, dtype=F64)
    repeat.fit(batches)
    assert torch.equal(repeat.self_scores(batches()), first)  # the draws follow the seed
    assert bool((first > 0).all()) and bool(torch.isfinite(first).all())
    with pytest.raises(ValueError, match="damping must be >= 0"):
        EKFACInfluence(model, damping=-1.0)
    with pytest.raises(ValueError, match="no layer influence can track"):
        EKFACInfluence(nn.Sequential(nn.LayerNorm(4)), layer_kinds=("linear",))


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.conv(x.reshape(-1, 1, 8, 8))))
        return self.fc(h.flatten(1))


@pytest.mark.slow
@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_kaisa_equals_kronfluence(net: str, tmp_path: Path) -> None:
    """The anchor itself: factors' ``Λ``, damping and scores to 1e-6 relative."""
    pytest.importorskip("kronfluence", reason="kronfluence 1.0.1 is not installed")
    from tests.support.kronfluence import kronfluence_ekfac

    model, train, query = _digits()
    if net == "cnn":
        torch.manual_seed(0)
        model = _CNN().double()
    labels = _fixed(model, train)
    theirs = kronfluence_ekfac(model, train, query, damping=None, batch_size=64,
                               workdir=str(tmp_path), empirical=False, fixed_labels=labels)
    ours = _fit(model, train, labels, 64, None)
    assert set(ours.blocks) == set(theirs["factors"])
    for name, want in theirs["factors"].items():
        f = ours._factors[name]
        assert f.a_sum is not None and f.s_sum is not None
        assert _rel(f.a_sum[0] / f.rows, want["A"]) < 1e-6
        assert _rel(f.s_sum[0] / f.rows, want["S"]) < 1e-6
        assert abs(ours.block_damping(name) - want["damping"]) <= 1e-6 * want["damping"]
    pairwise = ours.pairwise_scores(_batches(query, 64), _batches(train, 64))
    assert _rel(pairwise, theirs["pairwise"]) < 1e-6
    assert _rel(ours.self_scores(_batches(train, 64)), theirs["self"]) < 1e-6


def test_bases_seeded_from_exact_factors_give_the_full_fit() -> None:
    """The seeding path: bases from given ``(A, G)`` (``G`` at any scale, as a training
    run's mean loss gives it) equal the full fit when the factors are the covariances."""
    model, train, query = _digits()
    full = _fit(model, train, train.tensors[1], 50, None)
    exact = {name: (f.a_sum[0] / f.rows, 37.0 * f.s_sum[0] / f.rows)  # type: ignore[index]
             for name, f in full._factors.items()}
    seeded = EKFACInfluence(model, fisher="empirical", damping=None, dtype=F64)
    passes = []

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        passes.append(1)
        return _batches(train, 50)

    seeded.fit(batches, factors=exact)
    assert len(passes) == 1  # the Λ pass alone
    want = full.pairwise_scores(_batches(query, 20), _batches(train, 50))
    assert _rel(seeded.pairwise_scores(_batches(query, 20), _batches(train, 50)), want) < 1e-10


def test_seeding_from_a_training_run_and_its_refusals() -> None:
    """Seeded from the running factors of a KFACPreconditioner that trained the model: an
    approximation of the full fit (rankings correlated, not equal); factors of other
    shapes (another model's; KFACMuon's, without a bias column) are refused."""
    import kaisa
    from kaisa.influence import running_factors

    model, train, query = _digits()
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for x, y in _batches(train, 20):
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            sgd.step()
    full = EKFACInfluence(model, seed=1, dtype=F64)
    full.fit(lambda: iter(_batches(train, 50)))
    seeded = EKFACInfluence(model, seed=1, dtype=F64)
    seeded.fit(lambda: iter(_batches(train, 50)), factors=running_factors(pre))
    a = full.pairwise_scores(_batches(query, 20), _batches(train, 50))
    b = seeded.pairwise_scores(_batches(query, 20), _batches(train, 50))
    ranks = [float(torch.corrcoef(torch.stack([x.argsort().argsort().double(),
                                               y.argsort().argsort().double()]))[0, 1])
             for x, y in zip(a, b, strict=True)]
    # measured: Spearman per query 0.56 to 0.89, mean 0.774 (the running factors start
    # from the identity and weigh the last steps: an approximation, docs/influence.md)
    assert min(ranks) > 0.45 and sum(ranks) / len(ranks) > 0.7, ranks
    muon = kaisa.KFACMuon(model, curvature="eigen")
    with pytest.raises(ValueError, match=r"not 65x65 and 32x32 .*without a bias column"):
        EKFACInfluence(model).fit(lambda: iter(_batches(train, 50)),
                                  factors={"0": (torch.eye(64), torch.eye(32)),
                                           **running_factors(muon)})


def test_per_block_scores_sum_to_the_totals() -> None:
    model, train, query = _digits()
    influence = _fit(model, train, train.tensors[1], 50, 1e-3)
    parts = influence.block_pairwise_scores(_batches(query, 20), _batches(train, 50))
    assert set(parts) == {"0", "2"} and all(p.shape == (20, 200) for p in parts.values())
    total = influence.pairwise_scores(_batches(query, 20), _batches(train, 50))
    assert _rel(parts["0"] + parts["2"], total) < 1e-14
    selves = influence.block_self_scores(_batches(train, 50))
    assert _rel(selves["0"] + selves["2"], influence.self_scores(_batches(train, 50))) < 1e-14


def test_what_models_do_to_their_layers_is_handled_or_refused() -> None:
    """An output changed in place (``ReLU(inplace=True)``) is read where the layer made it;
    an input that is not one row per example is refused in one line; a convolution with
    string padding is not scored (first-order); each module's own mode comes back after a
    fit (a frozen BatchNorm stays in eval mode); padding targets draw no Fisher label."""
    _, train, query = _digits()

    def mlp(inplace: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.ReLU(inplace=inplace),
                             nn.Linear(16, 10)).double()

    scores = []
    for inplace in (False, True):
        influence = EKFACInfluence(mlp(inplace), fisher="empirical", dtype=F64)
        influence.fit(lambda: iter(_batches(train, 50)))
        scores.append(influence.self_scores(_batches(train, 50)))
    assert torch.equal(scores[0], scores[1])

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x.reshape(-1, 8)).reshape(x.shape[0], 8, 10).sum(1)

    flat = EKFACInfluence(Flat().double(), fisher="empirical", dtype=F64)
    with pytest.raises(ValueError, match=r"layer 'a' is called on 400 rows, the batch has 50"):
        flat.fit(lambda: iter(_batches(train, 50)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 2, 3, padding="same"),
                        nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(128, 10)).double()
    net[2].eval()  # frozen statistics
    influence = EKFACInfluence(net, fisher="empirical", dtype=F64)
    assert influence.coverage()["1.weight"] == "conv2d"  # the core's statistics
    assert influence.coverage()["2.weight"] == "scale_shift"
    influence.fit(lambda: iter(_batches(train, 50)))
    assert net.training and not net[2].training

    model = mlp(False)
    drawn = EKFACInfluence(model, seed=0)._draw(
        model(query.tensors[0]), torch.tensor([-100] * 10 + list(range(10))))
    assert (drawn[:10] == -100).all() and bool(((drawn[10:] >= 0) & (drawn[10:] < 10)).all())


def test_a_kind_the_core_records_scores_as_the_anchors_kind() -> None:
    """A 3x3 convolution with ``padding='same'`` (its factors from the core's recorder,
    kfac-pytorch's scale) scores as the same convolution with ``padding=1`` (the anchor's
    rows): the bases and ``Λ`` do not depend on a factor's scale."""
    _, train, query = _digits()
    scores = []
    for padding in ("same", 1):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 3, 3, padding=padding),
                            nn.Tanh(), nn.Flatten(), nn.Linear(192, 10)).double()
        influence = EKFACInfluence(net, fisher="empirical", dtype=F64)
        influence.fit(lambda: iter(_batches(train, 50)))
        scores.append(influence.pairwise_scores(_batches(query, 10), _batches(train, 50)))
    assert _rel(scores[0], scores[1]) < 1e-10



def test_results_directory_fit_and_scores_and_progress(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """A fit and score sets saved to a directory and read back; a foreign score file
    refused in one line; progress bars on standard error."""
    from kaisa.influence import load_scores, save_scores

    model, train, query = _digits()
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64, progress=True)
    influence.fit(lambda: iter(_batches(train, 50)))
    scores = influence.pairwise_scores(_batches(query, 10), _batches(train, 50))
    assert "influence: covariances" in capsys.readouterr().err
    influence.save(tmp_path / "run")
    assert (tmp_path / "run" / "fit.pt").is_file()
    path = save_scores(tmp_path / "run", "pairwise", scores, {"damping": None})
    save_scores(tmp_path / "run", "blocks", {"0": scores, "2": scores})
    again = EKFACInfluence(model, dtype=F64)
    again.load(tmp_path / "run")
    assert torch.equal(again.pairwise_scores(_batches(query, 10), _batches(train, 50)), scores)
    assert torch.equal(load_scores(tmp_path / "run", "pairwise"), scores)  # type: ignore[arg-type]
    assert set(load_scores(tmp_path / "run", "blocks")) == {"0", "2"}  # type: ignore[arg-type]
    assert '"shape"' in path.with_suffix(".json").read_text()
    torch.save([1, 2], tmp_path / "run" / "junk.pt")
    with pytest.raises(ValueError, match="not an influence score set"):
        load_scores(tmp_path / "run", "junk")
    with pytest.raises(ValueError, match=r"missing\.pt: not an influence score set"):
        load_scores(tmp_path / "run", "missing")
    with pytest.raises(ValueError, match="score set name"):
        save_scores(tmp_path, "../escape", scores)
