"""The part of a ``torch.optim.Optimizer`` that owns a curvature core (EKFAC, KFACMuon).

:class:`CurvatureOptimizer` is the base of the products that step every parameter
themselves: it unscales the gradients under ``scaler.step(opt)``
(:meth:`~CurvatureOptimizer.unscale_gradients`), keeps the step and refresh counters and
the row generator, and implements the state dict and :mod:`kaisa.checkpoint`'s protocol
(:class:`~kaisa.core.checkpoint.KFACCheckpointable`): torch's per-parameter state plus
``'kaisa'`` (counters, schedules, generators, per-block state), checked in full before
anything is loaded. A subclass builds :attr:`curvature`, :attr:`row_generator` and
:attr:`schedules` and says with :meth:`arm` what the coming forward passes record.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kaisa.core.checkpoint import KFACState, gathered_generators, saved_generator
from kaisa.core.curvature import KFACCurvature
from kaisa.utils.hyperparams import Schedules, check_count
from kaisa.utils.optim_state import check_known, check_optimizer_state

__all__ = ["CurvatureOptimizer", "partition_groups"]


def partition_groups(
    params: Sequence[torch.Tensor], given: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``given`` param groups as a list of dicts, checked to partition ``params``.

    Raises:
        ValueError: Unless they are a non-empty list of dicts with ``'params'`` that hold
            every parameter of ``params`` exactly once.
    """
    groups = [dict(g) for g in given]
    if not groups or not all(isinstance(g.get("params"), Iterable) for g in groups):
        raise ValueError("param_groups must be a non-empty list of dicts with 'params'")
    for g in groups:
        g["params"] = list(g["params"])
    listed = [id(p) for g in groups for p in g["params"]]
    if sorted(listed) != sorted(id(p) for p in params):
        raise ValueError("param_groups must hold every trainable parameter of the model "
                         "exactly once")
    return groups


class CurvatureOptimizer(torch.optim.Optimizer):
    """An optimizer product around a :class:`~kaisa.core.curvature.KFACCurvature`."""

    #: ``scaler.step(opt)`` calls :meth:`step` with ``grad_scale`` and ``found_inf`` set.
    _step_supports_amp_scaling = True

    curvature: KFACCurvature
    row_generator: torch.Generator
    _schedules: Schedules
    #: Steps taken (``step()`` calls, overflowed ones included).
    steps: int = 0
    #: Refreshes of the decompositions so far (counts ``eigh_every``).
    refreshes: int = 0

    def _arm(self) -> None:
        """Whether the coming forward passes record statistics (after a step or a load)."""
        raise NotImplementedError

    def _curvature_phases(self) -> None:
        """The step's factor and decomposition phases (the product's schedule)."""
        raise NotImplementedError

    def _update(self) -> None:
        """The step's update of every parameter (skipped when the gradients overflowed)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One step, after the gradients of the step's backward passes.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (called with
                gradients enabled), as for ``torch.optim`` optimizers.

        Returns:
            The closure's loss, or ``None``.

        Whatever raises in the step, the statistics the step recorded are dropped. A step
        whose gradients overflowed (``scaler.step(opt)``) runs the curvature phases and
        changes no parameter.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.curvature.resolve_arm()
            overflow = self.unscale_gradients()
            self._curvature_phases()
            if not overflow:
                self._update()
        except BaseException:
            self.curvature.discard()
            raise
        self.steps += 1
        self.curvature.end_step()
        self._arm()
        return loss

    def unscale_gradients(self) -> bool:
        """Under ``scaler.step(opt)``: unscales the gradients; whether they overflowed.

        The scaler sets ``grad_scale`` (``None`` once ``scaler.unscale_(opt)`` ran) and
        ``found_inf``; the gradients are multiplied by its float32 ``1 / scale`` as
        ``scaler.unscale_`` does. Whether any rank overflowed.
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inverse = scale.double().reciprocal().float()
            grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grouped.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            for (device, _), grads in grouped.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found,
                                                                 inverse.to(device))
        return self.curvature.any_rank(bool(found_inf.item()))

    # ------------------------------------------------------------------ views
    def coverage(self) -> dict[str, str]:
        """``{parameter name: block kind or 'first-order'}`` for every trainable parameter."""
        return self.curvature.coverage()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(  # type: ignore[override]
        self, *, gather: bool = False, include_factors: bool = True
    ) -> dict[str, Any]:
        """The optimizer state of torch, and the curvature's under ``'kaisa'``.

        torch's part holds the first-order state per parameter; ``'kaisa'`` the step and
        refresh counters, the schedules' numbers, the row generator's state
        (``'generator'``, this rank's; with ``gather``, also ``'generators'``, every
        rank's by rank) and per block the factors and the decomposition state (bases,
        moments, inverses, momentum: the product's).

        Args:
            gather: Also the block state this rank does not hold (MEM-OPT, HYBRID-OPT),
                and under FSDP2 the running factors other ranks keep: a collective, call
                it on every rank (``docs/conventions.md``, "Checkpoints").
            include_factors: Include the per-block state (``'layers'``); without it
                ``'kaisa'`` holds the counters and schedules only (:mod:`kaisa.checkpoint`
                saves the blocks itself).
        """
        state = super().state_dict()
        state["kaisa"] = {"steps": self.steps, "refreshes": self.refreshes,
                          "generator": self.row_generator.get_state(),
                          **self._schedules.state_dict()}
        if gather:
            state["kaisa"]["generators"] = gathered_generators(state["kaisa"]["generator"])
        if include_factors:
            state["kaisa"]["layers"] = self.curvature.state_dict(gather=gather)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (bit-exact resume).

        The row generator takes ``'generators'``' entry of this rank when the state has
        one per rank (``state_dict(gather=True)``, e.g. rank 0's loaded on every rank),
        else ``'generator'``; a state with neither (saved before row subsampling
        existed) leaves it as it is.

        Raises:
            ValueError: If the state is malformed or belongs to another model; the
                ``'kaisa'`` part is checked before anything is loaded.
        """
        product = type(self).__name__
        extra = state_dict.get("kaisa") if isinstance(state_dict, dict) else None
        if not isinstance(extra, dict):
            raise ValueError(f"state_dict has no 'kaisa' entry; not a kaisa.{product} state "
                             "dict")
        check_known("state_dict kaisa", extra, ("steps", "refreshes", "generator", "generators",
                                                "layers", *self._schedules.names()))
        counters = {name: extra.get(name) for name in ("steps", "refreshes")}
        self.curvature.check_same_on_ranks(
            {**counters, **{n: extra.get(n) for n in self._schedules.names()}},
            what=f"loaded {product} state")
        steps, refreshes = (check_count(name, value) for name, value in counters.items())
        self._schedules.check_state_dict(extra)
        generator = saved_generator(extra)
        layers = extra.get("layers")
        self.curvature.check_state_dict(layers)
        check_optimizer_state(state_dict, self.param_groups)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "kaisa"})
        self.steps, self.refreshes = steps, refreshes
        if generator is not None:
            self.row_generator.set_state(generator)
        self._schedules.load_state_dict(extra)
        assert layers is not None
        self.curvature.load_state_dict(layers, damping=0.0)
        self._arm()

    def kfac_state_dict(self) -> KFACState:
        """Counters and this rank's row generator, as :mod:`kaisa.checkpoint` takes them."""
        counters = dict(self.state_dict(include_factors=False)["kaisa"])
        return KFACState(counters=counters, generator=counters.pop("generator"),
                         generator_per_rank=True)

    def kfac_optimizers(self) -> dict[str, torch.optim.Optimizer | None]:
        """None: the product steps every parameter itself."""
        return {}

    def load_kfac_state_dict(self, state: KFACState) -> None:
        """Restores :meth:`kfac_state_dict` output, its ``layers`` and ``optimizers['self']``."""
        self.load_state_dict({**state.optimizers.get("self", {}), "kaisa": {
            **state.counters, "layers": dict(state.layers), "generator": state.generator}})
