"""Cost of one ``kaisa.KFAC`` step against AdamW and SGD, interleaved, with its split.

The digits autoencoder (64-256-128-64-16-64-128-256-64, tanh, MSE, batch 128),
single-threaded. Every configuration keeps its own model and optimiser; each round runs
``--steps`` steps of every configuration in turn (rotating the order), so a slow patch of
the machine hits all of them alike. Reported: the median over rounds of the mean step
time, its ratio to AdamW's median from the same run, and for K-FAC configurations the
milliseconds per step of each phase (``KFAC.timings`` and its preconditioner's; the
hooks' factor time falls inside ``loss_and_grad``).

    python bench/step_cost/kfac_step_cost.py                 # about a minute
    python bench/step_cost/kfac_step_cost.py --rounds 10     # smoke test
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kaisa
from kaisa.train.data import load_digits
from kaisa.train.models.mlp import autoencoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

RESULTS = harness.RESULTS

TUNED: dict[str, Any] = dict(  # kaisa-train's tuned autoencoder settings
    loss="mse", damping=1e-4, factor_update_steps=1, inv_update_steps=1, factor_decay=0.8,
    compute_method="pi_inverse",
)
#: name -> kaisa.KFAC arguments (None: a torch optimiser).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "adamw": None,
    "sgd": None,
    "kfac": TUNED,
    "kfac inverses every 2 steps": TUNED | {"inv_update_steps": 2},
    "kfac eigen, inverses every 3 (previous default)": TUNED
    | {"damping": 1e-3, "inv_update_steps": 3, "compute_method": "eigen"},
    "kfac fixed lr, empirical (= KFACPreconditioner + SGD)": TUNED
    | {"curvature": "empirical", "lr": 0.1, "momentum": 0.9, "compute_method": "eigen",
       "inv_update_steps": 10},
}


def make_step(name: str, args: dict[str, Any] | None) -> tuple[Callable[[torch.Tensor], None],
                                                                kaisa.KFAC | None]:
    """A function doing one step of configuration ``name`` on a batch."""
    torch.manual_seed(0)
    model = autoencoder()
    if args is None:
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=3e-3) if name == "adamw"
            else torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        )

        def plain(x: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), x).backward()
            opt.step()

        return plain, None
    kfac = kaisa.KFAC(model, **args)

    def step(x: torch.Tensor) -> None:
        kfac.step(lambda: (model(x), x))

    return step, kfac


def main() -> int:
    parser = harness.parser(__doc__, RESULTS / "kfac_step_cost.json")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=6, help="steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_digits().train_x.flatten(1)
    generator = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:
        return data[torch.randint(0, len(data), (128,), generator=generator)]

    steps = {name: make_step(name, cfg) for name, cfg in CONFIGS.items()}
    for step, _ in steps.values():
        for _ in range(args.warmup):
            step(batch())
    for _, kfac in steps.values():
        if kfac is not None:
            kfac.timings.update(dict.fromkeys(kfac.timings, 0.0))
            kfac.curvature.reset_timings()
    batches: list[torch.Tensor] = []

    def new_round(_: int) -> None:
        batches[:] = [batch() for _ in range(args.steps)]

    def run(step: Any) -> None:
        for x in batches:
            step(x)

    fns = {name: functools.partial(run, step) for name, (step, _) in steps.items()}
    times = harness.interleaved(fns, args.rounds, before_round=new_round)
    times = {name: [t / args.steps for t in ts] for name, ts in times.items()}
    total_steps = args.rounds * args.steps
    adamw = statistics.median(times["adamw"])
    results: dict[str, Any] = {
        "protocol": {"rounds": args.rounds, "steps_per_round": args.steps,
                     "warmup": args.warmup, "batch_size": 128},
        "configs": {},
    }
    for name, (_, kfac) in steps.items():
        median = statistics.median(times[name])
        entry: dict[str, Any] = {
            "ms_per_step_median": 1e3 * median,
            "ratio_to_adamw": median / adamw,
            "arguments": CONFIGS[name],
        }
        if kfac is not None:
            split = {k: 1e3 * v / total_steps for k, v in kfac.timings.items()}
            split |= {f"preconditioner.{k}": 1e3 * v / total_steps
                      for k, v in kfac.curvature.timings.items()}
            entry["split_ms_per_step"] = split
        results["configs"][name] = entry
        print(f"{name:55s} {1e3 * median:7.2f} ms  x{median / adamw:5.2f} AdamW", flush=True)
    harness.write(args.out, "kfac_step_cost", results, script="bench/step_cost/kfac_step_cost.py")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
