"""kaisa.utils.profiling: timed regions, and the opt-in profile of exclusive seconds by phase."""

from __future__ import annotations

import time

import pytest
import torch

import kaisa
from kaisa.train.models import autoencoder
from kaisa.utils import profiling
from kaisa.utils.profiling import PhaseProfile, phase, timed


def test_phase_is_a_shared_no_op_without_a_profile() -> None:
    assert phase("a") is phase("b")  # nothing allocated, nothing recorded
    timings: dict[str, float] = {}
    with timed(timings, "x"):
        time.sleep(0.001)
    assert timings["x"] >= 0.001  # the owner's timing is kept with or without a profile
    with timed(timings, "x"):
        pass
    assert list(timings) == ["x"]


class _Clock:
    """A fake ``perf_counter``: ``advance`` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_exclusive_seconds_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    timings = {"inner": 0.0}
    with PhaseProfile() as profile, phase("outer"):
        clock.advance(2.0)
        with timed(timings, "inner"):
            clock.advance(4.0)
        with phase("inner"):
            clock.advance(0.5)
        clock.advance(1.0)
    assert profile.seconds == {("outer",): 3.0, ("outer", "inner"): 4.5}
    assert profile.calls == {("outer",): 1, ("outer", "inner"): 2}
    assert timings == {"inner": 4.0}
    assert profile.by_phase() == {"outer": 3.0, "inner": 4.5}
    assert phase("after") is phase("again")  # off again once the profile ends


def test_profiles_do_not_nest() -> None:
    with PhaseProfile(), pytest.raises(RuntimeError, match="already active"), PhaseProfile():
        pass
    assert profiling._active is None


def test_ranges_show_in_a_torch_profile() -> None:
    with torch.profiler.profile() as prof, PhaseProfile(ranges=True), phase("kaisa_test_range"):
        torch.ones(3).sum()
    assert any(e.name == "kaisa_test_range" for e in prof.events())


def test_kfac_step_phases() -> None:
    torch.manual_seed(0)
    model = autoencoder(input_dim=8, hidden_dims=(6, 4)).double()
    kfac = kaisa.KFAC(model, loss="mse")
    x = torch.randn(16, 8, dtype=torch.float64)
    with PhaseProfile() as profile:
        kfac.step(lambda: (model(x), x))
    names = {path[-1] for path in profile.seconds}
    assert {"loss_and_grad", "forward", "curvature_backward", "backward", "factors",
            "precondition", "decompositions", "preconditioning", "quadratic_model",
            "update", "damping"} <= names
    assert ("loss_and_grad", "forward", "factors") in profile.seconds  # A in the forward hook
    assert ("loss_and_grad", "curvature_backward", "factors") in profile.seconds  # G
    assert all(v >= 0 for v in profile.seconds.values())
    assert kfac.timings["quadratic_model"] > 0 and kfac.curvature.timings["factors"] > 0
