import pytest
import torch
from torch import nn

import kaisa.train.models as models


@pytest.mark.parametrize("name", models.MODELS)
def test_build_model_digits_shapes(name: str) -> None:
    model = models.build_model(name, in_channels=1, image_size=8, num_classes=10)
    out = model(torch.rand(3, 1, 8, 8))
    assert out.shape == ((3, 64) if name == "autoencoder" else (3, 10))


@pytest.mark.parametrize("name", ["resnet20", "resnet32", "transformer", "cnn", "mlp"])
def test_build_model_cifar_shapes(name: str) -> None:
    model = models.build_model(name, in_channels=3, image_size=32, num_classes=7)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 7)


def test_build_model_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*resnet32"):
        models.build_model("vgg")


def test_resnet32_plain_function_and_sizes() -> None:
    model = models.resnet32(num_classes=10)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    count = sum(p.numel() for p in model.parameters())
    assert 0.45e6 < count < 0.48e6
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 31  # 6n + 1 convolutions with option-A shortcuts (n = 5)
    with_b = models.resnet32(num_classes=10, shortcut="B")
    assert len([m for m in with_b.modules() if isinstance(m, nn.Conv2d)]) == 33
    assert len([m for m in models.resnet56().modules() if isinstance(m, nn.Conv2d)]) == 55


def test_resnet50_bottleneck() -> None:
    model = models.resnet50(num_classes=1000)
    assert model(torch.rand(1, 3, 64, 64)).shape == (1, 1000)
    count = sum(p.numel() for p in model.parameters())
    assert 25.5e6 < count < 25.6e6


def test_autoencoder_widths() -> None:
    model = models.autoencoder(input_dim=64)
    widths = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert [w[0] for w in widths] + [widths[-1][1]] == [64, 256, 128, 64, 16, 64, 128, 256, 64]
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 7
    assert models.build_model("autoencoder", input_dim=20)(torch.rand(4, 20)).shape == (4, 20)


def test_transformer_uses_linear_attention_on_3d_inputs() -> None:
    model = models.transformer(in_channels=1, image_size=8, num_classes=10)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    seen: list[int] = []
    hooks = [
        m.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0].dim()))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    model(torch.rand(2, 1, 8, 8))
    for hook in hooks:
        hook.remove()
    assert seen.count(3) >= 2 * 6  # q, k, v, out, fc1, fc2 per block
    assert len(seen) == 1 + 2 * 6 + 1


def test_constructors_are_keyword_only_and_validate() -> None:
    with pytest.raises(TypeError):
        models.mlp(64)  # type: ignore[misc]
    with pytest.raises(ValueError):
        models.cnn(image_size=7)
    with pytest.raises(ValueError):
        models.transformer(image_size=8, patch_size=3)
