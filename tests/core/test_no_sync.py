"""No step but the decomposing one reads a device tensor on the host.

On a GPU a host read (``item``, ``bool``, ``tolist`` of a CUDA tensor) waits for every
kernel queued before it, and a CUDA graph cannot contain one. The ``meta`` device stands
in for a GPU here: it has no data, so any host read of one of its tensors raises. A model
and its K-FAC state are moved there after a decomposing step on the CPU, then plain and
factor steps run: statistics in the hooks, the factor fold (skipped non-finite factors
included), the grouped preconditioning, the KL clip and the write-back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kaisa
from kaisa.blocks.state import RunningFactors


def _to_meta(pre: kaisa.KFACPreconditioner) -> None:
    for layer in pre.layers.values():
        f = layer.factors
        layer.factors = RunningFactors(
            *(None if t is None else t.to("meta") for t in (f.a, f.g, f.skipped_a, f.skipped_g)),
            diagonal_sides=f.diagonal_sides)
        layer.decomposition = {k: v.to("meta") for k, v in layer.decomposition.items()}


@pytest.mark.parametrize("kwargs", [{}, {"kl_clip": None}, {"compute_method": "inverse"},
                                    {"compute_eigenvalue_outer_product": False}])
def test_plain_and_factor_steps_never_read_the_device(kwargs: dict[str, object]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 1, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=100,
                                   **kwargs)  # type: ignore[arg-type]
    x = torch.randn(2, 3, 6, 6)
    model(x).square().sum().backward()
    pre.step()  # decomposes: reads the solver's status once (on the CPU here)
    model.zero_grad(set_to_none=True)
    model.to("meta")
    _to_meta(pre)
    for _ in range(3):  # plain, factor (fold), plain
        model.zero_grad()
        model(x.to("meta")).square().sum().backward()
        pre.step()
    assert pre.steps == 4
    weight = model[0].weight
    assert weight.grad is not None and weight.grad.device.type == "meta"
    assert all(layer.factors.a is not None and layer.factors.a.device.type == "meta"
               for layer in pre.layers.values())


def test_the_meta_device_refuses_host_reads() -> None:
    """What the test above relies on."""
    t = torch.ones(2, device="meta")
    for read in (lambda: t.tolist(), lambda: t[0].item(), lambda: bool(t[0] > 0)):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()
