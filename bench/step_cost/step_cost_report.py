"""bench/step_cost/step_cost.py's phase categories, table and stacked-bar plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Report categories, in the order of the table and the bars.
CATEGORIES = (
    "forward", "backward", "curvature backward (MC)", "factor statistics", "communication",
    "decomposition", "preconditioning", "quadratic model", "damping (LM rule)",
    "first-order update", "overhead",
)
#: Innermost phase name -> category (kaisa's phases and the benchmark's own).
_BY_NAME = {
    "forward": "forward", "backward": "backward", "curvature_backward": "curvature backward (MC)",
    "factors": "factor statistics", "communication": "communication",
    "decompositions": "decomposition", "preconditioning": "preconditioning",
    "update": "first-order update", "first_order": "first-order update",
}
#: The issue's targets (ratio to the baseline) and the ratios it measured ("today").
TARGETS = {
    ("resnet32", "kfac_pre 10/100 + sgd"): (1.10, 1.21),
    ("resnet32", "kfac_pre 1/10 + sgd"): (2.0, 2.77),
    ("gpt", "kfac_pre 10/100 + adamw"): (1.2, None),
    ("autoencoder", "kfac adaptive"): (3.0, 8.3),
    ("gpt", "kfac adaptive"): (3.0, None),
    ("gpt", "ekfac"): (1.5, None),
}


def categorise(seconds: dict[tuple[str, ...], float]) -> dict[str, float]:
    """Exclusive seconds by phase path -> seconds by category.

    Everything inside the quadratic model (its replayed forward passes included) or the
    LM damping rule counts there; otherwise the innermost phase decides, and a phase of
    no category (the step's own remainder, a product's bookkeeping) is overhead.
    """
    out: dict[str, float] = {}
    for path, value in seconds.items():
        if "quadratic_model" in path:
            cat = "quadratic model"
        elif "damping" in path:
            cat = "damping (LM rule)"
        else:
            cat = _BY_NAME.get(path[-1], "overhead")
        out[cat] = out.get(cat, 0.0) + value
    return out


def table(results: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The ratio table (Markdown) and, per configuration, its three largest categories.

    ``before``: an earlier result of the same benchmark; its ratio for the same task and
    configuration is shown beside the new one (``-`` where it has none).
    """
    head = "| task | configuration | ms/step | ratio |"
    if before is not None:
        head += " before |"
    head += " target | issue's | peak RSS rise MiB | K-FAC state MiB | largest phases (ms) |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for task, entries in results["tasks"].items():
        for name, e in entries.items():
            target, today = TARGETS.get((task, name), (None, None))
            ratio = e.get("ratio")
            peak = max(e["peak_rss_rise_mib_by_label"].values(), default=float("nan"))
            top = sorted(e["ms_by_category"].items(), key=lambda kv: -kv[1])[:3]
            shown = "" if ratio is None else f"{ratio:.2f}x {e['baseline']}"
            row = f"| {task} | {name} | {e['ms_per_step']:.1f} | {shown} |"
            if before is not None:
                old = before["tasks"].get(task, {}).get(name, {}).get("ratio")
                row += " - |" if old is None else f" {old:.2f}x |"
            lines.append(
                row + f" {'' if target is None else f'<= {target:g}'} | "
                f"{'' if today is None else f'{today:g}'} | {peak:.0f} | "
                f"{e['kfac_state_mib']:.1f} | "
                + ", ".join(f"{k} {v:.1f}" for k, v in top if v > 0) + " |"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Stacked bars: ms per step by category, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    rows = [len(results["tasks"][t]) for t in tasks]
    height = 1.4 + sum(0.9 + 0.42 * n for n in rows)
    fig, axes = plt.subplots(len(tasks), 1, figsize=(11, height), squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20)]
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        entries = results["tasks"][task]
        names = list(entries)[::-1]
        left = [0.0] * len(names)
        for c, cat in enumerate(CATEGORIES):
            widths = [entries[n]["ms_by_category"].get(cat, 0.0) for n in names]
            if not any(widths):
                continue
            ax.barh(names, widths, left=left, color=colors[c % len(colors)], label=cat)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        for y, n in enumerate(names):
            ratio = entries[n].get("ratio")
            text = f" {entries[n]['ms_per_step']:.1f} ms" + (
                "" if ratio is None else f" ({ratio:.2f}x {entries[n]['baseline']})")
            ax.text(left[y], y, text, va="center", fontsize=8)
        ax.set_xlim(0, max(left) * 1.35)
        ax.set_title(task, fontsize=10, loc="left")
        ax.set_xlabel("ms per step (amortised median)")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    order = [labels.index(c) for c in CATEGORIES if c in labels]
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center",
               ncol=6, fontsize=8, frameon=False)
    fig.suptitle("Per-step cost by phase, 1 thread, shared 2-core machine"
                 + (" (SMOKE: no timing claims)" if results.get("smoke") else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.7 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
