"""Mixture-of-experts layers: one Kronecker block per expert, and the router's weight.

Hugging Face's MoE models hold every expert of a layer in one module (``MixtralExperts``,
``Qwen3MoeExperts``, ...: a class named ``*Experts``) as 3-D parameters ``(experts, out,
in)`` (``gate_up_proj``, ``down_proj``), and apply expert ``e`` to the tokens routed to
it as ``F.linear(x_e, weight[e])``. Each ``weight[e]`` is a Linear block of its own
(:class:`ExpertBlock`, kind ``"linear"``): ``A`` from the routed tokens, ``G`` from the
output gradients of that call, observed by the module's functional tap
(:class:`~kaisa.blocks.callsites.CallSite` with ``index=e``). An expert that saw no tokens
in a step records nothing and keeps its factors. The router (a class named ``*Router``
holding one 2-D ``weight``, applied with ``F.linear`` inside a forward that returns a
tuple) is a Linear block observed the same way (:class:`RouterBlock`). Other parameters
of such modules (expert biases) stay first-order. kaisa does not import the library.
Experts are blocks in one process (several ranks: first-order, with a warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from kaisa.blocks.base import CurvatureBlock
from kaisa.blocks.callsites import CallSite
from kaisa.blocks.linear import LinearBlock
from kaisa.blocks.state import BlockOptions
from kaisa.utils.enums import KFACApprox
from kaisa.utils.shards import is_sharded

__all__ = ["ExpertBlock", "RouterBlock", "expert_parameters"]


def expert_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of the 3-D expert matrices of a ``*Experts`` module."""
    if not type(module).__name__.endswith("Experts"):
        return []
    found: list[tuple[str, torch.Tensor]] = [
        (n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if len({p.shape[0] for _, p in found}) != 1:
        return []
    return found


class ExpertBlock(LinearBlock):
    """Expert ``index``'s matrix ``weight[index]`` ``(out, in)`` of a 3-D parameter."""

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Module
    silent_hint: ClassVar[str] = (
        "no token was routed to this expert yet, or the experts' forward copies their "
        "weights instead of using them as they are")

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        weight: torch.Tensor,
        index: int,
        factor_dtype: torch.dtype | None,
        kfac_approx: KFACApprox = KFACApprox.EXPAND,
    ) -> None:
        self._weight, self.index = weight, index
        super().__init__(name=name, module=module, factor_dtype=factor_dtype,
                         kfac_approx=kfac_approx)
        self.rows = (slice(index, index + 1),)  # the expert's slice of the parameter
        self._site = CallSite(module, weight=weight, index=index)

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """A module of Hugging Face's experts naming with 3-D expert matrices."""
        return bool(expert_parameters(module))

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """Why the experts are not blocks here: FSDP2, or several processes.

        With several ranks each expert sees another number of tokens on each, and the
        rank average of its factors is not defined yet.
        """
        if any(is_sharded(p) for _, p in expert_parameters(module)):
            return "FSDP2 shards its expert parameters; they are first-order under FSDP2"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return ("its experts see different token counts on each rank (their factors' "
                    "rank average is not defined yet); first-order with several processes")
        return None

    @classmethod
    def build(
        cls, name: str, module: nn.Module, options: BlockOptions
    ) -> dict[str, CurvatureBlock]:
        """One block per expert and 3-D parameter: ``{name}.{parameter}.{expert}``."""
        made: dict[str, CurvatureBlock] = {}
        for pname, weight in expert_parameters(module):
            for index in range(weight.shape[0]):
                block_name = f"{name}.{pname}.{index}" if name else f"{pname}.{index}"
                made[block_name] = cls(name=block_name, module=module, weight=weight,
                                       index=index, factor_dtype=options.factor_dtype,
                                       kfac_approx=options.kfac_approx)
        return cls.configured(made, options)

    def call_sites(self) -> tuple[CallSite, ...]:
        """The ``F.linear`` calls of the module's forward that multiply by its matrix."""
        return (self._site,)

    @property
    def weight(self) -> torch.Tensor:
        """The 3-D parameter holding every expert's matrix."""
        return self._weight

    @property
    def bias(self) -> torch.Tensor | None:
        """None: expert biases (where a model has them) are first-order."""
        return None

    @property
    def dims(self) -> tuple[int, int]:
        """``(in, out)`` of one expert's matrix."""
        return int(self._weight.shape[2]), int(self._weight.shape[1])

    def _out_rows(self) -> int:
        return int(self._weight.shape[1])

    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """The expert's gradient ``weight.grad[index]`` as ``(1, out, in)``."""
        grad = self._weight.grad if grads is None else grads[0]
        if grad is None:
            return None
        return grad[self.index].unsqueeze(0)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The matrix as the parameter's slice ``(1, out, in)`` (a view)."""
        return [matrix.reshape(1, *self._weight.shape[1:])]


class RouterBlock(LinearBlock):
    """A router's ``weight`` ``(experts, in)``, applied with ``F.linear`` in its forward."""

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Module

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """A class named ``*Router`` whose only parameter is a 2-D ``weight``."""
        weight = getattr(module, "weight", None)
        return (type(module).__name__.endswith("Router") and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and len(list(module.parameters(recurse=False))) == 1)

    def call_sites(self) -> tuple[CallSite, ...]:
        """The ``F.linear`` calls of the router's forward that multiply by its weight."""
        return (CallSite(self.module, weight=self.weight),)
