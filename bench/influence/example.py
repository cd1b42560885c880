"""Which training images made the classifier's answer, and which labels are wrong.

    python bench/influence/example.py [--flip 0.1] [--out bench/results/influence_example.json]

A 64-128-10 MLP learns 1000 of scikit-learn's digits, a tenth of whose labels were
flipped to another class on purpose (seeded); ``kaisa.influence.EKFACInfluence`` (true
Fisher, heuristic damping) is fitted on that training set. The picture
(``influence_example.png`` beside the JSON) shows, for four held-out test images, the five
most helpful and the five most harmful training images (positive and negative scores:
upweighting them lowers or raises the test image's loss) with their labels, a flipped
label marked; and the flipped examples' share among the 10% of training images of highest
self-influence, against the same share by training loss alone. The JSON holds the numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


def _data(train: int, flip: float, seed: int) -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    flipped = torch.randperm(train, generator=g)[: int(flip * train)]
    noisy = y[:train].clone()
    noisy[flipped] = (noisy[flipped] + torch.randint(1, 10, (len(flipped),), generator=g)) % 10
    return {"x": x[:train], "y": noisy, "clean": y[:train], "flipped": flipped,
            "x_test": x[train:], "y_test": y[train:]}


def _train(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 100) -> list[tuple[torch.Tensor, ...]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _recall(scores: torch.Tensor, flipped: torch.Tensor) -> float:
    top = scores.topk(len(flipped)).indices  # the top 10% when a tenth is flipped
    return float(torch.isin(top, flipped).float().mean())


def _plot(path: Path, data: dict[str, torch.Tensor], scores: torch.Tensor,
          queries: list[int], recalls: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flipped = set(data["flipped"].tolist())
    figure, axes = plt.subplots(len(queries), 11, figsize=(12, 1.35 * len(queries) + 0.6))
    for row, q in enumerate(queries):
        order = scores[row].argsort(descending=True)
        picks = [("test", q)] + [("help", int(t)) for t in order[:5]] + [
            ("harm", int(t)) for t in order.flip(0)[:5]]
        for col, (kind, i) in enumerate(picks):
            ax = axes[row, col]
            image = data["x_test"][i] if kind == "test" else data["x"][i]
            ax.imshow(image.reshape(8, 8).numpy(), cmap="gray_r")
            ax.set_xticks([])
            ax.set_yticks([])
            if kind == "test":
                ax.set_title(f"test: {int(data['y_test'][i])}", fontsize=8)
            else:
                mark = " (flipped)" if i in flipped else ""
                ax.set_title(f"{kind} {int(data['y'][i])}{mark}", fontsize=7,
                             color="crimson" if i in flipped else "black")
    figure.suptitle("Five most helpful and five most harmful training images per test image; "
                    f"flipped labels found in the top 10% of self-influence: "
                    f"{recalls['self_influence']:.0%} (training loss: {recalls['loss']:.0%})",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, out=harness.RESULTS / "influence_example.json")
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--flip", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from kaisa.influence import EKFACInfluence

    data = _data(args.train, args.flip, args.seed)
    model = _train(data["x"], data["y"], args.epochs, args.seed)
    with torch.no_grad():
        accuracy = float((model(data["x_test"]).argmax(-1) == data["y_test"]).float().mean())
        losses = F.cross_entropy(model(data["x"]), data["y"], reduction="none")
    train = _batches(data["x"], data["y"])
    influence = EKFACInfluence(model, damping=None, seed=args.seed)
    influence.fit(lambda: iter(train))
    queries = [0, 1, 2, 3]
    scores = influence.pairwise_scores(
        [(data["x_test"][queries], data["y_test"][queries])], train)
    self_scores = influence.self_scores(train)
    recalls = {"self_influence": _recall(self_scores, data["flipped"]),
               "loss": _recall(losses, data["flipped"])}
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
               "test_accuracy": accuracy, "flipped": len(data["flipped"]),
               "recall_at_10_percent": recalls,
               "queries": {str(q): {"label": int(data["y_test"][q]),
                                    "most_helpful": scores[i].topk(5).indices.tolist(),
                                    "most_harmful": (-scores[i]).topk(5).indices.tolist()}
                           for i, q in enumerate(queries)}}
    doc = harness.write(args.out, "influence_example", payload, argv)
    if not args.no_plot:
        _plot(Path(args.out).with_suffix(".png"), data, scores, queries, recalls)
    print(f"test accuracy {accuracy:.3f}; flipped labels in the top {args.flip:.0%}: "
          f"self-influence {recalls['self_influence']:.0%}, training loss {recalls['loss']:.0%}")
    return doc


if __name__ == "__main__":
    main()
