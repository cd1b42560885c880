"""Curvature blocks: one :class:`~kaisa.blocks.base.CurvatureBlock` kind per layer kind.

Each kind is a subclass for one module type (or a few). Adding a kind (Embedding, ...) is
one new module plus one entry in :data:`BLOCK_KINDS`. A kind may make several named blocks
of one module (:meth:`~kaisa.blocks.base.CurvatureBlock.build`: an
``nn.MultiheadAttention`` gives its in- and out-projections). The package also owns what
the blocks compute with: the per-batch factors of each layer kind
(:mod:`kaisa.blocks.factors`), where a block is observed (:mod:`kaisa.blocks.callsites`:
module hooks, or the ``F.linear`` calls inside a module's forward) and the balanced
Kronecker product of a tied parameter's uses (:mod:`kaisa.blocks.kronecker`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection, Sequence

import torch
from torch import nn

from kaisa.blocks.attention import AttentionBlock, cross_attention_modules
from kaisa.blocks.base import (
    BatchStatistics,
    BlockOptions,
    CurvatureBlock,
    KFACLayer,
    RunningFactors,
)
from kaisa.blocks.conv2d import Conv1dBlock, Conv2dBlock
from kaisa.blocks.embedding import EmbeddingBlock
from kaisa.blocks.experts import ExpertBlock, RouterBlock
from kaisa.blocks.linear import LinearBlock
from kaisa.blocks.preconditioned import Preconditioned
from kaisa.blocks.scale_shift import ScaleShiftBlock
from kaisa.blocks.tied import TiedEmbeddingBlock, tied_heads
from kaisa.blocks.transposed import TransposedLinearBlock
from kaisa.utils.enums import KFACApprox

__all__ = [
    "BLOCK_KINDS",
    "AttentionBlock",
    "BatchStatistics",
    "BlockOptions",
    "Conv1dBlock",
    "Conv2dBlock",
    "CurvatureBlock",
    "EmbeddingBlock",
    "ExpertBlock",
    "KFACLayer",
    "LinearBlock",
    "Preconditioned",
    "RouterBlock",
    "RunningFactors",
    "ScaleShiftBlock",
    "TiedEmbeddingBlock",
    "TransposedLinearBlock",
    "register_blocks",
]

#: Block kinds, tried in order with :meth:`~kaisa.blocks.base.CurvatureBlock.matches`.
BLOCK_KINDS: tuple[type[CurvatureBlock], ...] = (
    LinearBlock, TransposedLinearBlock, ExpertBlock, RouterBlock, Conv2dBlock, Conv1dBlock,
    EmbeddingBlock, ScaleShiftBlock, AttentionBlock,
)


def register_blocks(
    model: nn.Module,
    *,
    skip: Sequence[re.Pattern[str]] = (),
    factor_dtype: torch.dtype | None = None,
    kfac_approx: KFACApprox = KFACApprox.EXPAND,
    kinds: Sequence[str] | None = None,
    cross_attention: tuple[re.Pattern[str], ...] | None = None,
    cross_modules: Collection[int] = (),
    factor_rows: int | None = None,
    row_generator: torch.Generator | None = None,
    max_dense_dim: int | None = None,
) -> dict[str, CurvatureBlock]:
    """Wraps every supported, trainable module of ``model`` not matched by ``skip``.

    Args:
        model: The model.
        skip: Patterns matched with ``re.search`` against module names, class names and
            block names.
        factor_dtype: Factor dtype of every block (``None``: the activations', >= fp32).
        kfac_approx: Expand or reduce over the shared dimensions of sequence inputs.
        kinds: The kind names to register (``None``: every kind).
        cross_attention: Names of the ``nn.MultiheadAttention`` in the cross-attention
            layout (``None``: every ``nn.TransformerDecoderLayer.multihead_attn``).
        cross_modules: The ``id`` of further MHAs in the cross-attention layout (those
            whose first call had a query, key and value that are not one tensor).
        factor_rows: Rows each call of a Linear, attention or embedding block (tied or
            not) keeps for its statistics (a random subset; ``None``: every row).
        row_generator: The CPU generator of the row subsets (needed with ``factor_rows``).
        max_dense_dim: Linear and attention blocks keep each side larger than this as its
            diagonal (``None``: every side dense).

    Returns:
        ``name -> block`` in model order (a module may give several blocks). A block is
        registered when every parameter it covers is trainable and no pattern finds its
        name; blocks sharing a parameter are registered together or not at all. The
        ``out_proj`` of an ``nn.MultiheadAttention`` is never a block of its own.
        Unsupported variants of a known module type are skipped with a warning that
        says why. A module of a kind that does not cover tied weights
        (:attr:`~CurvatureBlock.covers_tied`: embeddings) whose weight another module
        also holds is skipped: that module's block covers the weight, or, when none
        does, it is first-order with a warning.
    """
    claimed = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    cross = cross_attention_modules(model, cross_attention) | set(cross_modules)
    names = {id(m): n for n, m in model.named_modules()}
    pairs = tied_heads(model)  # the head of a tied pair is never a block of its own
    claimed |= {id(head) for _, head in pairs.values()}
    tied_on = kinds is None or EmbeddingBlock.kind in kinds
    users: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(name)
    tied: dict[str, tuple[int, list[str]]] = {}  # name -> (weight id, its other users)
    blocks: dict[str, CurvatureBlock] = {}
    for name, module in model.named_modules():
        pair = pairs.get(id(getattr(module, "weight", None)))
        if pair is not None and pair[0] is module:
            if tied_on:
                options = BlockOptions(factor_dtype, kfac_approx, factor_rows=factor_rows,
                                       row_generator=row_generator, max_dense_dim=max_dense_dim)
                blocks.update(_tied(name, pair, names[id(pair[1])], skip, options))
            continue
        kind = next((k for k in BLOCK_KINDS if k.matches(module)), None)
        if kind is None or (kinds is not None and kind.kind not in kinds) or id(module) in claimed:
            continue
        cls_name = type(module).__name__
        if any(r.search(name) or r.search(cls_name) for r in skip):
            continue
        options = BlockOptions(factor_dtype, kfac_approx, cross_attention=id(module) in cross,
                               factor_rows=factor_rows, row_generator=row_generator,
                               max_dense_dim=max_dense_dim)
        made = _kept(kind.build(name, module, options), skip)
        if not made:
            continue
        reason = kind.supports(module)
        if reason is not None:
            warnings.warn(
                f"kaisa: not registering {name!r}: {reason}", RuntimeWarning, stacklevel=3
            )
            continue
        weight = getattr(module, "weight", None)
        others = [n for n in users.get(id(weight), []) if n != name]
        if others and not kind.covers_tied:
            tied[name] = (id(weight), others)
            continue
        blocks.update(made)
    covered = {id(p) for block in blocks.values() for p in block.parameters()}
    for name, (weight_id, others) in tied.items():
        if weight_id not in covered:
            warnings.warn(
                f"kaisa: not registering {name!r}: its weight is tied to {others} (a tied "
                "weight is one block over every use, not defined for this kind yet); it is "
                "first-order", RuntimeWarning, stacklevel=3,
            )
    return blocks


def _tied(
    name: str, pair: tuple[nn.Embedding, nn.Linear], head_name: str,
    skip: Sequence[re.Pattern[str]], options: BlockOptions,
) -> dict[str, CurvatureBlock]:
    """The tied block of an embedding and its head (none when skipped or unsupported)."""
    embedding, head = pair
    for n, m in ((name, embedding), (head_name, head)):
        if any(r.search(n) or r.search(type(m).__name__) for r in skip):
            return {}
    if not embedding.weight.requires_grad:
        return {}
    reason = TiedEmbeddingBlock.supports(embedding)
    if reason is not None:
        warnings.warn(f"kaisa: not registering {name!r} (tied to {head_name!r}): {reason}",
                      RuntimeWarning, stacklevel=4)
        return {}
    return {name: TiedEmbeddingBlock(name=name, module=embedding, head=head,
                                     factor_dtype=options.factor_dtype, options=options)}


def _kept(
    made: dict[str, CurvatureBlock], skip: Sequence[re.Pattern[str]]
) -> dict[str, CurvatureBlock]:
    """The blocks of one module that are trainable and not skipped, sharing all or none."""
    dropped = {
        name for name, block in made.items()
        if any(r.search(name) for r in skip)
        or not all(p.requires_grad for p in block.parameters())
    }
    while True:
        gone = {id(p) for name in dropped for p in made[name].parameters()}
        more = {name for name, block in made.items()
                if name not in dropped and any(id(p) in gone for p in block.parameters())}
        if not more:
            return {name: block for name, block in made.items() if name not in dropped}
        dropped |= more
