"""Learning-rate transfer rules for ``kaisa.EKFAC``, for the benchmarks only (not part of kaisa).

The question: with the learning rate a user tuned for AdamW, which rule lets EKFAC (Adam in
the Kronecker eigenbasis) reach the quality of EKFAC at its own best learning rate?
:class:`ScaledEKFAC` is ``kaisa.EKFAC`` whose update of each Kronecker-covered parameter is
rescaled after the step, per parameter tensor ("layerwise"):

* ``'graft'``: grafting to Adam's update norm. A shadow AdamW state (``m``, ``v`` of the raw
  gradient, the group's betas and eps) gives Adam's update ``a_p = -lr mhat / (sqrt(vhat) +
  eps)``; EKFAC's update ``u_p`` (the step without the weight decay) becomes
  ``u_p ||a_p|| / ||u_p||`` every step.
* ``'rms'``: RMS-matching with a smoothed ratio: the same ratio ``r = ||a_p|| / ||u_p||``
  (equal to the ratio of their RMSs) enters a running average ``s <- 0.99 s + 0.01 r``
  (bias-corrected), and ``u_p`` becomes ``u_p s``: a measured per-layer scale of the
  learning rate that changes slowly, where grafting follows every step's noise.

The weight decay ``p <- p (1 - lr wd)`` is unchanged. The per-parameter averages of ``r``
are kept in :attr:`ScaledEKFAC.ratios` (the measured scale of Adam's update over
EKFAC's).

Measured (``bench/results/gpt_lr_transfer_150.json``: ``python bench/convergence/gpt.py --steps 150
--only adamw@0.003,ekfac@0.003,ekfac-b95@0.01,ekfac@0.01,ekfac-b95@0.003,ekfac-graft@0.003,
ekfac-graft-b95@0.003,ekfac-rms-b95@0.003``; the byte GPT, d 128, 150 steps, one lockstep
run), final validation loss: AdamW at 3e-3 2.680; EKFAC at AdamW's lr 3e-3 2.320; EKFAC at
its own best (lr 1e-2, beta2 0.95) 2.237; at AdamW's lr 3e-3 with a rule: beta2 0.95 alone
2.325, lr x 3.3 alone (1e-2, beta2 0.999) 2.314, ``'graft'`` 2.247, ``'graft'`` + beta2
0.95 2.254, ``'rms'`` + beta2 0.95 2.212. The mean ratio ``||a_p|| / ||u_p||`` over
parameters and steps was 2.6 (beta2 0.999) and 1.9-2.0 (beta2 0.95): EKFAC's update is
2-3 times smaller than Adam's at the same lr over the first 150 steps.

At 300 steps the rule does not hold (``bench/results/gpt_lr_transfer_300.json``:
``python bench/convergence/gpt.py --only ekfac-b95@0.01,ekfac-rms-b95@0.003``):
``'rms'`` + beta2 0.95
at 3e-3 ends at 1.848 against 1.765 for EKFAC at lr 1e-2, beta2 0.95 (and 1.830 for plain
EKFAC at 3e-3 in ``gpt_ekfac_reduce.json``). The ratio falls as training goes on (its
mean over 300 steps is 1.40, against 1.92 over 150): grafting enlarges the early steps,
where EKFAC's update is small, but late in the run it gives about AdamW's step size, while
EKFAC's best keeps 3.3 times AdamW's lr to the end. What carries over in these runs is
the measured multiplier with beta2 0.95 (lr 3.3 x AdamW's, beta2 0.95); either alone
does nothing at 150 steps (2.314, 2.325 against 2.320).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kaisa


class ScaledEKFAC(kaisa.EKFAC):
    """``kaisa.EKFAC`` with its covered parameters' updates rescaled (module docstring)."""

    def __init__(self, model: nn.Module, *, rule: str, smoothing: float = 0.99,
                 **kwargs: Any) -> None:
        if rule not in ("graft", "rms"):
            raise ValueError(f"rule must be 'graft' or 'rms', got {rule!r}")
        super().__init__(model, **kwargs)
        self.rule, self.smoothing = rule, smoothing
        self.shadow: dict[int, dict[str, Any]] = {}
        #: Per covered parameter (by name order): the sum and count of ``||a|| / ||u||``.
        self.ratios: dict[int, list[float]] = {}

    @torch.no_grad()
    def _update(self) -> None:
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        covered = [p for g in self.param_groups for p in g["params"]
                   if id(p) in self._covered and p.grad is not None]
        before = {id(p): p.detach().clone() for p in covered}
        super()._update()
        for p in covered:
            assert p.grad is not None
            group = group_of[id(p)]
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = group["betas"]
            decayed = before[id(p)] * (1 - lr * wd) if wd != 0 else before[id(p)]
            update = p.detach() - decayed
            state = self.shadow.setdefault(id(p), {"t": 0, "m": torch.zeros_like(p),
                                                   "v": torch.zeros_like(p), "s": 0.0})
            state["t"] += 1
            t = state["t"]
            state["m"].lerp_(p.grad, 1 - beta1)
            state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            adam = (state["m"] / (1 - beta1**t)) / ((state["v"] / (1 - beta2**t)).sqrt() + eps)
            norm = float(update.norm())
            ratio = lr * float(adam.norm()) / norm if norm > 0 else 1.0
            total = self.ratios.setdefault(id(p), [0.0, 0.0])
            total[0] += ratio
            total[1] += 1
            if self.rule == "graft":
                scale = ratio
            else:
                state["s"] = self.smoothing * state["s"] + (1 - self.smoothing) * ratio
                scale = state["s"] / (1 - self.smoothing**t)
            p.copy_(decayed + scale * update)

    def mean_ratio(self) -> float:
        """The mean over parameters and steps of ``||a_p|| / ||u_p||``."""
        sums = [s for s, _ in self.ratios.values()]
        counts = [c for _, c in self.ratios.values()]
        return sum(sums) / max(1.0, sum(counts))
