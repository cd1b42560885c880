"""EK-FAC influence, kaisa against Kronfluence 1.0.1: fit + pairwise scores, one run.

    python bench/influence/vs_kronfluence.py [--rounds 3] [--train 1000] [--queries 100]
    python bench/influence/vs_kronfluence.py --model gpt [--train 1000] [--queries 100]

``--model cnn`` (the default): on scikit-learn's digits, a small CNN (conv 1->16 3x3,
ReLU, 2x2 max-pool, linear to 10 classes; initial weights, seed 0): each side fits its
EK-FAC factors on ``--train`` images (true Fisher, labels drawn from the model; heuristic
damping) and scores ``--queries`` held-out images against every training image, float32,
batch 64, one thread. The two sides run alternately, ``--rounds`` times
(``bench.harness.interleaved``), and the script reports each side's median seconds and
kaisa's ratio of medians to Kronfluence's. Kronfluence runs its own pipeline
(``Analyzer``: it writes its factors and scores to a temporary directory, as it always
does); kaisa keeps them in memory. Needs
``pip install --no-deps kronfluence==1.0.1``. ``--tiny`` is a seconds-long smoke run.

``--model gpt``: the byte GPT of ``kaisa-train`` (d 128, 4 layers, 4 heads, a tied
embedding and head; initial weights, seed 0) on windows of ``--context`` bytes of the
shipped corpus (training windows from its first 90%, queries from the rest), each
window's summed next-byte loss. kaisa scores every block kind (attention, the tied
embedding and head, LayerNorms, the MLPs); Kronfluence tracks the ``nn.Linear`` modules
whose forward runs (each layer's two MLP layers and the head), which is all it can: the
attention's products are functional calls inside ``nn.MultiheadAttention``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


class CNN(nn.Module):
    """conv 1->16 3x3 (padding 1), ReLU, 2x2 max-pool, linear 256 -> 10, on 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(torch.relu(self.conv(x.reshape(-1, 1, 8, 8))), 2)
        return self.fc(h.flatten(1))  # type: ignore[no-any-return]


def _data(train: int, queries: int) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return (TensorDataset(x[:train], y[:train]),
            TensorDataset(x[train:train + queries], y[train:train + queries]))


def _batches(data: TensorDataset, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.tensors
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _text(train: int, queries: int, context: int) -> tuple[TensorDataset, TensorDataset]:
    from kaisa.train.text import fixed_windows, load_corpus, split

    fit, held = split(load_corpus())
    rows = fixed_windows(fit, train, context), fixed_windows(held, queries, context)
    return tuple(TensorDataset(w[:, :-1], w[:, 1:]) for w in rows)  # type: ignore[return-value]


def _covered(model: nn.Module, names: set[int]) -> float:
    """The share of the model's parameter elements in ``names`` (ids)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if id(p) in names) / sum(p.numel() for p in params)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default bench/results/influence_vs_kronfluence"
                             "[_gpt].json)")
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--batch", type=int, default=None, help="cnn 64, gpt 32")
    parser.add_argument("--context", type=int, default=64, help="gpt: bytes per window")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 64 x 8, 1 round")
    args = parser.parse_args(argv)
    gpt = args.model == "gpt"
    if args.batch is None:
        args.batch = 32 if gpt else 64
    if args.tiny:
        args.train, args.queries, args.rounds = (32, 4, 1) if gpt else (64, 8, 1)
    if args.out is None:
        args.out = harness.RESULTS / f"influence_vs_kronfluence{'_gpt' if gpt else ''}.json"
    torch.set_num_threads(1)
    from kaisa.influence import EKFACInfluence
    from tests.support.kronfluence import kronfluence_ekfac

    torch.manual_seed(0)
    tracked: list[str] | None = None
    if gpt:
        from kaisa.train.models.gpt import gpt as byte_gpt

        train, query = _text(args.train, args.queries, args.context)
        model: nn.Module = byte_gpt(context=args.context)
        layers = len(model.blocks)  # type: ignore[arg-type]
        tracked = [f"blocks.{i}.linear{j}" for i in range(layers) for j in (1, 2)] + ["head"]
    else:
        train, query = _data(args.train, args.queries)
        model = CNN()
    train_batches, query_batches = _batches(train, args.batch), _batches(query, args.batch)
    shapes: dict[str, tuple[int, ...]] = {}
    modules = dict(model.named_modules())
    coverage = {
        "kaisa": _covered(model, {id(p) for b in EKFACInfluence(model).blocks.values()
                                  for p in b.parameters()}),
        "kronfluence": _covered(model, {id(p) for n in (tracked or ["conv", "fc"])
                                        for p in modules[n].parameters()})}

    def kaisa_side() -> None:
        influence = EKFACInfluence(model, damping=None, seed=0)
        influence.fit(lambda: iter(train_batches))
        shapes["kaisa"] = tuple(influence.pairwise_scores(query_batches, train_batches).shape)

    def kronfluence_side() -> None:
        with tempfile.TemporaryDirectory() as workdir:
            out = kronfluence_ekfac(model, train, query, damping=None, batch_size=args.batch,
                                    workdir=workdir, empirical=False, dtype=torch.float32,
                                    self_scores=False, tracked=tracked)
        shapes["kronfluence"] = tuple(out["pairwise"].shape)

    times = harness.interleaved({"kronfluence": kronfluence_side, "kaisa": kaisa_side},
                                rounds=args.rounds)
    result = harness.summary(times, baseline="kronfluence", scale=1.0)
    assert shapes["kaisa"] == shapes["kronfluence"] == (args.queries, args.train), shapes
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
               "model": "the byte GPT (kaisa.train.models.gpt)" if gpt else CNN.__doc__,
               "seconds": result, "parameters_scored": coverage,
               "kaisa_over_kronfluence": result["kaisa"]["ratio_to_baseline"]}
    doc = harness.write(args.out, f"influence_vs_kronfluence{'_gpt' if gpt else ''}", payload,
                        argv)
    print(f"{args.model}: parameters scored {coverage}")
    print(f"fit + {args.queries} x {args.train} pairwise scores, median of {args.rounds}: "
          f"kronfluence {result['kronfluence']['median']:.2f} s, kaisa "
          f"{result['kaisa']['median']:.2f} s ({result['kaisa']['ratio_to_baseline']:.3f}x)")
    return doc


if __name__ == "__main__":
    main()
