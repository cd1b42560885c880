"""bench/convergence/cnn.py (ResNet-32 on digits at CIFAR shapes) and bench/convergence/compare.py's CNN paths."""

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kaisa.train.models import resnet32

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cnn", ROOT / "bench" / "convergence" / "cnn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cnn"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_bench_cnn_smoke(tmp_path: Path) -> None:
    module = _load()
    out = tmp_path / "cnn.json"
    only = "adamw@0.003,adamw@0.03,muon,soap,kfac,ekfac@0.01"
    payload = module.main(["--tiny", "--steps", "2", "--only", only, "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == payload["summary"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert payload["data"] == {"train_images": 1437, "validation_images": 360,
                               "shape": [3, 8, 8]}
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == only.split(",")
    initial = {(r["curve"][0]["val_loss"], r["curve"][0]["val_accuracy"])
               for r in results.values()}
    assert len(initial) == 1  # same initial weights everywhere
    for result in results.values():
        assert [p["step"] for p in result["curve"]] == [0, 1, 2]
        assert 0.0 <= result["final_val_accuracy"] <= 1.0
        assert result["time_ratio_to_adamw"] > 0
    assert results["kfac"]["coverage"]["registered_share_of_elements"] > 0.99
    assert payload["summary"]["best_adamw"] in ("adamw@0.003", "adamw@0.03")


def test_digits_at_cifar_shapes_batches_by_seed_and_step() -> None:
    digits = _load().Digits(size=32, batch=16, seed=3)
    assert digits.train_x.shape == (1437, 3, 32, 32) and digits.val_x.shape == (360, 3, 32, 32)
    assert abs(float(digits.train_x.mean())) < 1e-5
    assert abs(float(digits.train_x.std()) - 1.0) < 1e-5
    x, y = digits.batch(7)
    again, _ = digits.batch(7)
    assert torch.equal(x, again) and len(set(y.tolist())) > 1
    assert not torch.equal(x, digits.batch(8)[0])
    other = _load().Digits(size=32, batch=16, seed=4)
    assert not torch.equal(digits.val_x, other.val_x)  # the split follows the seed


def _run(name: str) -> tuple[torch.nn.Module, object]:
    module = _load()
    torch.manual_seed(0)
    model = resnet32()
    run = sys.modules["compare"].Run(name, model, 10, module.RECIPE)
    return model, run


def test_muon_steps_the_conv_filters_through_flat_views() -> None:
    model, run = _run("muon@0.05")
    conv = model.layers[0].conv1.weight
    before, fc = conv.detach().clone(), model.fc.weight.detach().clone()
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    run.step(5, x, y)  # type: ignore[attr-defined]
    muon, adamw = run.optimizers  # type: ignore[attr-defined]
    flat = muon.param_groups[0]["params"]
    assert len(flat) == 31 and all(v.ndim == 2 for v in flat)  # every conv of ResNet-32
    assert any(v.data_ptr() == conv.data_ptr() for v in flat)  # views of the filters
    assert not torch.equal(conv, before) and not torch.equal(model.fc.weight, fc)
    assert model.fc.weight in adamw.param_groups[0]["params"]
    assert all(p.grad is None for p in model.parameters())  # cleared after the step
    # the step is Muon's: orthogonalised momentum of the flattened gradient
    torch.manual_seed(0)
    model2 = resnet32()
    loss = F.cross_entropy(model2(x), y)
    loss.backward()
    grad = model2.layers[0].conv1.weight.grad
    assert grad is not None
    reference = torch.optim.Muon([torch.nn.Parameter(before.view(16, -1).clone())], lr=0.05,
                                 weight_decay=0.1)
    torch.nn.utils.clip_grad_norm_(model2.parameters(), 1.0)
    reference.param_groups[0]["params"][0].grad = grad.view(16, -1)
    factor = sys.modules["compare"].lr_factor(5, 10)
    reference.param_groups[0]["lr"] = 0.05 * factor
    reference.step()
    expected = reference.param_groups[0]["params"][0].detach().view_as(conv)
    torch.testing.assert_close(conv.detach(), expected)


def test_soap_flattens_conv_filters() -> None:
    model, run = _run("soap")
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    run.step(0, x, y)  # type: ignore[attr-defined]
    state = run.optimizers[0].state  # type: ignore[attr-defined]
    conv = model.layers[5].conv1.weight  # 32 x 16 x 3 x 3
    assert state[conv]["QL"].shape == (32, 32) and state[conv]["QR"].shape == (144, 144)
    assert "QL" not in state[model.bn1.weight]  # vectors: plain Adam
