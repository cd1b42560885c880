"""kaisa.KFAC inside training frameworks: Hugging Face ``Trainer`` and Lightning.

Each framework run records the batches it fed the model; a plain loop over the same
batches must give bit-identical parameters. The frameworks are in the ``test`` extra;
where one is missing its test skips, and the skip names the package.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


class _Regressor(nn.Module):
    """Returns ``{'loss', 'logits'}`` as the Hugging Face ``Trainer`` expects."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.detach().clone(), labels.detach().clone()))
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 6, generator=g)
        self.y = torch.sin(self.x[:, :3])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def test_hugging_face_trainer_equals_the_plain_loop() -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = _Regressor()
    reference = copy.deepcopy(model)
    # fixed lr/momentum and the empirical Fisher: steps without a closure, follows the
    # scheduler (the Trainer calls loss.backward(), optimizer.step(), scheduler.step())
    kw: dict[str, Any] = dict(loss="mse", curvature="empirical", lr=0.1, momentum=0.9)
    opt = kaisa.KFAC(model, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=12, per_device_train_batch_size=16, report_to=[],
            use_cpu=True, save_strategy="no", max_grad_norm=0.0, disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_Data(), optimizers=(opt, sched)
        )
        trainer.train()
    assert opt.steps == 12 and len(model.seen) == 12

    ref_opt = kaisa.KFAC(reference, **kw)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _schedule)
    for x, y in model.seen:
        ref_opt.zero_grad()
        reference(x, y)["loss"].backward()
        ref_opt.step()
        ref_sched.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 13


def test_lightning_manual_optimisation_equals_the_plain_loop() -> None:
    lightning = pytest.importorskip("lightning")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    reference = copy.deepcopy(net)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Module(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False  # KFAC runs its own backward passes
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: list[torch.Tensor], _index: int) -> None:
            x, y = batch
            seen.append((x.clone(), y.clone()))
            loss = self.optimizers().step(lambda: (self(x), y))
            self.log("loss", loss)

        def configure_optimizers(self) -> kaisa.KFAC:
            return kaisa.KFAC(self, loss="mse")

    data = _Data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data.x, data.y), batch_size=16, shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    trainer = lightning.Trainer(
        max_steps=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module, loader)
    assert len(seen) == 10

    ref_opt = kaisa.KFAC(reference, loss="mse")
    for x, y in seen:
        ref_opt.step(lambda x=x, y=y: (reference(x), y))
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
