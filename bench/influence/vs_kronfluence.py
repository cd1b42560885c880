"""EK-FAC influence, kaisa against Kronfluence 1.0.1: fit + pairwise scores, one run.

    python bench/influence/vs_kronfluence.py [--rounds 3] [--train 1000] [--queries 100]

On scikit-learn's digits, a small CNN (conv 1->16 3x3, ReLU, 2x2 max-pool, linear to 10
classes; initial weights, seed 0): each side fits its EK-FAC factors on ``--train``
images (true Fisher, labels drawn from the model; heuristic damping) and scores
``--queries`` held-out images against every training image, float32, batch 64, one
thread. The two sides run alternately, ``--rounds`` times (``bench.harness.interleaved``),
and the script reports each side's median seconds and kaisa's ratio of medians to
Kronfluence's. Kronfluence runs its own pipeline (``Analyzer``: it writes its factors and
scores to a temporary directory, as it always does); kaisa keeps them in memory. Needs
``pip install --no-deps kronfluence==1.0.1``. ``--tiny`` is a seconds-long smoke run.
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, out=harness.RESULTS / "influence_vs_kronfluence.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 64 x 8, 1 round")
    args = parser.parse_args(argv)
    if args.tiny:
        args.train, args.queries, args.rounds = 64, 8, 1
    torch.set_num_threads(1)
    from kaisa.influence import EKFACInfluence
    from tests.support.kronfluence import kronfluence_ekfac

    train, query = _data(args.train, args.queries)
    torch.manual_seed(0)
    model = CNN()
    train_batches, query_batches = _batches(train, args.batch), _batches(query, args.batch)
    shapes: dict[str, tuple[int, ...]] = {}

    def kaisa_side() -> None:
        influence = EKFACInfluence(model, damping=None, seed=0)
        influence.fit(lambda: iter(train_batches))
        shapes["kaisa"] = tuple(influence.pairwise_scores(query_batches, train_batches).shape)

    def kronfluence_side() -> None:
        with tempfile.TemporaryDirectory() as workdir:
            out = kronfluence_ekfac(model, train, query, damping=None, batch_size=args.batch,
                                    workdir=workdir, empirical=False, dtype=torch.float32,
                                    self_scores=False)
        shapes["kronfluence"] = tuple(out["pairwise"].shape)

    times = harness.interleaved({"kronfluence": kronfluence_side, "kaisa": kaisa_side},
                                rounds=args.rounds)
    result = harness.summary(times, baseline="kronfluence", scale=1.0)
    assert shapes["kaisa"] == shapes["kronfluence"] == (args.queries, args.train), shapes
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
               "model": CNN.__doc__, "seconds": result,
               "kaisa_over_kronfluence": result["kaisa"]["ratio_to_baseline"]}
    doc = harness.write(args.out, "influence_vs_kronfluence", payload, argv)
    print(f"fit + {args.queries} x {args.train} pairwise scores, median of {args.rounds}: "
          f"kronfluence {result['kronfluence']['median']:.2f} s, kaisa "
          f"{result['kaisa']['median']:.2f} s ({result['kaisa']['ratio_to_baseline']:.3f}x)")
    return doc


if __name__ == "__main__":
    main()
