"""``nn.MultiheadAttention``: Linear blocks on the products attention computes.

MHA multiplies by its weights inside ``F.multi_head_attention_forward`` without calling
its ``out_proj`` module, so its blocks are observed through functional call sites
(:mod:`kaisa.blocks.callsites`): the ``F.linear`` calls made while the MHA's forward runs. The
blocks of one MHA named ``<mha>`` (``docs/conventions.md``, "``nn.MultiheadAttention``
blocks"):

* self-attention layout, packed weight: ``<mha>.in_proj`` on ``in_proj_weight``
  (``3E x E``) and ``in_proj_bias``, observed at the packed product ``[q | k | v]``;
* cross-attention layout, packed weight: ``<mha>.q_proj``, ``.k_proj``, ``.v_proj`` on
  rows ``0:E``, ``E:2E``, ``2E:3E`` of both (a product of rows ``E:3E``, torch's when the
  key is the value, feeds the k and v blocks, each with its features of the output
  gradient);
* separate weights (``kdim``/``vdim`` not ``E``): ``<mha>.q_proj``, ``.k_proj``,
  ``.v_proj`` on ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``, with rows
  ``0:E``, ``E:2E``, ``2E:3E`` of ``in_proj_bias``;
* ``<mha>.out_proj`` on ``out_proj.weight`` and ``out_proj.bias``.

Observations inside ``F.multi_head_attention_forward`` arrive sequence-first,
``(positions, N, features)`` (``out_proj``'s flattened rows put back), so
``kfac_approx='reduce'`` averages (sums) over dimension 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks.base import BlockOptions, CurvatureBlock
from kaisa.blocks.callsites import CallSite
from kaisa.blocks.linear import LinearBlock
from kaisa.utils.enums import KFACApprox

__all__ = ["AttentionBlock", "cross_attention_modules", "undecided_attention"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class AttentionBlock(LinearBlock):
    """One projection of an ``nn.MultiheadAttention`` (a Linear block on its product).

    Args:
        name: The block's name (``<mha>.in_proj``, ``.q_proj``, ..., ``.out_proj``).
        module: The ``nn.MultiheadAttention``.
        weight: The weight parameter the product multiplies by.
        bias: The bias parameter, if any.
        rows: The rows of ``weight`` and ``bias`` the block covers (``None``: all).
        mismatch: What to warn when a call uses part of the block's rows only.
        factor_dtype: Factor dtype, ``None`` to follow the activations (>= fp32).
        kfac_approx: Expand or reduce over the positions.
    """

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = (
        nn.MultiheadAttention
    )
    kind = "attention"

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: tuple[slice | None, ...] | None = None,
        mismatch: str = "",
        factor_dtype: torch.dtype | None,
        kfac_approx: KFACApprox = KFACApprox.EXPAND,
    ) -> None:
        self._weight = weight
        self._bias = bias
        super().__init__(name=name, module=module, factor_dtype=factor_dtype,
                         kfac_approx=kfac_approx)
        self.rows = rows
        self._site = CallSite(module, weight=weight, rows=None if rows is None else rows[0],
                              mismatch=mismatch)

    @property
    def weight(self) -> torch.Tensor:
        """The weight parameter of the product."""
        return self._weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias parameter of the product, if any (``None`` without a bias column)."""
        return self._bias if self.bias_column else None

    def call_sites(self) -> tuple[CallSite, ...]:
        """The ``F.linear`` calls of the MHA's forward that multiply by the block's rows."""
        return (self._site,)

    #: Observations are sequence-first: the examples are dimension 1.
    _example_dim = 1

    def _shared_dims(self, t: torch.Tensor) -> tuple[int, ...]:
        """The positions: observations are ``(positions, N, features)``."""
        return (0,)

    @classmethod
    def build(
        cls, name: str, module: nn.Module, options: BlockOptions
    ) -> dict[str, CurvatureBlock]:
        """The in-projection block(s) then ``out_proj``'s (see the module docstring)."""
        assert isinstance(module, nn.MultiheadAttention)
        e = module.embed_dim
        bias = module.in_proj_bias
        blocks: dict[str, CurvatureBlock] = {}

        def add(suffix: str, weight: torch.Tensor, b: torch.Tensor | None,
                rows: tuple[slice | None, ...] | None = None, mismatch: str = "") -> None:
            block = cls(
                name=f"{name}.{suffix}", module=module, weight=weight, bias=b, rows=rows,
                mismatch=mismatch, factor_dtype=options.factor_dtype,
                kfac_approx=options.kfac_approx,
            )
            block.sample_rows(options)
            block.limit_dense(options.max_dense_dim)
            blocks[block.name] = block

        packed = module.in_proj_weight
        thirds = [slice(i * e, (i + 1) * e) for i in range(3)]
        if packed is None:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            for suffix, weight, part in zip(_PROJECTIONS, weights, thirds, strict=True):
                assert isinstance(weight, torch.Tensor)
                add(suffix, weight, bias, None if bias is None else (None, part))
        elif options.cross_attention:
            for suffix, part in zip(_PROJECTIONS, thirds, strict=True):
                add(suffix, packed, bias, (part,) if bias is None else (part, part))
        else:
            add("in_proj", packed, bias, mismatch=_mismatch_message(name))
        out = module.out_proj
        add("out_proj", out.weight, out.bias)
        return blocks


def cross_attention_modules(
    model: nn.Module, patterns: tuple[re.Pattern[str], ...] | None
) -> set[int]:
    """The ``id`` of every MHA of ``model`` in the cross-attention layout.

    Args:
        model: The model.
        patterns: ``None``: every ``nn.TransformerDecoderLayer.multihead_attn``; else the
            MHAs whose names one of the patterns finds (``re.search``).
    """
    if patterns is None:
        return {id(m.multihead_attn) for m in model.modules()
                if isinstance(m, nn.TransformerDecoderLayer)}
    return {id(m) for name, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention) and any(p.search(name) for p in patterns)}


def undecided_attention(blocks: Mapping[str, CurvatureBlock]) -> list[nn.MultiheadAttention]:
    """The MHAs registered in the self-attention layout (a block on the packed weight).

    Their first call decides: a query, key and value that are not one tensor make them
    cross-attention (:class:`kaisa.KFACCurvature` rebuilds their blocks).
    """
    return [b.module for b in blocks.values()
            if isinstance(b, AttentionBlock) and isinstance(b.module, nn.MultiheadAttention)
            and b.rows is None and b.weight is b.module.in_proj_weight]


def _mismatch_message(name: str) -> str:
    pattern = "^" + re.escape(name) + "$"
    return (
        f"kaisa: nn.MultiheadAttention {name!r} has the self-attention layout (one block "
        "on its packed in-projection: its first call had one tensor as query, key and "
        "value, or cross_attention patterns left it out) but was called with a query, key "
        "and value that are not one tensor: its in-projection records nothing in such "
        f"calls. Declare it cross-attention with cross_attention=[{pattern!r}] "
        "(KFACPreconditioner, kaisa.KFAC, kaisa.EKFAC, KFACConfig; patterns replace the "
        "detection at the first call)"
    )
