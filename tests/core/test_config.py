"""The configuration: one dataclass, the constructor's keywords and defaults."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import kaisa
from kaisa.core.config import KFACConfig


def test_constructor_signature_is_the_config() -> None:
    params = inspect.signature(kaisa.KFACPreconditioner.__init__).parameters
    keywords = [p for p in params if p not in ("self", "model")]
    assert tuple(keywords) == KFACConfig.keywords()
    defaults = KFACConfig()
    for name in keywords:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        got = getattr(defaults, name)
        want = params[name].default
        if name == "skip_layers":
            assert want is None and got == ()
        else:
            assert got == want, name


def test_enums_stay_enums_and_strings_are_parsed() -> None:
    cfg = KFACConfig(compute_method="INVERSE", assignment_strategy="memory",
                     grad_worker_fraction="hybrid-opt", skip_layers="fc")
    assert cfg.compute_method is kaisa.ComputeMethod.INVERSE
    assert cfg.assignment_strategy is kaisa.AssignmentStrategy.MEMORY
    assert cfg.grad_worker_fraction is kaisa.DistributedStrategy.HYBRID_OPT
    assert cfg.skip_layers == ("fc",) and cfg.skip_patterns[0].pattern == "fc"
    pre = kaisa.KFACPreconditioner(nn.Linear(3, 2), compute_method="inverse")
    assert pre.config.compute_method is kaisa.ComputeMethod.INVERSE
    assert pre.config.inv_dtype is torch.float32


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"damping": 0.0}, "damping"),
    ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"compute_method": "svd"}, "compute_method"),
    ({"skip_layers": "("}, "skip_layers"),
])
def test_invalid_values_name_the_argument(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        KFACConfig(**kwargs)  # type: ignore[arg-type]
