"""One training run of a tiny GPT-2 under the Trainer, checkpointed by AiockptCallback.

:func:`train` runs one in this process; as a script, a run has a fresh process, as a real
resume would::

    python _hf_run.py ROOT OUT [--stop-after N] [--probe N ...] [--resume]

It trains 3 epochs of 12 steps, saving every 4 steps, logging every step. ``--stop-after N``
ends the run after step N (the latest checkpoint is then the save point before it);
``--resume`` resumes from ROOT's latest checkpoint. It writes to the folder OUT:

- ``run.json``: the log history, the steps checkpointed, and for each probed step N the
  scheduler's and the Python and numpy RNGs' states at its probe;
- ``probe-N.safetensors``: as step N+1 begins (the first resumed step of a run resumed from
  step N, or that same step of an uninterrupted run), the model's weights, the optimizer's
  moments and the torch and numpy RNG states, as the step about to run sees them;
- ``final.safetensors``: the weights at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)

from aiockpt import CheckpointManager
from aiockpt_hf import AiockptCallback

STEPS_PER_EPOCH = 12
EPOCHS = 3
SAVE_STEPS = 4


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token ids, the same every run; the labels are the inputs (GPT-2 shifts them)."""

    def __init__(self, n: int = 4 * STEPS_PER_EPOCH, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model_config() -> GPT2Config:
    """A GPT-2 of 2 layers, width 16, over 64 token ids: trains a step in milliseconds."""
    return GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )


class Probe(TrainerCallback):
    """Records what the step after each of ``steps`` starts from, and stops after
    ``stop_after``."""

    def __init__(self, out: Path, steps: Iterable[int], stop_after: int | None) -> None:
        self.out, self.steps, self.stop_after = out, set(steps), stop_after
        self.recorded: dict[str, Any] = {}

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        step = state.global_step
        if step not in self.steps or str(step) in self.recorded:
            return
        tensors = {f"model/{k}": v.detach().clone() for k, v in kw["model"].state_dict().items()}
        for i, s in kw["optimizer"].state_dict()["state"].items():
            for name, value in s.items():
                tensors[f"optim/{i}/{name}"] = value.clone()
        tensors["rng/torch"] = torch.random.get_rng_state()
        numpy_state = np.random.get_state()
        tensors["rng/numpy"] = torch.from_numpy(numpy_state[1].astype(np.int64))
        safetensors.torch.save_file(tensors, str(self.out / f"probe-{step}.safetensors"))
        self.recorded[str(step)] = {
            "lr_scheduler": kw["lr_scheduler"].state_dict(),
            "python_rng": list(random.getstate()[1]),
            "numpy_rng_rest": [int(numpy_state[2]), int(numpy_state[3]), float(numpy_state[4])],
        }

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.stop_after:
            control.should_training_stop = True


def train(
    root: str,
    out: Path,
    *,
    stop_after: int | None = None,
    probes: Iterable[int] = (),
    resume: bool = False,
) -> dict[str, Any]:
    """One run; returns what ``run.json`` holds (see the module's docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    set_seed(0)
    model = GPT2LMHeadModel(model_config())  # dropout 0.1: the RNG state shapes every step's loss
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=4,
        num_train_epochs=EPOCHS,
        learning_rate=1e-2,
        warmup_steps=5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    callback = AiockptCallback(root)
    probe = Probe(out, probes, stop_after)
    trainer = Trainer(model, args, train_dataset=TokenDataset(), callbacks=[callback, probe])
    folder = callback.resume(trainer) if resume else None
    try:
        trainer.train(resume_from_checkpoint=folder)
    finally:
        callback.close()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    safetensors.torch.save_file(weights, str(out / "final.safetensors"))
    with CheckpointManager(root) as manager:
        steps = manager.steps()
    record = {
        "log_history": trainer.state.log_history,
        "steps": steps,
        "resumed_from": folder,
        "probes": probe.recorded,
    }
    (out / "run.json").write_text(json.dumps(record))
    return record


def main() -> None:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--probe", type=int, action="append", default=[])
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    warnings.simplefilter("error")  # as the test suite runs: a warning fails the run
    train(opts.root, opts.out, stop_after=opts.stop_after, probes=opts.probe, resume=opts.resume)


if __name__ == "__main__":
    main()
