"""Model zoo of the ``kaisa-train`` app, also used by the benchmarks and the tests.

It needs only torch (not the app's ``train`` extra), and the ``kaisa`` library never
imports it. Every model is built from ``nn.Linear``/``nn.Conv2d`` layers that a K-FAC
preconditioner can precondition. Use the factory functions directly
(``resnet32(num_classes=10)``) or :func:`build_model` by name.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kaisa.train.models.cnn import SmallCNN, cnn
from kaisa.train.models.gpt import GPT, gpt
from kaisa.train.models.mlp import MLP, Autoencoder, autoencoder, mlp
from kaisa.train.models.resnet import BasicBlock, CifarResNet, resnet20, resnet32, resnet56
from kaisa.train.models.resnet_imagenet import Bottleneck, ResNet50, resnet50
from kaisa.train.models.transformer import PatchTransformer, SelfAttention, transformer

__all__ = [
    "GPT",
    "MODELS",
    "MLP",
    "Autoencoder",
    "BasicBlock",
    "Bottleneck",
    "CifarResNet",
    "PatchTransformer",
    "ResNet50",
    "SelfAttention",
    "SmallCNN",
    "TEXT_MODELS",
    "autoencoder",
    "build_model",
    "cnn",
    "gpt",
    "mlp",
    "resnet20",
    "resnet32",
    "resnet50",
    "resnet56",
    "transformer",
]

_Builder = Callable[[int, int, int], nn.Module]

_BUILDERS: dict[str, _Builder] = {
    "mlp": lambda c, s, k: mlp(input_dim=c * s * s, num_classes=k),
    "cnn": lambda c, s, k: cnn(in_channels=c, image_size=s, num_classes=k),
    "autoencoder": lambda c, s, k: autoencoder(input_dim=c * s * s),
    "resnet20": lambda c, s, k: resnet20(num_classes=k, in_channels=c),
    "resnet32": lambda c, s, k: resnet32(num_classes=k, in_channels=c),
    "resnet56": lambda c, s, k: resnet56(num_classes=k, in_channels=c),
    "resnet50": lambda c, s, k: resnet50(num_classes=k, in_channels=c),
    "transformer": lambda c, s, k: transformer(in_channels=c, image_size=s, num_classes=k),
    "gpt": lambda c, s, k: gpt(),  # byte-level; kaisa-train sizes it from --context/--d-model
}

#: Models over byte ids ``(N, T)`` (``--task lm``); ``build_model`` builds them with defaults.
TEXT_MODELS: tuple[str, ...] = ("gpt",)

#: Names of the image/feature models accepted by :func:`build_model` (plus :data:`TEXT_MODELS`).
MODELS: tuple[str, ...] = tuple(name for name in _BUILDERS if name not in TEXT_MODELS)

#: Models that take flat ``(N, input_dim)`` inputs rather than images.
FLAT_MODELS: frozenset[str] = frozenset({"mlp", "autoencoder"})


def build_model(
    name: str,
    *,
    in_channels: int = 1,
    image_size: int = 8,
    num_classes: int = 10,
    input_dim: int | None = None,
) -> nn.Module:
    """Build a model by name.

    Args:
        name: One of :data:`MODELS` or :data:`TEXT_MODELS`.
        in_channels: Image channels (1 for digits, 3 for CIFAR-10).
        image_size: Image height and width.
        num_classes: Output classes (ignored by ``autoencoder``).
        input_dim: Flat input size for ``mlp``/``autoencoder``; defaults to
            ``in_channels * image_size**2``.

    Returns:
        The freshly initialised model.

    Raises:
        ValueError: If ``name`` is not a known model.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(_BUILDERS)}")
    if input_dim is not None and name in FLAT_MODELS:
        if name == "mlp":
            return mlp(input_dim=input_dim, num_classes=num_classes)
        return autoencoder(input_dim=input_dim)
    return _BUILDERS[name](in_channels, image_size, num_classes)
