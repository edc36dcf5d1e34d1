"""A tiny Lightning run for the plugin's tests: a Linear model on fixed batches, Adam and a
step-wise learning-rate schedule, checkpointed through AiockptCheckpointIO.

Importable (``run``) and runnable in a fresh process::

    python _train.py ROOT DIRPATH MAX_STEPS CKPT_PATH|- OUT.json

which writes the run's record (losses, final weights and optimizer state, each float as
``float.hex``, exact) to OUT.json.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from aiockpt_lightning import AiockptCheckpointIO

BATCHES = 8  # per epoch
BATCH_SIZE = 8


class Batches:
    """The same eight batches, epoch after epoch, in every process (a plain iterable, not a
    DataLoader: nothing to say about worker processes)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(BATCHES * BATCH_SIZE, 4, generator=g)
        y = x @ torch.randn(4, 1, generator=g) + 0.1 * torch.randn(len(x), 1, generator=g)
        self.batches = list(zip(x.split(BATCH_SIZE), y.split(BATCH_SIZE), strict=True))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class Tiny(L.LightningModule):
    """A Linear regression that records each step's loss."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The batch's mean squared error, recorded by global step."""
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        self.log("loss", loss, batch_size=len(x))
        return loss

    def configure_optimizers(self) -> Any:
        """Adam, its learning rate halved every five steps."""
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(io: AiockptCheckpointIO, max_steps: int, callbacks: Sequence[Callback]) -> L.Trainer:
    """A quiet CPU Trainer: no logger, progress bar or model summary."""
    return L.Trainer(
        max_steps=max_steps,
        plugins=[io],
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=io.root,  # nothing goes to the working directory
    )


def run(
    root: str,
    dirpath: str,
    max_steps: int,
    ckpt_path: str | None = None,
    callbacks: Sequence[Callback] | None = None,
) -> dict[str, Any]:
    """Fit Tiny (saving every 4 steps, all kept, and last.ckpt); the run's record."""
    if callbacks is None:
        callbacks = [
            ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True)
        ]
    torch.manual_seed(0)
    model = Tiny()
    fit = trainer(AiockptCheckpointIO(root), max_steps, callbacks)
    fit.fit(model, train_dataloaders=Batches(), ckpt_path=ckpt_path)
    return record(model, fit)


def _hex(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.detach().flatten().tolist()]


def record(model: Tiny, fit: L.Trainer) -> dict[str, Any]:
    """Losses by step, the final weights and the optimizer's state, exact."""
    opt = fit.optimizers[0]
    state = {
        f"{i}/{k}": _hex(v)
        for i, per_param in opt.state_dict()["state"].items()
        for k, v in per_param.items()
    }
    return {
        "losses": {str(step): loss.hex() for step, loss in sorted(model.losses.items())},
        "weights": {k: _hex(v) for k, v in model.state_dict().items()},
        "optimizer": state,
        "lr": float(opt.param_groups[0]["lr"]).hex(),
        "global_step": fit.global_step,
    }


if __name__ == "__main__":
    root, dirpath, max_steps, ckpt, out = sys.argv[1:]
    result = run(root, dirpath, int(max_steps), None if ckpt == "-" else ckpt)
    with open(out, "w") as f:
        json.dump(result, f)
