"""ResNet-50 and BERT-Large as module skeletons for planning (built on the meta device).

They have the layer shapes of torchvision's ``resnet50`` and of BERT-Large (24 layers,
hidden 1024, 16 heads, FFN 4096, vocabulary 30522), with a forward pass, so the planner
records each layer's rows per batch on the meta device without any weights. They are
not the training app's models (the library never imports ``kaisa.train``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BertLarge", "ResNet50", "builtin_models"]


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        skip: torch.Tensor = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + skip)


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layer shapes (bottlenecks 3, 4, 6, 3; 1000 classes)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin = 64
        for i, (blocks, width, stride) in enumerate(
                ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)), start=1):
            layers = []
            for j in range(blocks):
                layers.append(_Bottleneck(cin, width, stride if j == 0 else 1))
                cin = 4 * width
            self.add_module(f"layer{i}", nn.Sequential(*layers))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of an image batch."""
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(x, 3, 2, 1)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class _BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (m(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for m in (self.query, self.key, self.value))
        att = nn.functional.scaled_dot_product_attention(q, k, v)
        x = self.norm1(x + self.attention_output(att.transpose(1, 2).reshape(b, s, h)))
        out: torch.Tensor = self.norm2(x + self.output(nn.functional.gelu(self.intermediate(x))))
        return out


class BertLarge(nn.Module):
    """BERT-Large's encoder and pre-training heads (the layers NVIDIA's BERT has)."""

    def __init__(self, *, layers: int = 24, hidden: int = 1024, heads: int = 16,
                 ffn: int = 4096, vocab: int = 30522, max_positions: int = 512) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.encoder = nn.ModuleList(_BertLayer(hidden, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.transform = nn.Linear(hidden, hidden)
        self.seq_relationship = nn.Linear(hidden, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Scores of a token batch (the values do not matter: shapes only)."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(pos)
        for layer in self.encoder:
            x = layer(x)
        # the tied decoder: a matmul with the embedding, no block of its own
        scores: torch.Tensor = self.transform(x) @ self.word_embeddings.weight.T
        heads: torch.Tensor = self.seq_relationship(torch.tanh(self.pooler(x[:, 0])))
        return scores[:, 0] + heads.sum()


def builtin_models() -> dict[str, tuple[type[nn.Module], str]]:
    """``name -> (class, input)``; the input is ``image`` (3x224x224) or ``tokens`` (512)."""
    return {"resnet50": (ResNet50, "image"), "bert-large": (BertLarge, "tokens")}
