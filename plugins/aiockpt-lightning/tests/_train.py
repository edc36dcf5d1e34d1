"""A tiny Lightning run for the plugin's tests: a Linear model on fixed batches, Adam and a
step-wise learning-rate schedule, checkpointed through AiockptCheckpointIO.

Importable (``run``) and runnable in a fresh process::

    python _train.py ROOT DIRPATH MAX_STEPS CKPT_PATH|- OUT.json [STRATEGY DEVICES [HIDDEN]]

which writes the run's record (losses, final weights and optimizer state, each float as
``float.hex``, exact) to OUT.json, from global rank 0. With STRATEGY ``ddp`` or ``fsdp``
(AiockptFSDPStrategy) Lightning starts the other ranks by running this script again; with
``ddp_spawn`` it spawns them. Every rank trains on the same batches, so a run on several CPU
processes computes what one process does. HIDDEN > 0 puts a hidden layer of that width in the
model (so that FSDP has parameters to split between the ranks).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from aiockpt_lightning import AiockptCheckpointIO, AiockptFSDPStrategy

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
    """A Linear regression (with ``hidden`` > 0, a hidden tanh layer of that width) that
    records each step's loss."""

    def __init__(self, lr: float = 0.05, hidden: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: torch.nn.Module = (
            torch.nn.Sequential(
                torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
            )
            if hidden
            else torch.nn.Linear(4, 1)
        )
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


def trainer(
    io: Any,
    max_steps: int,
    callbacks: Sequence[Callback],
    strategy: Any = "auto",
    devices: int = 1,
    **kwargs: Any,
) -> L.Trainer:
    """A quiet CPU Trainer: no logger, progress bar or model summary. ``io`` is the plugin,
    perhaps wrapped (AsyncCheckpointIO); its aiockpt root is also the Trainer's root dir."""
    base = io
    while not isinstance(base, AiockptCheckpointIO):
        base = base.checkpoint_io
    return L.Trainer(
        max_steps=max_steps,
        plugins=[io],
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=base.root,  # nothing goes to the working directory
        **kwargs,
    )


def run(
    root: str,
    dirpath: str,
    max_steps: int,
    ckpt_path: str | None = None,
    callbacks: Sequence[Callback] | None = None,
    strategy: str = "auto",
    devices: int = 1,
    hidden: int = 0,
) -> dict[str, Any]:
    """Fit Tiny (saving every 4 steps, all kept, and last.ckpt); the run's record, as global
    rank 0 saw it."""
    if callbacks is None:
        callbacks = [
            ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True)
        ]
    kept = Keep()
    torch.manual_seed(0)
    model = Tiny(hidden=hidden)
    fit = trainer(
        AiockptCheckpointIO(root), max_steps, [*callbacks, kept], _strategy(strategy), devices
    )
    fit.fit(model, train_dataloaders=Batches(), ckpt_path=ckpt_path)
    return kept.record


class Keep(Callback):
    """Keeps the run's record as it ends (in the process of global rank 0, which under
    ``ddp_spawn`` is not the one that called ``fit``) in ``record``, and writes it as JSON to
    ``out`` if given."""

    def __init__(self, out: str | None = None) -> None:
        self.out = out
        self.record: dict[str, Any] = {}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take the record on global rank 0 (under FSDP, every rank helps gather it)."""
        assert isinstance(pl_module, Tiny)
        taken = record(pl_module, trainer)
        if not trainer.is_global_zero:
            return
        self.record = taken
        if self.out is not None:
            with open(self.out, "w") as f:
                json.dump(self.record, f)


def _hex(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.detach().flatten().tolist()]


def record(model: Tiny, fit: L.Trainer) -> dict[str, Any]:
    """Losses by step, the final weights and the optimizer's state, exact. Under FSDP the
    full state is gathered (every rank takes part) and the optimizer's state keyed by each
    parameter's index, as a plain optimizer's is."""
    opt = fit.optimizers[0]
    if isinstance(fit.strategy, AiockptFSDPStrategy):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        weights = get_model_state_dict(fit.strategy.model, options=options)
        optim: Any = get_optimizer_state_dict(fit.strategy.model, opt, options=options)
        index = {name: i for i, name in enumerate(optim["param_groups"][0]["params"])}
        per_index = {index[name]: s for name, s in optim["state"].items()}
    else:
        weights = model.state_dict()
        per_index = opt.state_dict()["state"]
    state = {
        f"{i}/{k}": _hex(v) for i, per_param in per_index.items() for k, v in per_param.items()
    }
    return {
        "losses": {str(step): loss.hex() for step, loss in sorted(model.losses.items())},
        "weights": {k: _hex(v) for k, v in weights.items()},
        "optimizer": dict(sorted(state.items())),
        "lr": float(opt.param_groups[0]["lr"]).hex(),
        "global_step": fit.global_step,
    }


def _strategy(name: str) -> Any:
    """The Trainer's strategy argument for ``name`` (``fsdp``: the plugin's FSDP strategy)."""
    return AiockptFSDPStrategy() if name == "fsdp" else name


def main(argv: Sequence[str]) -> None:
    """The command line (see the module's docstring)."""
    root, dirpath, max_steps, ckpt, out, *rest = argv
    strategy, devices = (rest[0], int(rest[1])) if rest else ("auto", 1)
    hidden = int(rest[2]) if len(rest) > 2 else 0
    callbacks = [
        ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True),
        Keep(os.path.abspath(out)),
    ]
    torch.manual_seed(0)
    fit = trainer(
        AiockptCheckpointIO(root), int(max_steps), callbacks, _strategy(strategy), devices
    )
    fit.fit(
        Tiny(hidden=hidden), train_dataloaders=Batches(), ckpt_path=None if ckpt == "-" else ckpt
    )


if __name__ == "__main__":
    # Through the module's own name, so that what ddp_spawn pickles for its processes (the
    # model, the callbacks) names an importable module, not __main__.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _train

    _train.main(sys.argv[1:])
