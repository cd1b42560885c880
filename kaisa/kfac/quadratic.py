"""The local quadratic model of :class:`kaisa.KFAC`'s adaptive mode, as pure functions.

For update directions ``v_1..v_k`` (the preconditioned gradient and the previous update)
the step ``delta = sum_i c_i v_i`` minimises
``m(delta) = g.delta + 1/2 delta.(C + (lambda + wd) I) delta`` with ``C`` the exact
Gauss-Newton matrix of the loss on the batch (Martens & Grosse 2015, section 7):

* :class:`ForwardLinearization` gives the Jacobian-vector products ``J v`` by
  forward-mode AD over a replayed forward pass (kfac-jax's way; works with every
  attention kernel), :class:`Linearization` by the double-backward trick over the
  training graph;
* :func:`quadratic_model` the coefficients ``Q``, ``b`` and ``D = v_i.v_j``;
* :func:`solve` the minimiser ``c = -Q^-1 b``;
* :func:`predicted_change` the undamped model's prediction, and :func:`lm_damping` the
  Levenberg-Marquardt rule that compares it with the actual change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
import torch.autograd.forward_ad as fwad
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from kaisa.distributed.fsdp_tangents import UnitTangents
from kaisa.kfac.losses import Loss
from kaisa.utils.profiling import phase
from kaisa.utils.shards import shard_count

__all__ = [
    "ForwardLinearization",
    "apply",
    "JacobianProducts",
    "Linearization",
    "gram",
    "lm_damping",
    "minimise",
    "minimise_over_ranks",
    "parameter_names",
    "predicted_change",
    "quadratic_model",
    "solve",
]


class JacobianProducts(Protocol):
    """What the quadratic model needs: ``J v`` for a few vectors."""

    def jacobian_vector_products(
        self, vectors: list[list[torch.Tensor]], norms: list[float] | None = None
    ) -> list[torch.Tensor]:
        """``J v`` per vector (one tensor per parameter in each)."""
        ...


class Linearization:
    """``J^T u`` as a differentiable function of ``u``, for ``J v`` (double-backward trick).

    ``J`` is the Jacobian of ``outputs`` w.r.t. ``params``. One backward pass with
    ``create_graph=True`` builds ``t(u) = J^T u``; since ``t`` is linear in ``u``, the
    gradient of ``t . v`` w.r.t. ``u`` is ``J v`` whatever ``u``'s value. A sampled
    loss's output gradient as ``u`` lets that pass also record the Monte-Carlo G factors
    (one backward pass fewer per step).

    Args:
        outputs: The model outputs (with their graph).
        params: The parameters.
        seed: The value of ``u`` (zeros if ``None``).
    """

    def __init__(
        self, outputs: torch.Tensor, params: list[torch.Tensor], seed: torch.Tensor | None
    ) -> None:
        seed = torch.zeros_like(outputs) if seed is None else seed.detach()
        self.dummy = seed.requires_grad_(True)
        transposed = torch.autograd.grad(
            outputs, params, grad_outputs=self.dummy, create_graph=True, allow_unused=True
        )
        self.used = [i for i, t in enumerate(transposed) if t is not None]
        self.transposed = [transposed[i] for i in self.used]

    def jacobian_vector_products(
        self, vectors: list[list[torch.Tensor]], norms: list[float] | None = None
    ) -> list[torch.Tensor]:
        """``J v`` per vector (one tensor per parameter); frees the graph after the last.

        With ``norms``, ``J (v / |v|)`` is computed and multiplied by ``|v|``.
        """
        out = []
        with torch.enable_grad():
            for n, v in enumerate(vectors):
                norm = 1.0 if norms is None or not norms[n] > 0 else norms[n]
                (jv,) = torch.autograd.grad(
                    self.transposed, self.dummy,
                    grad_outputs=[v[i] if norm == 1.0 else v[i] / norm for i in self.used],
                    retain_graph=n < len(vectors) - 1,
                )
                out.append(jv.detach() if norm == 1.0 else jv.detach() * norm)
        return out


class ForwardLinearization:
    """``J v`` by forward-mode AD (dual numbers), one forward pass per vector.

    The forward pass is the closure's, run again with dual parameters inside ``replay()``
    (:func:`kaisa.kfac.replay.replayed`: same random numbers, buffers restored, math
    attention) and without grad mode (no statistics are recorded), so ``J`` is the
    Jacobian of the training forward at the same point.

    Args:
        model: The model the closure calls.
        outputs_of: Runs the closure's forward pass and returns the outputs.
        params: The parameters ``J`` is taken with respect to (all of ``model``'s).
        replay: The context a replayed forward pass runs in.
        names: Every name of each parameter in ``model``, by ``id`` (default: from
            ``model.named_parameters``; give it when FSDP2 may have swapped them).

    Parameters FSDP2 shards (``DTensor`` objects; their vectors too) get their dual values
    from inside their unit's forward (:class:`kaisa.distributed.fsdp_tangents.UnitTangents`), the
    others through ``functional_call``.
    """

    def __init__(
        self,
        model: nn.Module,
        outputs_of: Callable[[], torch.Tensor],
        params: list[torch.Tensor],
        replay: Callable[[], AbstractContextManager[Any]],
        names: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        names = parameter_names(model) if names is None else names
        if any(id(p) not in names for p in params):
            raise ValueError("KFAC's parameters must all belong to its model")
        self._plain = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
        sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
        self._sharded = sharded
        self._names = [names[id(params[i])][0] for i in self._plain]
        self._primals = {self._names[n]: params[i].detach() for n, i in enumerate(self._plain)}
        self._units = (UnitTangents(model, [params[i] for i in sharded], names)
                       if sharded else None)
        self._model, self._outputs_of, self._replay = model, outputs_of, replay

    def _outputs(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = functional_call(_Call(self._model, self._outputs_of),
                                            {"model." + n: t for n, t in values.items()}, ())
        return out

    def jacobian_vector_products(
        self, vectors: list[list[torch.Tensor]], norms: list[float] | None = None
    ) -> list[torch.Tensor]:
        """``J v`` per vector; with ``norms``, ``J (v / |v|)`` scaled back by ``|v|``."""
        out = []
        for n, v in enumerate(vectors):
            norm = 1.0 if norms is None or not norms[n] > 0 else norms[n]
            tangents = [t if norm == 1.0 else t / norm for t in v]
            # no grad mode: the hooks of the curvature core record nothing here
            with torch.no_grad(), self._replay(), fwad.dual_level():
                duals = {name: fwad.make_dual(self._primals[name], tangents[i])  # type: ignore[no-untyped-call]
                         for name, i in zip(self._names, self._plain, strict=True)}
                with (self._units.installed([tangents[i] for i in self._sharded])
                      if self._units is not None else nullcontext()):
                    primal, jv = fwad.unpack_dual(self._outputs(duals))  # type: ignore[no-untyped-call]
            if jv is None:  # the outputs do not depend on the parameters
                jv = torch.zeros_like(primal)
            out.append(jv.detach() if norm == 1.0 else jv.detach() * norm)
        return out


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model`` (tied ones have several), by ``id``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


class _Call(nn.Module):
    """A module whose forward runs a closure over ``model`` (for ``functional_call``)."""

    def __init__(self, model: nn.Module, outputs_of: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._outputs_of = outputs_of

    def forward(self) -> torch.Tensor:
        return self._outputs_of()


def gram(
    vectors: list[list[torch.Tensor]],
    mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dot products ``vectors[i] . vectors[j]`` (over all parameters), float64.

    Args:
        vectors: One tensor per parameter in each; a parameter FSDP2 shards is a
            ``DTensor`` in every vector.
        mean: The mean over ranks, needed when a parameter is sharded: each rank sums
            its shards' products, times :func:`~kaisa.utils.shards.shard_count` (an HSDP
            replica holds the same shards), and the mean over ranks is the whole sum.
    """
    k = len(vectors)
    device = vectors[0][0].device
    out = torch.zeros(k, k, dtype=torch.float64, device=device)
    sharded: torch.Tensor | None = None
    for parts in zip(*vectors, strict=True):
        first = parts[0]
        if isinstance(first, DTensor):
            rows = torch.stack([t.to_local().reshape(-1) for t in parts]).double()
            part = (rows @ rows.T).mul_(shard_count(first))
            sharded = part if sharded is None else sharded.add_(part)
        else:
            rows = torch.stack([t.reshape(-1) for t in parts]).double()
            out.add_(rows @ rows.T)
    if sharded is not None:
        if mean is None:
            raise ValueError("gram of sharded vectors needs the mean over ranks")
        out.add_(mean(sharded))
    return out


def quadratic_model(
    loss: Loss,
    outputs: torch.Tensor,
    linearization: JacobianProducts,
    raw: list[torch.Tensor],
    vectors: list[list[torch.Tensor]],
    *,
    regularization: float,
    unit_products: bool = False,
    mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Q_ij = v_i.(C + r I) v_j``, ``b_i = g.v_i`` and ``D_ij = v_i.v_j``, float64.

    Args:
        loss: The declared loss (its Gauss-Newton forms).
        outputs: The outputs the linearisation was built at.
        linearization: ``J`` at ``outputs``; consumed.
        raw: The gradient ``g`` (one tensor per parameter).
        vectors: The directions ``v_i``.
        regularization: ``r``, the damping plus the weight decay.
        unit_products: Compute ``J v`` for unit vectors and scale back (half-precision
            graphs: no over- or underflow).
        mean: The mean over ranks (:func:`gram`'s, for parameters FSDP2 shards).

    Returns:
        ``(Q, b, D)``.
    """
    k = len(vectors)
    products = gram([raw, *vectors], mean)  # [g, v_1, ..., v_k] pairwise dot products
    norms = products.diagonal()[1:].sqrt().tolist() if unit_products else None
    with phase("jacobian_vector_products"):
        jvs = linearization.jacobian_vector_products(vectors, norms)
    quad = torch.empty(k, k, dtype=torch.float64, device=outputs.device)
    for i in range(k):
        for j in range(i, k):
            value = loss.gauss_newton(outputs, jvs[i], jvs[j])
            quad[i, j] = quad[j, i] = value + regularization * products[i + 1, j + 1]
    return quad, products[0, 1:].clone(), products[1:, 1:].clone()


def solve(quad: torch.Tensor, lin: torch.Tensor) -> torch.Tensor | None:
    """Minimiser ``-Q^-1 b`` of ``1/2 c.Q c + b.c``; ``None`` if ``Q`` is not positive."""
    if not bool(torch.isfinite(quad).all() and torch.isfinite(lin).all()):
        return None
    eigenvalues = torch.linalg.eigvalsh(quad)
    if not bool(eigenvalues.min() > 0):
        return None
    solution: torch.Tensor = -torch.linalg.solve(quad, lin)
    return solution


def minimise(
    quad: torch.Tensor, lin: torch.Tensor, squares: torch.Tensor, damping: float,
    max_momentum: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The model's minimiser and the undamped prediction of its change.

    Where ``Q`` is not positive definite with two directions (momentum collinear with the
    preconditioned direction) the second is dropped; where it is not with one, the step
    is zero (a degenerate model takes no step). With ``max_momentum``, a momentum outside
    ``[0, max_momentum]`` is clamped to it and ``alpha`` is the model's minimiser given that
    momentum: ``alpha = -(b_0 + Q_01 mu) / Q_00``.

    Returns:
        ``(coefficients, predicted change)``; ``len(coefficients)`` directions are used.
    """
    k = len(lin)
    coeffs = solve(quad, lin)
    if coeffs is None and k > 1:
        k = 1
        quad, lin, squares = quad[:1, :1], lin[:1], squares[:1, :1]
        coeffs = solve(quad, lin)
    if coeffs is None:
        coeffs = torch.zeros(k, dtype=torch.float64, device=quad.device)
    elif k == 2 and max_momentum is not None and not 0.0 <= float(coeffs[1]) <= max_momentum:
        mu = coeffs[1].clamp(0.0, max_momentum)
        coeffs = torch.stack([-(lin[0] + quad[0, 1] * mu) / quad[0, 0], mu])
    return coeffs, predicted_change(quad, lin, squares, coeffs, damping)


def minimise_over_ranks(
    mean: Callable[[torch.Tensor], torch.Tensor], quad: torch.Tensor, lin: torch.Tensor,
    squares: torch.Tensor, loss: torch.Tensor, damping: float, max_momentum: float | None,
) -> tuple[torch.Tensor, float, float]:
    """:func:`minimise` on ``Q`` and ``b`` averaged over ranks (one ``mean``, with the loss).

    Returns:
        ``(coefficients, predicted change, the loss averaged over ranks)``.
    """
    k = len(lin)
    reduced = mean(torch.cat([quad.flatten(), lin, loss.detach().double()[None]]))
    coeffs, predicted = minimise(reduced[: k * k].view(k, k), reduced[k * k : k * k + k],
                                 squares, damping, max_momentum)
    return coeffs, predicted, float(reduced[-1])


def predicted_change(
    quad: torch.Tensor, lin: torch.Tensor, squares: torch.Tensor, coeffs: torch.Tensor,
    damping: float,
) -> float:
    """The undamped model's change ``1/2 c.(Q - lambda D) c + b.c``.

    The LM rule compares with the model without the damping term (weight decay is part
    of the objective, the damping is not): Martens & Grosse 2015, 6.5; kfac-jax's default.
    """
    undamped = quad - damping * squares.to(quad.device)
    return float(0.5 * coeffs @ undamped @ coeffs + lin @ coeffs)


def apply(
    params: list[torch.Tensor],
    vectors: list[list[torch.Tensor]],
    coeffs: torch.Tensor,
    state: MutableMapping[Any, dict[str, Any]],
) -> tuple[float, float]:
    """``theta += alpha Delta + mu delta_prev``, kept as the next ``velocity``.

    Args:
        params: The parameters.
        vectors: ``[Delta]`` or ``[Delta, delta_prev]``, one tensor per parameter.
        coeffs: ``(alpha,)`` or ``(alpha, mu)``.
        state: Per-parameter state (``Optimizer.state``); ``velocity`` is written.

    Returns:
        ``(alpha, mu)``.
    """
    alpha = float(coeffs[0])
    mu = float(coeffs[1]) if len(vectors) > 1 else 0.0
    for i, p in enumerate(params):
        step = vectors[0][i].mul(alpha)
        if len(vectors) > 1:
            step.add_(vectors[1][i], alpha=mu)
        p.add_(step)
        state[p]["velocity"] = step
    return alpha, mu


def lm_damping(damping: float, rho: float, omega: float, low: float, high: float) -> float:
    """The Levenberg-Marquardt rule: shrink when the model fits, grow when it does not.

    Args:
        damping: The current damping.
        rho: Actual over predicted loss change.
        omega: The factor (< 1).
        low: Lower bound.
        high: Upper bound.

    Returns:
        ``damping * omega`` if ``rho > 3/4``, ``damping / omega`` if ``rho < 1/4``
        (also for a non-finite ``rho``), else ``damping``; clamped to ``[low, high]``.
    """
    if not math.isfinite(rho) or rho < 0.25:
        damping = damping / omega
    elif rho > 0.75:
        damping = damping * omega
    return min(high, max(low, damping))
