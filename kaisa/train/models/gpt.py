"""Character-level (byte-level) GPT from ``nn.TransformerEncoderLayer`` blocks.

Tied input embedding and output head (``head.weight is embedding.weight``), learned
positions, pre-norm blocks (``norm_first=True``) under a causal mask and a final
LayerNorm. Inputs are byte ids ``(B, T)`` with ``T <= context``; outputs are logits
``(B, T, vocab_size)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class GPT(nn.Module):
    """Decoder-only Transformer over a byte vocabulary."""

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        context: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.context = context
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.zeros(1, context, d_model))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                n_heads,
                dim_feedforward=4 * d_model,
                dropout=dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)
        self.head.weight = self.embedding.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return next-byte logits ``(B, T, vocab_size)`` for ``tokens`` ``(B, T)``."""
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"sequence length {length} exceeds the context {self.context}")
        mask = nn.Transformer.generate_square_subsequent_mask(
            length, device=tokens.device, dtype=self.position.dtype
        )
        x = self.embedding(tokens) + self.position[:, :length]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def gpt(**kwargs: Any) -> GPT:
    """The byte-level GPT: :class:`GPT`'s keyword arguments (d 128, 4 layers, context 128)."""
    return GPT(**kwargs)
