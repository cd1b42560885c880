"""The planner's table and curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kaisa.plan.iteration import PHASES, StepCost
from kaisa.plan.search import fastest

__all__ = ["format_table", "plot_curves"]

_SHORT = {"forward_backward": "fwd+bwd", "grad_allreduce": "ddp", "factor_compute": "factor",
          "factor_comm": "f.comm", "decomposition": "decomp", "decomposition_comm": "d.comm",
          "precondition": "precond", "gradient_comm": "g.comm"}


def format_table(sweeps: Mapping[int, Sequence[StepCost]], *, factor_update_steps: int,
                 inv_update_steps: int, memory_budget_mb: float | None = None) -> str:
    """Per world size and fraction: ms per iteration by phase, total, overhead, memory.

    The fastest fraction within the budget at each world size is marked ``*``; a
    fraction over the budget is marked ``!``.
    """
    head = (f"{'world':>5} {'fraction':>9} {'strategy':<14}"
            + "".join(f"{_SHORT[p]:>9}" for p in PHASES)
            + f"{'total ms':>10}{'overhead':>9}{'MB/rank':>9}")
    lines = [f"ms per iteration (factor_update_steps={factor_update_steps}, "
             f"inv_update_steps={inv_update_steps}); * fastest within budget, ! over budget",
             head]
    for world, costs in sweeps.items():
        best = fastest(costs, factor_update_steps, inv_update_steps, memory_budget_mb)
        for c in costs:
            per = c.iteration(factor_update_steps, inv_update_steps)
            over = memory_budget_mb is not None and c.memory_mb > memory_budget_mb
            mark = "*" if c is best else "!" if over else " "
            lines.append(
                f"{world:>5} {c.grid.fraction!s:>9} {c.grid.strategy_name:<14}"
                + "".join(f"{per[p] * 1e3:>9.2f}" for p in PHASES)
                + f"{c.total(factor_update_steps, inv_update_steps) * 1e3:>10.2f}"
                + f"{c.overhead(factor_update_steps, inv_update_steps):>9.1%}"
                + f"{c.memory_mb:>8.0f}{mark}")
    return "\n".join(lines)


def plot_curves(curves: Mapping[str, Mapping[int, Sequence[StepCost]]], path: str | Path, *,
                factor_update_steps: int, inv_update_steps: int) -> None:
    """Predicted iteration time against world size, one line per strategy, a panel a model.

    Args:
        curves: ``model -> world size -> sweep``.
        path: The image to write (needs matplotlib).
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decomposition updates.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # matplotlib is the app's dependency, not the library's
        raise RuntimeError("--plot needs matplotlib (pip install kaisa[train])") from err
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (model, sweeps) in zip(axes[0], curves.items(), strict=True):
        worlds = sorted(sweeps)
        lines: dict[str, list[tuple[int, float]]] = {}
        for world in worlds:
            for c in sweeps[world]:
                name = c.grid.strategy_name
                if name.startswith("fraction="):
                    continue
                lines.setdefault(name, []).append(
                    (world, c.total(factor_update_steps, inv_update_steps) * 1e3))
            first = sweeps[world][0].phases
            lines.setdefault("SGD (first-order)", []).append(
                (world, (first["forward_backward"] + first["grad_allreduce"]) * 1e3))
        for name, pts in lines.items():
            style = "--" if name.startswith("SGD") else "-o"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("predicted ms / iteration")
        ax.set_title(f"{model} (factor every {factor_update_steps}, "
                     f"inverse every {inv_update_steps})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
