"""What ``bench/step_cost/step_cost.py`` times: models, optimizers, steps and schedules.

Each task builds its :class:`Runner` list (a baseline and the K-FAC configurations
against it, every model from the same seed); ``bench/step_cost/step_cost.py``'s docstring says what
each configuration is and how it is timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import kaisa
from kaisa.train import models
from kaisa.train.models.gpt import gpt
from kaisa.utils.profiling import phase

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Runner:
    """One configuration: ``step(i)`` trains step ``i``; ``label(i)`` what its schedule does."""

    name: str
    baseline: str | None  # the configuration it is compared with (None: it is a baseline)
    step: Callable[[int], None]
    label: Callable[[int], str]
    period: int  # steps after which the labels repeat
    state_bytes: Callable[[], int] = lambda: 0
    times: dict[str, list[float]] = field(default_factory=dict)
    phases: dict[str, list[dict[tuple[str, ...], float]]] = field(default_factory=dict)


def schedule(**every: int) -> tuple[Callable[[int], str], int]:
    """Labels ``step -> letters`` of the events due at a step, and their common period."""
    return (lambda s: "".join(k for k, n in every.items() if s % n == 0) or "-",
            math.lcm(*every.values()))


def first_order_step(model: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     batches: list[Batch], optimizer: torch.optim.Optimizer,
                     pre: Any = None, *, kfac: bool = False) -> Callable[[int], None]:
    """A step of ``optimizer`` (after ``pre.step()``, the preconditioner's, if given).

    ``kfac``: the optimizer is kaisa's (its step's own remainder is overhead, not update).
    """
    name = "kfac_step" if kfac else "first_order"

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            value = loss(model(x), y)
        with phase("backward"):
            value.backward()  # type: ignore[no-untyped-call]
        if pre is not None:
            with phase("kfac_step"):
                pre.step()
        with phase(name):
            optimizer.step()

    return step


def kfac_step(model: nn.Module, batches: list[Batch], kfac: kaisa.KFAC) -> Callable[[int], None]:
    """A ``kaisa.KFAC`` step (its closure runs the forward pass)."""

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        kfac.step(lambda: (model(x), y))

    return step


def state_of(optimizer: Any) -> Callable[[], int]:
    """Bytes of K-FAC state (factors, decompositions, buffers)."""
    curvature = optimizer.curvature
    return lambda: int(curvature.memory_usage()["total"])


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


#: Suffix of a configuration whose conv A factors take the compiled CPU kernel
#: (``--conv-variants``): the ResNet rows as they were before ``kaisa.ops._shifted``.
COMPILED_CONV = " [compiled conv kernel]"


@contextmanager
def compiled_conv_kernel() -> Iterator[None]:
    """Conv A factors through the compiled kernel, not the shifted-correlation path.

    Patches the private dispatch predicate of :func:`kaisa.ops.conv_covariance` for the
    duration (a benchmark-only switch: the same-run "before" of that change).
    """
    saved = kaisa.ops._shifted_path
    kaisa.ops._shifted_path = lambda *args: False
    try:
        yield
    finally:
        kaisa.ops._shifted_path = saved


def resnet_runners(smoke: bool, conv_variants: bool = False) -> list[Runner]:
    """SGD and two KFACPreconditioner schedules on ResNet-32.

    ``conv_variants``: each K-FAC schedule also with the compiled conv kernel.
    """
    batch, side = (4, 8) if smoke else (128, 32)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, 3, side, side, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen)) for _ in range(4)]
    runners = []
    configs: list[tuple[str, tuple[int, int] | None, bool]] = [("sgd", None, False)]
    for name, period in (("kfac_pre 10/100 + sgd", (10, 100)), ("kfac_pre 1/10 + sgd", (1, 10))):
        configs.append((name, period, False))
        if conv_variants:
            configs.append((name + COMPILED_CONV, period, True))
    for name, every, compiled in configs:
        torch.manual_seed(0)
        model = models.resnet32(num_classes=10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if every is None:
            step = first_order_step(model, F.cross_entropy, batches, opt)
            runners.append(Runner(name, None, step, *schedule()))
            continue
        pre = kaisa.KFACPreconditioner(model, factor_update_steps=every[0],
                                       inv_update_steps=every[1], lr=0.1)
        step = first_order_step(model, F.cross_entropy, batches, opt, pre)
        if compiled:
            step = (lambda inner: lambda i: _in(compiled_conv_kernel, inner, i))(step)
        runners.append(Runner(name, "sgd", step, *schedule(F=every[0], I=every[1]),
                              state_of(pre)))
    return runners


def math_attention() -> AbstractContextManager[None]:
    """PyTorch's math kernel of ``scaled_dot_product_attention`` (it has a double backward)."""
    return sdpa_kernel(SDPBackend.MATH)


def _in(context: Callable[[], AbstractContextManager[None]], step: Callable[[int], None],
        i: int) -> None:
    """``step(i)`` inside ``context()``."""
    with context():
        step(i)


def autoencoder_runners(smoke: bool) -> list[Runner]:
    """Adam and adaptive KFAC (inverses every step, every 5) on the 784-...-6 autoencoder."""
    dims, hidden, batch = (32, (16, 8), 16) if smoke else (784, (400, 200, 100, 50, 25, 6), 256)
    gen = torch.Generator().manual_seed(0)
    batches = [(x, x) for x in (torch.rand(batch, dims, generator=gen) for _ in range(4))]
    torch.manual_seed(0)
    model = models.autoencoder(input_dim=dims, hidden_dims=hidden)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    runners = [Runner("adam", None, first_order_step(model, F.mse_loss, batches, adam),
                      *schedule())]
    for name, every in (("kfac adaptive", 1), ("kfac adaptive, inverses every 5", 5)):
        torch.manual_seed(0)
        model = models.autoencoder(input_dim=dims, hidden_dims=hidden)
        kfac = kaisa.KFAC(model, loss="mse", inv_update_steps=every)
        runners.append(Runner(name, "adam", kfac_step(model, batches, kfac),
                              *schedule(F=1, I=every, D=kfac.config.damping_interval),
                              state_of(kfac)))
    return runners


def gpt_runners(smoke: bool) -> list[Runner]:
    """AdamW, Adam, KFACPreconditioner + AdamW, adaptive KFAC and EKFAC on the GPT of
    bench/convergence/gpt.py."""
    from kaisa.train.text import load_text

    shape = (dict(d_model=32, n_layers=2, context=16, n_heads=4), 4, 60_000) if smoke else (
        dict(d_model=128, n_layers=4, context=64, n_heads=4), 32, 2 * 2**20)
    sizes, batch, text_bytes = shape
    data = load_text(context=int(sizes["context"]), examples_per_epoch=batch,
                     max_bytes=text_bytes, eval_windows=8)
    batches = [data.batch(torch.arange(batch), i) for i in range(4)]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return gpt(**sizes)

    runners = []
    for name in ("adamw", "adam"):
        model = build()
        opt: torch.optim.Optimizer = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(
            model.parameters(), lr=3e-3)
        runners.append(Runner(name, None, first_order_step(model, lm_loss, batches, opt),
                              *schedule()))
    for method in ("eigen", "inverse"):  # inverse: pi-damped inverses, two GEMMs a block
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        pre = kaisa.KFACPreconditioner(model, damping=0.03, factor_update_steps=10,
                                       inv_update_steps=100, lr=3e-3, compute_method=method,
                                       layer_kinds=("linear", "attention", "embedding"))
        runners.append(Runner(f"kfac_pre 10/100{' inverse' * (method == 'inverse')} + adamw",
                              "adamw", first_order_step(model, lm_loss, batches, opt, pre),
                              *schedule(F=10, I=100), state_of(pre)))
    # double_backward: over math attention (below); reduce: KFAC-reduce statistics (opt-in)
    for suffix, extra in (("", {}), (" double_backward", {"jvp": "double_backward"}),
                          (" reduce", {"kfac_approx": "reduce"})):
        model = build()
        kfac = kaisa.KFAC(model, loss="cross_entropy", **extra)
        step = kfac_step(model, batches, kfac)
        if "jvp" in extra:  # the fused attention kernels have no double backward
            step = (lambda inner: lambda i: _in(math_attention, inner, i))(step)
        runners.append(Runner("kfac adaptive" + suffix, "adam", step,
                              *schedule(F=1, I=1, D=kfac.config.damping_interval),
                              state_of(kfac)))
    # reduce: KFAC-reduce statistics; rows256: factor statistics of 256 rows a call (opt-in;
    # "linear only": the attention and tied-embedding blocks keep every row, as before)
    for suffix, extra in (("", {}), (" reduce", {"kfac_approx": "reduce"}),
                          (" rows256", {"factor_rows": 256}),
                          (" rows256 linear only", {"factor_rows": 256}),
                          (" rows256 qr", {"factor_rows": 256, "basis_refresh": "qr"}),
                          (" rows256 o256", {"factor_rows": 256, "max_basis_dim": 256}),
                          (" rows256 o256 f2", {"factor_rows": 256, "max_basis_dim": 256,
                                                "factor_update_steps": 2}),
                          (" rows256 o256 b20", {"factor_rows": 256, "max_basis_dim": 256,
                                                 "basis_update_steps": 20})):
        model = build()
        every = {"factor_update_steps": 1, "basis_update_steps": 10} | extra
        ekfac = kaisa.EKFAC(model, lr=3e-3, **every)
        if suffix.endswith("linear only"):
            for block in ekfac.curvature.blocks.values():
                if block.kind != "linear":
                    block.factor_rows = None  # type: ignore[attr-defined]
        runners.append(Runner("ekfac" + suffix, "adamw",
                              first_order_step(model, lm_loss, batches, ekfac, kfac=True),
                              *schedule(F=int(every["factor_update_steps"]),
                                        I=int(every["basis_update_steps"])), state_of(ekfac)))
    return runners


TASKS: dict[str, Callable[[bool], list[Runner]]] = {
    "resnet32": resnet_runners, "autoencoder": autoencoder_runners, "gpt": gpt_runners,
}
