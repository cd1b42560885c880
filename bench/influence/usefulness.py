"""Whether kaisa's EK-FAC influence scores are useful: LDS and mislabelled digits.

``kaisa.influence.EKFACInfluence`` equals Kronfluence 1.0.1's EK-FAC to ~1e-15
(``tests/influence/test_ekfac_influence.py``); this measures what the scores are worth, on
scikit-learn's 8x8 digits (1797 images, pixels / 16), against

* ``identity``: no curvature, the plain per-example gradient dot products
  ``<g_q, g_t>`` (self-influence ``|g_t|^2``), from ``torch.func`` per-example gradients
  in float64 over every parameter (the parameters EK-FAC covers: both layers' weights and
  biases);
* ``kronfluence_ekfac``: Kronfluence 1.0.1's EK-FAC on the same trained model, in float64
  (``tests/support/kronfluence.py``'s ``kronfluence_ekfac``, heuristic damping
  ``0.1 mean(Λ)``, ``empirical=False`` and no ``fixed_labels``). **Fisher labels: true-Fisher
  sampling for both.** kaisa's ``fisher='true'`` draws its labels from the model with its
  own generator (``seed``), independently in the factor pass and the ``Λ`` pass;
  Kronfluence draws its own from the global torch generator (seeded before the call), also
  once per pass. The two therefore differ by their label draws (and float32 against
  float64), not by their formulas. ``agreement`` records how close their scores are,
  beside kaisa against itself with the next seed's draws (what different draws alone
  make) and in float64 with the same draws (what float32 alone makes);
* ``loss`` (the second measurement only): each training example's loss under the trained
  model.

kaisa's scores: ``EKFACInfluence(model, damping=None, fisher='true', seed=seed)``
(float32), fitted on the training set in order, in batches of ``--influence-batch``.

Model and recipe: a 64-``hidden``-10 MLP (ReLU by default), initialised once with the seed,
trained with SGD (momentum 0.9, weight decay ``--weight-decay``, constant ``--lr``),
batches of ``--batch`` in an order drawn by a generator seeded ``seed + 1`` every epoch, for
``--epochs`` epochs over whatever set it trains on. Split: a seeded permutation of the 1797
images; the first ``--train`` (N) are the training set, the next ``--queries`` the queries,
the rest the test set the accuracies are measured on.

1. **Linear datamodeling score** (Park et al. 2023, TRAK; as Kronfluence's docs describe
   it). ``--subsets`` (M) random halves ``S`` of the training set (seeded); the model is
   retrained on each from the same initialisation with the same recipe, and each query's
   loss recorded. The group prediction for query ``q`` on ``S`` is the sum of its scores
   over ``S``. Sign: a positive score (kaisa's, Kronfluence's and the identity's alike) is
   a training example whose upweighting *lowers* the query's loss, so training on ``S``
   predicts the loss ``const - sum_{t in S} score[q, t]``: the predicted loss is **minus**
   the sum (the constant, the full-set loss plus the removed examples' scores, is the same
   for every subset of a query and drops out of a rank correlation). LDS = the mean over
   queries of the Spearman correlation, across the M subsets, between predicted and
   retrained losses; its standard error = the queries' standard deviation / sqrt(queries).
2. **Mislabelled examples**: ``--flip`` (10%) of the N training labels moved to another
   class (uniform over the other nine, seeded); the model trained on the corrupted set from
   the same initialisation with the same recipe; every training example scored by its
   self-influence (kaisa, identity, Kronfluence; with its corrupted label) or its loss; the
   share of the flipped examples among the top ``--flip`` fraction by score (recall at
   10%: with 10% flipped, precision too) and the ROC AUC of the score as a detector.

Wall times are single-threaded CPU seconds (``--threads``): for the LDS the fit and the
pairwise scores, for the mislabelled examples the fit and the self scores. Kronfluence's
run in float64 and include its files; in the second measurement also its pairwise scores
of 10 queries (its runner computes them always).

    python bench/influence/usefulness.py     # bench/results/influence_usefulness.json
    python bench/influence/usefulness.py --quick --out /tmp/u.json   # seconds
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness
from kaisa.influence import EKFACInfluence

Batch = tuple[torch.Tensor, torch.Tensor]
METHODS = ("kaisa_ekfac", "identity", "kronfluence_ekfac")
#: ``--quick``'s sizes (seconds; no claims).
QUICK = {"train": 200, "queries": 20, "subsets": 8, "epochs": 3, "mislabel_epochs": 3,
         "mislabel_hidden": 32, "mislabel_seeds": 1}


# ---------------------------------------------------------------- data, model, training
def digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1797 digits (float32, pixels / 16), their labels and a seeded permutation."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x, y, torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))


def make_model(hidden: int, activation: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
    return nn.Sequential(nn.Linear(64, hidden), act(), nn.Linear(hidden, 10))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, args: Any) -> nn.Module:
    """The recipe, in place: SGD, ``args.epochs`` epochs of seeded batch orders."""
    order = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.weight_decay)
    model.train()
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=order)
        for i in range(0, len(x), args.batch):
            b = perm[i:i + args.batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
    model.eval()
    return model


def losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none")


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[Batch]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


# ---------------------------------------------------------------- the three scorers
def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(n, parameters)``: each example's gradient of its loss, float64."""
    params = {k: v.detach().double() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    return torch.cat([t.reshape(len(x), -1) for t in g.values()], dim=1)


def identity_scores(model: nn.Module, train_xy: Batch, query_xy: Batch | None) -> dict[str, Any]:
    start = time.perf_counter()
    gt = gradients(model, *train_xy)
    out: dict[str, Any] = {"self": gt.square().sum(1)}
    if query_xy is not None:
        out["pairwise"] = gradients(model, *query_xy) @ gt.T
    out["wall_s"] = time.perf_counter() - start
    return out


def kaisa_scores(model: nn.Module, train_xy: Batch, query_xy: Batch | None, args: Any,
                 seed: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """kaisa's pairwise scores (given queries) or self scores, true Fisher drawn with
    ``seed`` (default ``args.seed``)."""
    train_b = batches(*train_xy, args.influence_batch)
    start = time.perf_counter()
    influence = EKFACInfluence(model, damping=None, fisher="true",
                               seed=args.seed if seed is None else seed, dtype=dtype)
    influence.fit(lambda: iter(train_b))
    fitted = time.perf_counter()
    out: dict[str, Any] = {"fit_s": fitted - start}
    if query_xy is not None:
        out["pairwise"] = influence.pairwise_scores(
            batches(*query_xy, args.influence_batch), train_b).double()
        out["pairwise_s"] = time.perf_counter() - fitted
    else:
        scored = time.perf_counter()
        out["self"] = influence.self_scores(train_b).double()
        out["self_s"] = time.perf_counter() - scored
    out["wall_s"] = time.perf_counter() - start
    return out


def kronfluence_scores(model: nn.Module, train_xy: Batch, query_xy: Batch, args: Any,
                       self_scores: bool) -> dict[str, Any]:
    """Kronfluence 1.0.1's pairwise (and self) scores, true-Fisher sampling, or why not."""
    try:
        from tests.support.kronfluence import kronfluence_ekfac
    except ImportError as error:
        return {"skipped": f"kronfluence 1.0.1 is not installed ({error})"}
    torch.manual_seed(args.seed)  # its true-Fisher draws use the global generator
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        got = kronfluence_ekfac(model, TensorDataset(*train_xy), TensorDataset(*query_xy),
                                damping=None, batch_size=args.influence_batch,
                                workdir=workdir, empirical=False, fixed_labels=None,
                                self_scores=self_scores)
    out = {"pairwise": got["pairwise"].double(), "wall_s": time.perf_counter() - start}
    if self_scores:
        out["self"] = got["self"].double()
    return out


def same_draws(model: nn.Module, train_xy: Batch, query_xy: Batch, args: Any
               ) -> dict[str, Any]:
    """Self scores of kaisa and Kronfluence with the same Fisher labels, in float64.

    One draw of labels from the model (seeded ``args.seed + 7``) serves both passes of
    both: kaisa's empirical Fisher on the relabelled batches, Kronfluence's
    ``fixed_labels``. Their scores are then equal (the anchor), so are their recalls.
    """
    try:
        from tests.support.kronfluence import kronfluence_ekfac
    except ImportError as error:
        return {"kronfluence_same_draws": {"skipped": f"kronfluence 1.0.1 is not installed "
                                                      f"({error})"}}
    xt, yt = train_xy
    with torch.no_grad():
        probs = F.softmax(model(xt).double(), dim=-1)
    labels = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(
        args.seed + 7))[:, 0]
    model64 = copy.deepcopy(model).double()
    influence = EKFACInfluence(model64, damping=None, fisher="empirical", dtype=torch.float64)
    influence.fit(lambda: iter(batches(xt.double(), labels, args.influence_batch)))
    ours = influence.self_scores(batches(xt.double(), yt, args.influence_batch))
    with tempfile.TemporaryDirectory() as workdir:
        theirs = kronfluence_ekfac(model, TensorDataset(*train_xy), TensorDataset(*query_xy),
                                   damping=None, batch_size=args.influence_batch,
                                   workdir=workdir, empirical=False, fixed_labels=labels,
                                   self_scores=True)["self"].double()
    return {"kaisa_same_draws": {"self": ours, "wall_s": 0.0},
            "kronfluence_same_draws": {"self": theirs, "wall_s": 0.0}}


# ---------------------------------------------------------------- the measures
def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a.numpy(), b.numpy()).statistic)


def lds(scores: torch.Tensor, masks: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    """``scores`` (Q, N), ``masks`` (M, N) of the subsets, ``actual`` (M, Q) losses."""
    predicted = -(masks.double() @ scores.T)  # (M, Q): upweighting a positive lowers the loss
    per_query = [spearman(predicted[:, q], actual[:, q]) for q in range(scores.shape[0])]
    n = len(per_query)
    return {"lds": statistics.fmean(per_query),
            "se": statistics.stdev(per_query) / n ** 0.5 if n > 1 else float("nan"),
            "median": statistics.median(per_query),
            "positive_fraction": sum(r > 0 for r in per_query) / n}


def detection(scores: torch.Tensor, flipped: torch.Tensor, fraction: float) -> dict[str, Any]:
    """Recall of the flipped examples among the top ``fraction`` by score, and ROC AUC."""
    from sklearn.metrics import roc_auc_score

    k = round(fraction * len(scores))
    top = torch.zeros(len(scores), dtype=torch.bool)
    top[torch.topk(scores, k).indices] = True
    return {"recall_at_top": float((top & flipped).sum()) / float(flipped.sum()),
            "top_k": k, "auc": float(roc_auc_score(flipped.numpy(), scores.numpy()))}


def closeness(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Relative difference and correlations of two score tensors (flattened)."""
    a, b = ours.flatten().double(), theirs.flatten().double()
    return {"relative_difference": float((a - b).norm() / b.norm()),
            "pearson": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
            "spearman": spearman(a, b)}


def agreement(model: nn.Module, train_xy: Batch, query_xy: Batch | None,
              scored: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    """kaisa against Kronfluence, beside the scale of what separates them: kaisa against
    itself with the next seed's true-Fisher draws (the draws differ, as they do from
    Kronfluence's) and in float64 with the same draws (the dtype alone)."""
    key = "self" if query_xy is None else "pairwise"
    ours = scored["kaisa_ekfac"][key]
    out: dict[str, Any] = {"scores": key}
    if key in scored["kronfluence_ekfac"]:
        out["kaisa_vs_kronfluence"] = closeness(ours, scored["kronfluence_ekfac"][key])
    other = kaisa_scores(model, train_xy, query_xy, args, seed=args.seed + 1)
    out["kaisa_vs_kaisa_next_seed"] = closeness(ours, other[key])
    f64 = kaisa_scores(model, train_xy, query_xy, args, dtype=torch.float64)
    out["kaisa_float32_vs_float64"] = closeness(ours, f64[key])
    return out


# ---------------------------------------------------------------- the two experiments
def measure_lds(x: torch.Tensor, y: torch.Tensor, split: dict[str, torch.Tensor],
                init: dict[str, torch.Tensor], args: Any) -> dict[str, Any]:
    xt, yt = x[split["train"]], y[split["train"]]
    xq, yq = x[split["query"]], y[split["query"]]
    model = make_model(args.hidden, args.activation, args.seed)
    model.load_state_dict(init)
    start = time.perf_counter()
    train(model, xt, yt, args)
    trained = {"train_s": time.perf_counter() - start,
               "train_loss": float(losses(model, xt, yt).mean()),
               "train_accuracy": accuracy(model, xt, yt),
               "query_loss": float(losses(model, xq, yq).mean()),
               "test_accuracy": accuracy(model, x[split["test"]], y[split["test"]])}
    print(f"LDS model: test accuracy {trained['test_accuracy']:.4f}, train loss "
          f"{trained['train_loss']:.4f} ({trained['train_s']:.2f} s)", flush=True)

    scored = {"kaisa_ekfac": kaisa_scores(model, (xt, yt), (xq, yq), args),
              "identity": identity_scores(model, (xt, yt), (xq, yq)),
              "kronfluence_ekfac": kronfluence_scores(model, (xt, yt), (xq, yq), args, False)}

    n, half = len(xt), len(xt) // 2
    draw = torch.Generator().manual_seed(args.seed + 2)
    masks = torch.zeros(args.subsets, n, dtype=torch.bool)
    actual = torch.empty(args.subsets, len(xq), dtype=torch.float64)
    start = time.perf_counter()
    for m in range(args.subsets):
        masks[m, torch.randperm(n, generator=draw)[:half]] = True
        sub = make_model(args.hidden, args.activation, args.seed)
        sub.load_state_dict(init)
        train(sub, xt[masks[m]], yt[masks[m]], args)
        actual[m] = losses(sub, xq, yq).double()
    retrain_s = time.perf_counter() - start
    print(f"retrained {args.subsets} models on halves in {retrain_s:.1f} s", flush=True)

    methods: dict[str, Any] = {}
    for name, got in scored.items():
        if "skipped" in got:
            methods[name] = {"skipped": got["skipped"]}
            continue
        methods[name] = {**lds(got["pairwise"], masks, actual),
                         **{k: v for k, v in got.items() if k.endswith("_s")}}
    result: dict[str, Any] = {
        "model": trained, "methods": methods, "retrain_s": retrain_s,
        "retrain_s_per_model": retrain_s / args.subsets,
        "subset_size": half,
        "retrained_query_loss": {"mean": float(actual.mean()),
                                 "std_across_subsets_mean": float(actual.std(0).mean())}}
    result["agreement"] = agreement(model, (xt, yt), (xq, yq), scored, args)
    return result


def measure_mislabel(x: torch.Tensor, y: torch.Tensor, split: dict[str, torch.Tensor],
                     init: dict[str, torch.Tensor], args: Any) -> dict[str, Any]:
    xt, yt = x[split["train"]], y[split["train"]].clone()
    n = len(xt)
    draw = torch.Generator().manual_seed(args.seed + 3)
    which = torch.randperm(n, generator=draw)[:round(args.flip * n)]
    yt[which] = (yt[which] + torch.randint(1, 10, (len(which),), generator=draw)) % 10
    flipped = torch.zeros(n, dtype=torch.bool)
    flipped[which] = True
    assert bool((yt[flipped] != y[split["train"]][flipped]).all())

    model = make_model(args.hidden, args.activation, args.seed)
    model.load_state_dict(init)
    start = time.perf_counter()
    train(model, xt, yt, args)
    train_loss = losses(model, xt, yt).double()
    trained = {"train_s": time.perf_counter() - start,
               "train_loss": float(train_loss.mean()),
               "train_accuracy_on_corrupted_labels": accuracy(model, xt, yt),
               "flipped_fitted": accuracy(model, xt[flipped], yt[flipped]),
               "test_accuracy": accuracy(model, x[split["test"]], y[split["test"]])}
    print(f"corrupted model: test accuracy {trained['test_accuracy']:.4f}, flipped labels "
          f"fitted {trained['flipped_fitted']:.2f}", flush=True)

    xq, yq = x[split["query"]][:10], y[split["query"]][:10]  # Kronfluence's helper wants some
    scored = {"kaisa_ekfac": kaisa_scores(model, (xt, yt), None, args),
              "identity": identity_scores(model, (xt, yt), None),
              "kronfluence_ekfac": kronfluence_scores(model, (xt, yt), (xq, yq), args, True),
              "loss": {"self": train_loss, "wall_s": 0.0}}
    scored.update(same_draws(model, (xt, yt), (xq, yq), args))
    methods: dict[str, Any] = {}
    for name, got in scored.items():
        if "skipped" in got:
            methods[name] = {"skipped": got["skipped"]}
            continue
        methods[name] = {**detection(got["self"], flipped, args.flip),
                         **{k: v for k, v in got.items() if k.endswith("_s")}}
    result: dict[str, Any] = {"model": trained, "flipped": int(flipped.sum()),
                              "methods": methods}
    result["agreement"] = agreement(model, (xt, yt), None, scored, args)
    return result


# ---------------------------------------------------------------- output
def table(results: dict[str, Any]) -> str:
    """The markdown table: LDS (± standard error) and recall at the top fraction."""
    frac = round(100 * results["settings"]["flip"])
    lines = [f"| method | LDS ± s.e. | recall at {frac}% | AUC | wall s (LDS / mislabel) |",
             "|---|---|---|---|---|"]
    lds_m, mis_m = results["lds"]["methods"], results["mislabel"]["methods"]
    for name in (*METHODS, "loss", "kaisa_same_draws", "kronfluence_same_draws"):
        a, b = lds_m.get(name, {}), mis_m.get(name, {})
        cell = f"{a['lds']:.3f} ± {a['se']:.3f}" if "lds" in a else "-"
        rec = f"{b['recall_at_top']:.2f}" if "recall_at_top" in b else "-"
        auc = f"{b['auc']:.3f}" if "auc" in b else "-"
        wall = " / ".join(f"{d['wall_s']:.2f}" if "wall_s" in d else "-" for d in (a, b))
        lines.append(f"| {name} | {cell} | {rec} | {auc} | {wall} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__, harness.RESULTS / "influence_usefulness.json")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny sizes, seconds ({', '.join(f'{k} {v}' for k, v in QUICK.items())})")
    p.add_argument("--train", type=int, default=1000, help="N training examples")
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--subsets", type=int, default=100, help="M retrained halves")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--activation", choices=("relu", "tanh"), default="relu")
    p.add_argument("--influence-batch", type=int, default=100)
    p.add_argument("--flip", type=float, default=0.1, help="fraction of labels flipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mislabel-hidden", type=int, default=512)
    p.add_argument("--mislabel-lr", type=float, default=0.05)
    p.add_argument("--mislabel-epochs", type=int, default=100)
    p.add_argument("--mislabel-weight-decay", type=float, default=0.0)
    p.add_argument("--mislabel-seeds", type=int, default=5)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)  # a test calling main() gets its threads back


def mislabel_seeds(args: Any) -> dict[str, Any]:
    """The mislabelled-examples measure under its own recipe (a model that fits the flipped
    labels), for ``--mislabel-seeds`` seeds (split, initialisation and flips each);
    per method the mean recall and AUC, and per seed the counts."""
    margs = copy.copy(args)
    margs.hidden, margs.lr = args.mislabel_hidden, args.mislabel_lr
    margs.epochs, margs.weight_decay = args.mislabel_epochs, args.mislabel_weight_decay
    runs = []
    for seed in range(args.mislabel_seeds):
        margs.seed = seed
        x, y, perm = digits(seed)
        split = {"train": perm[:args.train],
                 "query": perm[args.train:args.train + args.queries],
                 "test": perm[args.train + args.queries:]}
        init = make_model(margs.hidden, margs.activation, seed).state_dict()
        runs.append(measure_mislabel(x, y, split, init, margs))
    methods: dict[str, Any] = {}
    for name in runs[0]["methods"]:
        got = [r["methods"][name] for r in runs]
        if any("skipped" in g for g in got):
            methods[name] = {"skipped": next(g["skipped"] for g in got if "skipped" in g)}
            continue
        methods[name] = {"recall_at_top": statistics.mean(g["recall_at_top"] for g in got),
                         "auc": statistics.mean(g["auc"] for g in got),
                         "per_seed_recall": [g["recall_at_top"] for g in got],
                         "wall_s": statistics.mean(g.get("wall_s", 0.0) for g in got)}
    return {"recipe": {"hidden": margs.hidden, "lr": margs.lr, "epochs": margs.epochs,
                       "weight_decay": margs.weight_decay, "seeds": args.mislabel_seeds},
            "methods": methods, "runs": runs}


def _run(args: Any, argv: Sequence[str] | None) -> dict[str, Any]:
    start = time.perf_counter()

    x, y, perm = digits(args.seed)
    if args.train + args.queries >= len(x):
        raise SystemExit(f"--train {args.train} + --queries {args.queries} leave no test set")
    split = {"train": perm[:args.train], "query": perm[args.train:args.train + args.queries],
             "test": perm[args.train + args.queries:]}
    init = {k: v.clone() for k, v in
            make_model(args.hidden, args.activation, args.seed).state_dict().items()}
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(
        model=f"64-{args.hidden}-10 MLP, {args.activation}", parameters=sum(
            t.numel() for t in init.values()),
        test_examples=len(split["test"]), optimizer="SGD, momentum 0.9",
        fisher_labels="true-Fisher sampling for both (kaisa fisher='true' with seed; "
                      "Kronfluence's own draws, global generator seeded)",
        damping="heuristic 0.1 mean(lambda) per layer, both",
        lds_sign="predicted loss = -sum of scores over the subset",
        kaisa_dtype="float32", kronfluence_dtype="float64", identity_dtype="float64")
    results: dict[str, Any] = {"quick": args.quick, "settings": settings}
    results["lds"] = measure_lds(x, y, split, init, args)
    results["mislabel"] = mislabel_seeds(args)
    results["wall_s"] = time.perf_counter() - start
    results["table"] = table(results)
    print(results["table"])
    print(f"total {results['wall_s']:.1f} s")
    harness.write(args.out, "influence_usefulness", results, argv=argv,
                  script="bench/influence/usefulness.py")
    return results


if __name__ == "__main__":
    main()
