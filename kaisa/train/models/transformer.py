"""Small Transformer encoder classifier over image patches.

Attention is built from plain ``nn.Linear`` query/key/value/output projections
(not ``nn.MultiheadAttention``) so a K-FAC preconditioner sees every weight.
All Linear layers receive 3-D ``(N, tokens, features)`` inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention from four Linear layers."""

    def __init__(self, *, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        return x.view(n, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the token axis of ``x`` (``(N, T, dim)``)."""
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class EncoderBlock(nn.Module):
    """Pre-LayerNorm Transformer block: attention then a GELU MLP."""

    def __init__(self, *, dim: int, heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim=dim, heads=heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(N, T, dim)``."""
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))  # type: ignore[no-any-return]


class PatchTransformer(nn.Module):
    """Split images into square patches, embed them and classify the mean token."""

    def __init__(
        self,
        *,
        in_channels: int = 1,
        image_size: int = 8,
        num_classes: int = 10,
        patch_size: int = 2,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be divisible by patch_size ({patch_size})"
            )
        self.patch_size = patch_size
        tokens = (image_size // patch_size) ** 2
        self.embed = nn.Linear(in_channels * patch_size**2, dim)
        self.position = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.Sequential(*(EncoderBlock(dim=dim, heads=heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """Reshape ``(N, C, H, W)`` images into ``(N, tokens, C * patch_size**2)``."""
        p = self.patch_size
        return F.unfold(x, kernel_size=p, stride=p).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for images ``x`` of shape ``(N, C, H, W)``."""
        tokens = self.embed(self.patches(x)) + self.position
        tokens = self.norm(self.blocks(tokens))
        return self.head(tokens.mean(dim=1))  # type: ignore[no-any-return]


def transformer(
    *,
    in_channels: int = 1,
    image_size: int = 8,
    num_classes: int = 10,
    patch_size: int | None = None,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
) -> PatchTransformer:
    """Build the patch Transformer; ``patch_size`` defaults to ``image_size // 4``."""
    return PatchTransformer(
        in_channels=in_channels,
        image_size=image_size,
        num_classes=num_classes,
        patch_size=patch_size or max(1, image_size // 4),
        dim=dim,
        depth=depth,
        heads=heads,
    )
