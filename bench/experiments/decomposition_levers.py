"""Cheaper decompositions: Newton-Schulz inverses and the warm eigenbasis refresh, measured.

    python bench/experiments/decomposition_levers.py [--device cpu|cuda] [--smoke]
        [--max-n 1152] [--per-size 2] [--rounds 3] [--out bench/results/decomposition_levers.json]

Two levers that replace a LAPACK/cuSOLVER decomposition with GEMMs, on ResNet-50's factor
sizes (``bench/kernels/bench_kernels_gpu.py``'s ``factor_dims``: A and G of 53 convs + fc,
64...4608; ``--max-n`` and ``--per-size`` take a subset, the JSON says which):

* **inverse**: ``(F + lambda I)^-1`` by the library's batched Cholesky
  (:func:`kaisa.methods.linalg.damped_inverses`) against Newton-Schulz iterations
  ``X_{k+1} = X_k (2I - M X_k)``, ``M = F + lambda I``, in float32, started

  - *warm*: from the previous inverse, the library's float32 Cholesky inverse of
    ``M_prev = F_prev + lambda_prev I``, where ``F = rho F_prev + (1 - rho) F_batch``
    (``rho`` 0.95, one fold, or ten: a refresh every ten factor updates) and damping
    ``lambda = 1e-3 trace(F) / n`` (the rule), or that damping scaled by 0.5, 2 or 10
    against the previous one (a schedule that changes it between refreshes);
  - *cold*: from ``X_0 = M^T / (||M||_1 ||M||_inf)`` (``transpose``) or
    ``X_0 = I / min(||M||_1, ||M||_F)`` (``identity``: an upper bound of ``||M||_2``).

  Newton-Schulz converges iff the spectral radius of ``I - M X_0`` is below 1; for the warm
  start that radius is computed exactly (float64 eigenvalues of ``M_prev^-1 M``) and every
  scenario says how many factors violate it. Per factor: iterations to the relative
  residual ``||I - M X||_F / sqrt(n) <= 1e-6`` (``None``: not reached; float32 stops at
  about eps times the condition number), iterations to the *target*
  ``max(1e-6, 2 x the residual of the float32 Cholesky inverse)`` (about as good as
  what it replaces; the iterations *used* are those, or the best residual's where a
  factor never reaches it), and the relative error of the preconditioned product
  ``X V`` (``V``: 32 random columns) against the float64 inverse's, for Newton-Schulz
  (at the target, else its best iterate) and Cholesky.
* **eigen refresh**: :func:`kaisa.methods.linalg.eigen_decompositions` (full eigh) against
  :func:`kaisa.methods.linalg.warm_eigen_decompositions` (one GEMM + QR step from the
  eigenbasis of ``F_prev``), with the product error of ``Q diag(1 / (e + lambda)) Q^T V``.

Factors are covariances of ``rows x n`` data: ``random`` (iid Gaussian) and ``low_rank``
(``n / 8`` directions with scales ``1 / i`` plus isotropic noise 0.01: condition numbers
of ``M`` 1.0e4-1.4e4 measured, with the damping rule); each folded batch from ``n`` rows,
``F_prev`` from ``39n`` (an average with decay 0.95 weighs about 39 batches).

Times: the whole subset, interleaved rounds (median ms), one thread on the CPU:
Cholesky, Newton-Schulz warm at its measured iterations per size (the most any factor
of the size used, the rule's damping, one fold), one Newton-Schulz iteration (cold
starts: that, weighted by n^3, times their iterations), eigh and the warm refresh, on
the ``low_rank`` factors. ``bench/kernels/bench_kernels_gpu.py`` measures the same rows
on a GPU (groups ``inverse`` and ``eigen_refresh``: the GPU script's kernels stage).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kaisa.methods.linalg import damped_inverses, eigen_decompositions, warm_eigen_decompositions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

RHO = 0.95
TOL = 1e-6
RELATIVE_DAMPING = 1e-3
PRODUCT_COLUMNS = 32
#: Newton-Schulz's target: this times the float32 Cholesky inverse's residual (or TOL)
TARGET_FACTOR = 2.0
#: rows of the previous factor, in batches of n rows: an average with decay RHO weighs
#: about (1 + RHO) / (1 - RHO) = 39 batches
PREVIOUS_ROWS = 39
#: (name, folds between the previous inverse and now, damping now / the rule's)
SCENARIOS: tuple[tuple[str, int, float], ...] = (
    ("rule, 1 fold", 1, 1.0), ("rule, 10 folds", 10, 1.0),
    ("damping x0.5", 1, 0.5), ("damping x2", 1, 2.0), ("damping x10", 1, 10.0))
COLDS = ("identity", "transpose")
MODELS = ("low_rank", "random")


def resnet50_sizes(max_n: int | None = None, per_size: int | None = None) -> dict[int, int]:
    """ResNet-50's factor sizes -> how many factors have that size (subset: ``max_n``,
    ``per_size``), from ``bench/kernels/bench_kernels_gpu.py``."""
    from bench_kernels_gpu import factor_dims

    counts = Counter(factor_dims())
    return {n: min(c, per_size or c) for n, c in sorted(counts.items())
            if max_n is None or n <= max_n}


# --------------------------------------------------------------------------- #
# factors
# --------------------------------------------------------------------------- #


@dataclass
class Source:
    """The data distribution of one size group's factors (one per factor)."""

    n: int
    count: int
    model: str
    device: torch.device
    gen: torch.Generator
    basis: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.model == "low_rank":
            r = max(2, self.n // 8)
            g = torch.randn(self.count, self.n, r, generator=self.gen, device=self.device)
            self.basis = torch.linalg.qr(g)[0].mT.contiguous()  # (B, r, n)
            self.scales = 1.0 / torch.arange(1, r + 1, device=self.device, dtype=torch.float32)

    def covariance(self, rows: int) -> torch.Tensor:
        """``X^T X / rows`` of ``rows`` fresh samples per factor (in chunks of ``4n`` rows),
        float32; TF32 allowed on a GPU (the data's precision is not what is measured)."""
        total = torch.zeros(self.count, self.n, self.n, device=self.device)
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            for lo in range(0, rows, 4 * self.n):
                chunk = min(4 * self.n, rows - lo)
                x = torch.randn(self.count, chunk, self.n, generator=self.gen,
                                device=self.device)
                if self.model == "low_rank":
                    assert self.basis is not None and self.scales is not None
                    z = torch.randn(self.count, chunk, self.scales.numel(), generator=self.gen,
                                    device=self.device)
                    x = (z * self.scales) @ self.basis + 0.01 * x
                total += x.mT @ x
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
        return total / rows


def damping_rule(f: torch.Tensor) -> torch.Tensor:
    """``1e-3 trace(F) / n`` per factor, float64 ``(B,)``."""
    return RELATIVE_DAMPING * torch.diagonal(f.double(), dim1=-2, dim2=-1).mean(-1)


def damped(f: torch.Tensor, lam: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F + lambda I`` in ``dtype``."""
    eye = torch.eye(f.shape[-1], dtype=dtype, device=f.device)
    return f.to(dtype) + lam.to(dtype).reshape(-1, 1, 1) * eye


def cholesky_inverse(f: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The library's float32 inverse of ``F + lambda I``."""
    (inv,) = damped_inverses([f], damping=[lam], inv_dtype=torch.float32)
    assert inv is not None
    return inv


# --------------------------------------------------------------------------- #
# Newton-Schulz
# --------------------------------------------------------------------------- #


def residual(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``||I - M X||_F / sqrt(n)`` per matrix (float32 product, float64 norm)."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    norm: torch.Tensor = torch.linalg.matrix_norm((eye - m @ x).double())
    return norm / math.sqrt(m.shape[-1])


def cold_start(m: torch.Tensor, kind: str) -> torch.Tensor:
    """``M^T / (||M||_1 ||M||_inf)`` (``transpose``) or ``I / min(||M||_1, ||M||_F)``."""
    one = torch.linalg.matrix_norm(m, ord=1)
    if kind == "transpose":
        inf = torch.linalg.matrix_norm(m, ord=float("inf"))
        out: torch.Tensor = m.mT / (one * inf).reshape(-1, 1, 1)
        return out
    bound = torch.minimum(one, torch.linalg.matrix_norm(m))
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    return eye / bound.reshape(-1, 1, 1)


def newton_schulz_fixed(m: torch.Tensor, x0: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` steps ``X <- X (2I - M X)``: two GEMMs each, nothing checked."""
    two = 2.0 * torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    x = x0
    for _ in range(iterations):
        x = x @ (two - m @ x)
    return x


@dataclass
class Run:
    """Per matrix of one batched Newton-Schulz run."""

    to_tol: list[int | None]
    to_target: list[int | None]
    stop: list[int]  # the target's iteration where reached, else the best residual's
    best_residual: list[float]
    diverged: list[bool]
    x: torch.Tensor  # at the target where reached, else the best iterate
    iterations_run: int = 0


def newton_schulz(m: torch.Tensor, x0: torch.Tensor, target: torch.Tensor,
                  max_iter: int = 80, patience: int = 3) -> Run:
    """Iterates until every matrix reached ``TOL``, stalled ``patience`` iterations past its
    best residual (counted below residual 0.5: a cold start's first iterations round
    to 1), or diverged (residual above 1e4 or not finite); one host read a step."""
    b, n = m.shape[0], m.shape[-1]
    eye = torch.eye(n, dtype=m.dtype, device=m.device)
    x = x0
    keep = x0.clone()
    best = torch.full((b,), math.inf, dtype=torch.float64, device=m.device)
    to_tol: list[int | None] = [None] * b
    to_target: list[int | None] = [None] * b
    since = [0] * b
    best_at = [0] * b
    diverged = [False] * b
    k = 0
    for k in range(max_iter + 1):
        r = eye - m @ x
        res = torch.linalg.matrix_norm(r.double()) / math.sqrt(n)
        reached = res <= target
        # the iterate kept: the best one until the target is reached, then that one
        improved = (res < best) & torch.tensor([t is None for t in to_target], device=m.device)
        keep = torch.where(improved.reshape(-1, 1, 1), x, keep)
        before = best.tolist()
        best = torch.where(res < best, res, best)
        done = True
        for i, (v, hit) in enumerate(zip(res.tolist(), reached.tolist(), strict=True)):
            if to_tol[i] is None and v <= TOL:
                to_tol[i] = k
            if to_target[i] is None and hit:
                to_target[i] = k
            if not math.isfinite(v) or v > 1e4:
                diverged[i] = True
            if v < before[i]:
                since[i], best_at[i] = 0, k
            elif v < 0.5:
                since[i] += 1
            if not (diverged[i] or to_tol[i] is not None or since[i] >= patience):
                done = False
        if done or k == max_iter:
            break
        x = x @ (eye + r)
    stop = [t if t is not None else a for t, a in zip(to_target, best_at, strict=True)]
    return Run(to_tol, to_target, stop, best.tolist(), diverged, keep, k)


# --------------------------------------------------------------------------- #
# measurements of one size group
# --------------------------------------------------------------------------- #


def product_error(x: torch.Tensor, v: torch.Tensor, want: torch.Tensor) -> list[float]:
    """``||X V - want||_F / ||want||_F`` per matrix (``want`` float64)."""
    got = (x @ v.to(x.dtype)).double()
    ratio: torch.Tensor = torch.linalg.matrix_norm(got - want) / torch.linalg.matrix_norm(want)
    return [float(r) for r in ratio.tolist()]


def radius(m_prev64: torch.Tensor, m64: torch.Tensor) -> list[float]:
    """Spectral radius of ``I - M_prev^-1 M`` (float64): Newton-Schulz from the previous
    inverse converges iff it is below 1."""
    low = torch.linalg.cholesky(m_prev64)
    s = torch.linalg.solve_triangular(low, m64, upper=False)
    s = torch.linalg.solve_triangular(low, s.mT, upper=False)
    mu = torch.linalg.eigvalsh((s + s.mT) / 2)
    return [float(r) for r in (1.0 - mu).abs().amax(-1).tolist()]


@dataclass
class Group:
    """One size group: the factors now and before, dampings, the warm start's iterations,
    the reference product of the rule's damping, and the summary of its measurements."""

    n: int
    f: torch.Tensor
    lam: torch.Tensor
    f_prev: torch.Tensor
    x_prev: torch.Tensor
    v: torch.Tensor
    want: torch.Tensor
    warm_iterations: int
    q_prev: torch.Tensor | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def _stats(values: Sequence[float | int | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    return {"median": statistics.median(got) if got else None,
            "max": max(got) if got else None, "of": len(values), "reached": len(got)}


def _errors(values: Sequence[float]) -> dict[str, float]:
    return {"median": float(f"{statistics.median(values):.3g}"),
            "max": float(f"{max(values):.3g}")}


def eigen_product_error(g: Group, e: Any) -> dict[str, float]:
    """The product error of ``Q diag(1 / (e + lambda)) Q^T`` (an :class:`EigenResult`)."""
    inv = e.eigenvectors @ torch.diag_embed(
        1.0 / (e.eigenvalues + g.lam.to(e.eigenvalues.dtype).unsqueeze(-1))) @ e.eigenvectors.mT
    return _errors(product_error(inv, g.v, g.want))


def measure_group(n: int, count: int, model: str, device: torch.device, seed: int,
                  scenarios: Sequence[tuple[str, int, float]] = SCENARIOS,
                  colds: Sequence[str] = COLDS, exact: bool = True, eigen: bool = True,
                  max_iter: int = 80) -> Group:
    """Convergence and accuracy of every start on ``count`` factors of size ``n``.

    The first scenario must be the rule's damping (its factors are the group's); the cold
    starts run on it. ``exact``: the condition numbers and the warm starts' spectral radii
    (float64 eigenvalues); ``eigen``: eigh of both factors and the warm refresh (else
    ``q_prev`` is left to the caller).
    """
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + n)
    src = Source(n, count, model, device, gen)
    f_prev = src.covariance(PREVIOUS_ROWS * n)
    lam_prev = damping_rule(f_prev)
    x_prev = cholesky_inverse(f_prev, lam_prev)  # what the library holds from last time
    v = torch.randn(count, n, PRODUCT_COLUMNS, generator=gen, device=device)
    folds = {k: f_prev for k in {1, *(s[1] for s in scenarios)}}
    f = f_prev
    for k in range(1, max(folds) + 1):
        f = RHO * f + (1 - RHO) * src.covariance(n)
        if k in folds:
            folds[k] = f
    out: dict[str, Any] = {"n": n, "factors": count}
    m_prev64 = damped(f_prev, lam_prev, torch.float64)
    group: Group | None = None
    for name, k, scale in scenarios:
        f = folds[k]
        lam = scale * damping_rule(f)
        m = damped(f, lam, torch.float32)
        m64 = damped(f, lam, torch.float64)
        want = torch.cholesky_inverse(torch.linalg.cholesky(m64)) @ v.double()
        chol = cholesky_inverse(f, lam)
        chol_res = residual(m, chol)
        target = torch.clamp(TARGET_FACTOR * chol_res, min=TOL)
        run = newton_schulz(m, x_prev, target, max_iter)
        entry: dict[str, Any] = {
            "iterations_to_1e-6": _stats(run.to_tol),
            "iterations_to_target": _stats(run.to_target),
            "iterations_used": _stats(run.stop),
            "diverged": sum(run.diverged),
            "best_residual": _errors(run.best_residual),
            "product_error": _errors(product_error(run.x, v, want)),
        }
        if exact:
            rad = radius(m_prev64, m64)
            entry["radius_of_I_minus_MX0"] = _errors(rad)
            entry["violates_radius_below_1"] = sum(r >= 1 for r in rad)
        out.setdefault("warm", {})[name] = entry
        if group is not None:
            continue
        # the rule's damping, one fold: the group's factors; the cold starts and eigen
        group = Group(n, f, lam, f_prev, x_prev, v, want, max(run.stop), summary=out)
        if exact:
            evals = torch.linalg.eigvalsh(m64)
            out["condition_number"] = _errors((evals[:, -1] / evals[:, 0]).tolist())
        out["cholesky"] = {"residual": _errors(chol_res.tolist()),
                           "product_error": _errors(product_error(chol, v, want))}
        for kind in colds:
            run = newton_schulz(m, cold_start(m, kind), target, max_iter)
            out[f"cold_{kind}"] = {
                "iterations_to_1e-6": _stats(run.to_tol),
                "iterations_to_target": _stats(run.to_target),
                "iterations_used": _stats(run.stop),
                "diverged": sum(run.diverged),
                "best_residual": _errors(run.best_residual),
                "product_error": _errors(product_error(run.x, v, want))}
        if eigen:
            (full,) = eigen_decompositions([f], inv_dtype=torch.float32)
            (prev,) = eigen_decompositions([f_prev], inv_dtype=torch.float32)
            assert full is not None and prev is not None
            group.q_prev = prev.eigenvectors
            (warm,) = warm_eigen_decompositions([f], [group.q_prev], inv_dtype=torch.float32)
            assert warm is not None
            out["eigen"] = {"eigh": eigen_product_error(group, full),
                            "warm_refresh": eigen_product_error(group, warm)}
    assert group is not None
    return group


# --------------------------------------------------------------------------- #
# timing of a whole set
# --------------------------------------------------------------------------- #


def ways(groups: Sequence[Group]) -> dict[str, Callable[[], object]]:
    """The whole set's decompositions each way (lists, as the library groups by size)."""
    fs = [g.f for g in groups]
    lams = [g.lam for g in groups]
    ms = [damped(g.f, g.lam, torch.float32) for g in groups]

    def cholesky() -> object:
        return damped_inverses(fs, damping=lams, inv_dtype=torch.float32)

    def ns_warm() -> object:
        return [newton_schulz_fixed(m, g.x_prev, g.warm_iterations)
                for m, g in zip(ms, groups, strict=True)]

    def ns_iteration() -> object:
        return [newton_schulz_fixed(m, g.x_prev, 1) for m, g in zip(ms, groups, strict=True)]

    def eigh() -> object:
        return eigen_decompositions(fs, inv_dtype=torch.float32)

    def warm_refresh() -> object:
        return warm_eigen_decompositions(fs, [g.q_prev for g in groups],
                                         inv_dtype=torch.float32)

    return {"cholesky": cholesky, "newton_schulz_warm": ns_warm,
            "newton_schulz_one_iteration": ns_iteration, "eigh": eigh,
            "warm_refresh": warm_refresh}


def cold_iterations(groups: Sequence[Group], kind: str) -> int:
    """Newton-Schulz iterations of a cold start over the set: per size the most any factor
    needed for its target (the best residual's iterations where one never reached it)."""
    total = 0
    for g in groups:
        total += g.summary[f"cold_{kind}"]["iterations_used"]["max"] * g.f.shape[0]
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures, prints a table and writes the JSON."""
    p = harness.parser(__doc__, harness.RESULTS / "decomposition_levers.json")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--max-n", type=int, default=1152, help="largest factor size (0: all)")
    p.add_argument("--per-size", type=int, default=2, help="factors per size (0: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        sizes = {16: 2, 33: 1, 64: 2}
        args.rounds = 1
    else:
        sizes = resnet50_sizes(args.max_n or None, args.per_size or None)
    start = time.perf_counter()
    results: dict[str, Any] = {
        "sizes": {str(n): c for n, c in sizes.items()},
        "subset": ("smoke: 16, 33, 64" if args.smoke else
                   f"ResNet-50's factor sizes up to {args.max_n or 'the largest'}, "
                   f"at most {args.per_size or 'all'} factors a size"),
        "protocol": {"rho": RHO, "tol": TOL, "relative_damping": RELATIVE_DAMPING,
                     "scenarios": [list(s) for s in SCENARIOS], "colds": list(COLDS),
                     "rounds": args.rounds, "dtype": "float32", "tf32": False,
                     "threads": torch.get_num_threads() if args.device == "cpu" else None},
        "models": {},
    }
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    for model in MODELS:
        groups = [measure_group(n, c, model, device, args.seed) for n, c in sizes.items()]
        print(f"[{model}] measured in {time.perf_counter() - start:.0f} s", flush=True)
        entry: dict[str, Any] = {"sizes": {str(g.n): g.summary for g in groups}}
        if model == MODELS[0]:  # times on the realistic factors only
            fns = ways(groups)
            times = harness.interleaved(fns, args.rounds, warmup=1, sync=sync)
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            weights = sum(g.f.shape[0] * g.n**3 for g in groups)
            iteration_ms = ms["newton_schulz_one_iteration"]
            cold = {kind: cold_iterations(groups, kind) for kind in COLDS}
            # a cold start's cost: one set iteration's ms, scaled by its iterations per
            # factor weighted by n^3 (a factor's share of one set iteration)
            projected = {
                kind: iteration_ms * sum(
                    g.summary[f"cold_{kind}"]["iterations_used"]["max"]
                    * g.f.shape[0] * g.n**3 for g in groups) / weights
                for kind in COLDS}
            entry["whole_set_ms"] = {k: round(v, 2) for k, v in ms.items()}
            entry["whole_set_ms"].update({f"newton_schulz_cold_{k}_projected": round(v, 2)
                                          for k, v in projected.items()})
            entry["warm_iterations_per_size"] = {str(g.n): g.warm_iterations for g in groups}
            entry["cold_iterations_total"] = cold
        results["models"][model] = entry
    results["seconds"] = round(time.perf_counter() - start, 1)
    print(table(results))
    doc = harness.write(args.out, "decomposition_levers", results, argv,
                        script="bench/experiments/decomposition_levers.py")
    print(f"wrote {args.out}")
    return doc


def table(results: dict[str, Any]) -> str:
    """The markdown tables: per size and start, iterations and errors; the set's times."""
    lines = []
    for model, entry in results["models"].items():
        lines += [f"\n{model}:", "| n | cond | chol res | chol err | warm it (1e-6 / target) "
                  "| warm err | 10 folds / x0.5 / x2 / x10: it (radius >= 1) | cold id it | "
                  "cold T it | eigh err | refresh err |", "|" + " --- |" * 11]
        for n, s in entry["sizes"].items():
            w = s["warm"]
            rule = w[SCENARIOS[0][0]]

            def it(stats: dict[str, Any]) -> str:
                return f"{stats['max']}" if stats["reached"] == stats["of"] else (
                    f"{stats['max']} ({stats['reached']}/{stats['of']})")

            others = ", ".join(
                f"{it(w[name]['iterations_to_target'])} "
                f"({w[name].get('violates_radius_below_1', w[name]['diverged'])})"
                for name, _, _ in SCENARIOS[1:] if name in w)
            eig = s.get("eigen", {})
            lines.append(
                f"| {n} | {s['condition_number']['max']:.2g} | "
                f"{s['cholesky']['residual']['max']:.2g} | "
                f"{s['cholesky']['product_error']['max']:.2g} | "
                f"{it(rule['iterations_to_1e-6'])} / {it(rule['iterations_to_target'])} | "
                f"{rule['product_error']['max']:.2g} | {others} | "
                f"{it(s['cold_identity']['iterations_to_target'])} | "
                f"{it(s['cold_transpose']['iterations_to_target'])} | "
                f"{eig.get('eigh', {}).get('max', '')} | "
                f"{eig.get('warm_refresh', {}).get('max', '')} |")
        if "whole_set_ms" in entry:
            lines.append("whole set, ms: " + ", ".join(
                f"{k} {v}" for k, v in entry["whole_set_ms"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
