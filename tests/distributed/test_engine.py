"""Unit tests of the distributed engine with a scripted communicator (no torch.distributed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisa.blocks import CurvatureBlock, register_blocks
from kaisa.core.config import KFACConfig
from kaisa.distributed import DistributedEngine, LocalCommunicator
from kaisa.methods import SecondOrderMethod, make_method
from tests.support.explicit import kron_solve
from tests.support.fakes import Call, FakeCommunicator

pytestmark = pytest.mark.usefixtures("float64")

DAMPING = 0.01


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n + 3, generator=g)
    return (x @ x.T / n + 0.1 * torch.eye(n)).unsqueeze(0)


def _setup(
    method_name: str = "inverse", **config: object
) -> tuple[dict[str, CurvatureBlock], KFACConfig, SecondOrderMethod]:
    torch.manual_seed(0)
    # factor sizes all distinct (A: 5, 8, 4; G: 7, 3, 2): the scripted peer finds by shape
    model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 3), nn.Linear(3, 2))
    cfg = KFACConfig(compute_method=method_name, inv_dtype=torch.float64, **config)
    method = make_method(cfg.compute_method, outer_product=cfg.compute_eigenvalue_outer_product)
    layers = register_blocks(model)
    for i, layer in enumerate(layers.values()):
        layer.method = method
        a_dim, g_dim = layer.dims
        layer.factors.a, layer.factors.g = _spd(a_dim, 2 * i), _spd(g_dim, 2 * i + 1)
        layer.weight.grad = torch.randn_like(layer.weight)
        if layer.bias is not None:
            layer.bias.grad = torch.randn_like(layer.bias)
    return layers, cfg, method


def _precondition(
    engine: DistributedEngine, layers: dict[str, CurvatureBlock]
) -> list[tuple[CurvatureBlock, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The engine's results for the layers' ``.grad`` as ``(layer, grad, P, valid)``."""
    grads = {name: layer.gradient_matrix() for name, layer in layers.items()}
    out = engine.precondition({n: g for n, g in grads.items() if g is not None}, DAMPING)
    return [(e.block, e.grad, e.direction, e.valid) for e in out]


def _explicit(layer: CurvatureBlock) -> torch.Tensor:
    """(G + damping I)^-1 grad (A + damping I)^-1: the inverse method's damping."""
    grad = layer.gradient_matrix()
    assert grad is not None and layer.a is not None and layer.g is not None
    eye_a, eye_g = torch.eye(layer.a.shape[-1]), torch.eye(layer.g.shape[-1])
    a_inv = torch.linalg.inv(layer.a[0] + DAMPING * eye_a)
    g_inv = torch.linalg.inv(layer.g[0] + DAMPING * eye_g)
    return (g_inv @ grad[0] @ a_inv).unsqueeze(0)


def test_single_rank_is_the_same_path_with_a_local_communicator() -> None:
    layers, cfg, method = _setup("eigen", kl_clip=None)
    engine = DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=LocalCommunicator())
    assert engine.world_size == 1 and all(engine.is_grad_worker(n) for n in layers)
    engine.update_decompositions(DAMPING)
    out = _precondition(engine, layers)
    assert [entry[0].name for entry in out] == list(layers)  # model order
    for layer, grad, precond, valid in out:
        assert valid is None
        assert layer.a is not None and layer.g is not None
        want = kron_solve(layer.g[0], layer.a[0], grad[0], DAMPING)
        torch.testing.assert_close(precond[0], want, rtol=1e-9, atol=1e-9)


def test_comm_opt_rank_decomposes_its_share_and_installs_what_it_receives() -> None:
    layers, cfg, method = _setup("inverse", grad_worker_fraction="comm_opt")
    by_name = {name: layer for name, layer in layers.items()}

    def peer(call: Call, buf: torch.Tensor) -> None:
        # rank 1 sends the true damped inverse of the factor with that shape
        for layer in by_name.values():
            for f in (layer.a, layer.g):
                assert f is not None
                if tuple(f.shape) == call.shape:
                    eye = torch.eye(f.shape[-1])
                    buf.copy_(torch.linalg.inv(f[0] + DAMPING * eye).unsqueeze(0))
                    return
        raise AssertionError(f"unexpected payload shape {call.shape}")

    comm = FakeCommunicator(rank=0, world_size=2, peer=peer)
    engine = DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=comm)
    computed_here = engine.placement.computed_by(0)
    assert 0 < len(computed_here) < 2 * len(layers)  # both ranks have work
    engine.update_decompositions(DAMPING)
    sent = comm.sent("decompositions")
    assert len(sent) == len(computed_here)
    assert all(c.group == (0, 1) and not c.symmetric for c in sent)
    for layer, grad, precond, valid in _precondition(engine, layers):
        assert valid is None  # every rank is a gradient worker: nothing received
        torch.testing.assert_close(precond, _explicit(layer), rtol=1e-8, atol=1e-8)
        assert grad.shape == precond.shape


def test_failed_source_without_a_result_leaves_the_layer_unpreconditioned() -> None:
    layers, cfg, method = _setup("inverse")
    comm = FakeCommunicator(rank=0, world_size=2, peer=lambda c, b: b.fill_(float("nan")))
    engine = DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=comm)
    engine.update_decompositions(DAMPING)
    remote = {name for name, _ in engine.placement.computed_by(1)}
    for name, layer in layers.items():
        assert layer.has_decomposition() == (name not in remote)
    out = {entry[0].name for entry in _precondition(engine, layers)}
    assert out == set(layers) - remote


@pytest.mark.parametrize(("method_name", "symmetric"), [("inverse", True), ("eigen", False)])
def test_symmetry_aware_marks_only_symmetric_payloads(method_name: str, symmetric: bool) -> None:
    layers, cfg, method = _setup(method_name, symmetry_aware=True)
    comm = FakeCommunicator(rank=1, world_size=2, peer=lambda c, b: b.copy_(_identity_like(b)))
    DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=comm).update_decompositions(DAMPING)
    calls = [c for c in comm.calls if c.kind == "decompositions"]
    assert calls
    # eigen sends [Q, d] (never symmetric); inverse sends [F^-1] (symmetric)
    assert {c.symmetric for c in calls} == {symmetric}


def _identity_like(buf: torch.Tensor) -> torch.Tensor:
    if buf.dim() == 3:
        return torch.eye(buf.shape[-1]).expand_as(buf)
    return torch.ones_like(buf)


def test_mem_opt_receives_gradients_of_layers_it_does_not_own() -> None:
    layers, cfg, method = _setup("inverse", grad_worker_fraction="mem_opt")

    def peer(call: Call, buf: torch.Tensor) -> None:
        assert call.kind == "gradients" and call.src == 1
        buf.fill_(3.0)  # the preconditioned gradient, and a valid flag (> 0) last

    comm = FakeCommunicator(rank=0, world_size=2, peer=peer)
    engine = DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=comm)
    engine.update_decompositions(DAMPING)
    assert not [c for c in comm.calls if c.kind == "decompositions" and len(c.group) > 1]
    out = _precondition(engine, layers)
    assert [entry[0].name for entry in out] == list(layers)
    owned = set(engine.placement.held_by(0))
    assert owned and owned != set(layers)
    for layer, grad, precond, valid in out:
        assert valid is not None
        if layer.name in owned:
            torch.testing.assert_close(precond, _explicit(layer), rtol=1e-8, atol=1e-8)
        else:
            assert torch.equal(precond, torch.full_like(grad, 3.0)) and bool(valid)
    sent = comm.sent("gradients")
    assert len(sent) == len(owned)
    assert all(c.shape == (layers[n].gradient_matrix().numel() + 1,)  # type: ignore[union-attr]
               for c, n in zip(sent, [n for n in layers if n in owned], strict=True))


def test_factor_allreduce_starts_once_per_layer_with_statistics() -> None:
    layers, cfg, method = _setup("eigen")
    comm = FakeCommunicator(rank=0, world_size=2)
    engine = DistributedEngine(layers, cfg.engine_config(torch.float64), method, communicator=comm)
    first, second, third = layers.values()
    first.stats.add_a(torch.ones(1, 5, 5))
    first.stats.add_a(3 * torch.ones(1, 5, 5))
    first.stats.add_g(torch.ones(1, 7, 7))
    third.stats.add_g(torch.ones(1, 2, 2))
    engine.layer_done(first)
    engine.layer_done(first)  # already started: nothing new
    assert len([c for c in comm.calls if c.op == "allreduce"]) == 2
    averaged = engine.averaged_factors()  # starts the rest (third; second has nothing)
    assert set(averaged) == {first.name, third.name}
    a, _ = averaged[first.name]
    assert a is not None and torch.equal(a, 2 * torch.ones(1, 5, 5))  # mean of micro-batches
    assert averaged[third.name][0] is None and averaged[third.name][1] is not None
    assert second.name not in averaged
    assert not first.stats.has_factors and comm.flushes >= 1
