"""What a model asks of K-FAC: its blocks' shapes and rows, found on the meta device.

:func:`workload_from_module` registers the model's curvature blocks with
:func:`kaisa.blocks.register_blocks` (the registration the preconditioner does) and runs
one forward pass of a meta-device batch with hooks that record each block's output, so a
block's rows per step (batch x positions) are known without weights or compute.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kaisa.blocks import register_blocks
from kaisa.methods import DENSE, Diagonal
from kaisa.plan.models import builtin_models

__all__ = ["BlockShape", "Workload", "load_workload", "workload_from_module"]

#: The kinds the preconditioner registers by default (kfac-pytorch's).
DEFAULT_KINDS = ("linear", "conv2d")


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """One Kronecker block as the planner sees it.

    Attributes:
        name: The block's name (the engine's layer name).
        a_dim: A factor dimension.
        g_dim: G factor dimension.
        groups: Kronecker blocks (convolution groups).
        rows: Rows of its factors per step on one rank (batch x positions).
        diagonal_sides: The sides kept as diagonals.
    """

    name: str
    a_dim: int
    g_dim: int
    groups: int = 1
    rows: int = 1
    diagonal_sides: Diagonal = DENSE

    @property
    def grad_numel(self) -> int:
        """Elements of the block's gradient matrix (all groups)."""
        return self.groups * self.a_dim * self.g_dim


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model's Kronecker blocks, in model order, for one local batch.

    Attributes:
        name: The model's name.
        batch: Local batch size (per rank).
        blocks: The Kronecker blocks (diagonal blocks are not placed and are left out).
        param_numel: Trainable parameters of the whole model (the DDP gradient allreduce).
    """

    name: str
    batch: int
    blocks: tuple[BlockShape, ...]
    param_numel: int

    @property
    def layer_dims(self) -> dict[str, tuple[int, int]]:
        """``name -> (a_dim, g_dim)``, the engine's ``layer_dims``."""
        return {b.name: (b.a_dim, b.g_dim) for b in self.blocks}

    @property
    def layer_groups(self) -> dict[str, int]:
        """``name -> groups``."""
        return {b.name: b.groups for b in self.blocks}

    @property
    def diagonal_sides(self) -> dict[str, Diagonal]:
        """``name -> diagonal sides``."""
        return {b.name: b.diagonal_sides for b in self.blocks}

    def forward_flops(self) -> float:
        """Flops of the blocks' forward GEMMs on one rank (``2 rows a g`` each)."""
        return sum(2.0 * b.rows * b.grad_numel for b in self.blocks)


def workload_from_module(model: nn.Module, example: torch.Tensor, *, name: str = "model",
                         kinds: Sequence[str] = DEFAULT_KINDS) -> Workload:
    """The workload of ``model`` on the batch ``example`` (both best on the meta device).

    Args:
        model: The model (its parameters may be on ``meta``).
        example: One local batch (``example.shape[0]`` is the batch size).
        name: A name for reports.
        kinds: Block kinds to register (the preconditioner's ``layer_kinds``).

    Returns:
        The workload; a block whose module the forward pass never called gets one row.
    """
    blocks = register_blocks(model, kinds=kinds)
    outputs: dict[str, int] = {}
    modules = dict(model.named_modules())
    handles = []
    for block_name, block in blocks.items():
        module = modules.get(block_name)
        if module is None or block.diagonal:
            continue

        def hook(_m: nn.Module, _i: object, out: object, key: str = block_name) -> None:
            if isinstance(out, torch.Tensor):
                outputs[key] = outputs.get(key, 0) + out.numel()

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    shapes = []
    for block_name, block in blocks.items():
        if block.diagonal:
            continue
        a_dim, g_dim = block.dims
        groups = int(block.groups)
        rows = max(1, outputs.get(block_name, 0) // max(1, g_dim * groups))
        shapes.append(BlockShape(name=block_name, a_dim=a_dim, g_dim=g_dim, groups=groups,
                                 rows=rows, diagonal_sides=block.diagonal_sides))
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Workload(name=name, batch=int(example.shape[0]), blocks=tuple(shapes),
                    param_numel=params)


def _example(kind: str, batch: int, seq_len: int) -> torch.Tensor:
    if kind == "image":
        return torch.empty(batch, 3, 224, 224, device="meta")
    return torch.zeros(batch, seq_len, dtype=torch.long, device="meta")


def load_workload(spec: str, *, batch: int, seq_len: int = 512,
                  kinds: Sequence[str] = DEFAULT_KINDS) -> Workload:
    """A built-in model (``resnet50``, ``bert-large``) or ``module:callable``.

    A ``module:callable`` is called with no arguments under ``torch.device('meta')`` and
    returns either a model, fed an image batch, or ``(model, example)``.

    Args:
        spec: The model.
        batch: Local batch size.
        seq_len: Tokens per sequence of a token model.
        kinds: Block kinds to register.

    Returns:
        The workload.
    """
    builtin = builtin_models()
    if spec in builtin:
        cls, kind = builtin[spec]
        with torch.device("meta"):
            model = cls()
        return workload_from_module(model, _example(kind, batch, seq_len), name=spec,
                                    kinds=kinds)
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model must be one of {sorted(builtin)} or module:callable, "
                         f"got {spec!r}")
    factory: Callable[[], object] = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        built = factory()
    made, example = built if isinstance(built, tuple) else (built, _example("image", batch,
                                                                           seq_len))
    if not (isinstance(made, nn.Module) and isinstance(example, torch.Tensor)):
        raise TypeError(f"{spec} must return a module or (module, example tensor)")
    return workload_from_module(made, example, name=spec, kinds=kinds)

