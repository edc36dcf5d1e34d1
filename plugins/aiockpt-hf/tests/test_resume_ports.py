"""The Hugging Face Trainer's own resume tests (transformers' tests/trainer), in aiockpt's
terms: resuming from a checkpoint that is not the latest (later save points of the abandoned
run are replaced as they are reached, as the Trainer overwrites its checkpoint-N folders),
resuming with another batch size, and the batch order after a resume. A tiny GPT-2 built from
its config; nothing downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _hf_run
import pytest
import torch
from transformers import Trainer, TrainingArguments, set_seed

from aiockpt import CheckpointManager
from aiockpt_hf import AiockptCallback

pytestmark = pytest.mark.slow

STEPS = 12  # one epoch of 12 steps at batch size 4
SAVES = [4, 8, 12]


class RecordingDataset(_hf_run.TokenDataset):
    """The token dataset, noting which rows each step draws."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[int] = []

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.drawn.append(int(i))
        return super().__getitem__(i)


class OtherTokens(_hf_run.TokenDataset):
    """Other random token ids: a branch that trains on other data."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = torch.randint(0, 64, self.ids.shape, generator=torch.Generator().manual_seed(1))


def trainer(
    tmp_path: Path, callback: AiockptCallback, data: Any = None, **overrides: Any
) -> Trainer:
    set_seed(0)
    model = _hf_run.GPT2LMHeadModel(_hf_run.model_config())
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "hf"),
        "per_device_train_batch_size": 4,
        "num_train_epochs": 1,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 4,
        "seed": 0,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
    }
    options.update(overrides)
    data = _hf_run.TokenDataset() if data is None else data
    return Trainer(model, TrainingArguments(**options), train_dataset=data, callbacks=[callback])


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def run(tmp_path: Path, root: Path, step: int | None = None, **kw: Any) -> Trainer:
    """Train to the end, resumed from ``step`` of ``root`` when given (else from scratch)."""
    callback = AiockptCallback(root)
    t = trainer(tmp_path, callback, **kw)
    folder = callback.resume(t, step=step) if step is not None else None
    try:
        t.train(resume_from_checkpoint=folder)
    finally:
        callback.close()
    return t


def test_can_resume_training_from_an_earlier_checkpoint(tmp_path: Path) -> None:
    """transformers' test_can_resume_training: a run resumed from checkpoint 4 (and one from
    checkpoint 8) ends with the uninterrupted run's weights and trainer state. The root still
    holds the first run's steps 8 and 12: the resumed run replaces them as it reaches them."""
    root = tmp_path / "root"
    full = run(tmp_path, root)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == SAVES
        first_12 = mgr.load(12, keys=["model"])["model"]
    expected = weights(full)

    for start in (4, 8):
        resumed = run(tmp_path, root, step=start)
        got = weights(resumed)
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
        assert resumed.state.global_step == full.state.global_step == STEPS
        losses = [e["loss"] for e in resumed.state.log_history if "loss" in e]
        assert losses == [e["loss"] for e in full.state.log_history if "loss" in e]
        with CheckpointManager(root) as mgr:
            assert mgr.steps() == SAVES
            last = mgr.load(12, keys=["model", "trainer_state"])
        assert all(torch.equal(last["model"][k], got[k]) for k in got)
        assert last["trainer_state"]["global_step"] == STEPS
    assert all(torch.equal(first_12[k], expected[k]) for k in expected)  # same run, same bytes


def test_a_resumed_branch_replaces_steps_of_another_run(tmp_path: Path) -> None:
    """A rewind that trains differently (on other data): the abandoned run's steps 8 and 12
    are replaced by the new branch's, each committed over the old one."""
    root = tmp_path / "root"
    run(tmp_path, root)
    with CheckpointManager(root) as mgr:
        old_8 = mgr.load(8, keys=["model"])["model"]
    branch = run(tmp_path, root, step=4, data=OtherTokens())
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == SAVES
        new_8 = mgr.load(8, keys=["model"])["model"]
        new_12 = mgr.load(12, keys=["model"])["model"]
    assert any(not torch.equal(new_8[k], old_8[k]) for k in old_8)
    final = weights(branch)
    assert all(torch.equal(new_12[k], final[k]) for k in final)


def test_resume_training_with_a_different_batch_size(tmp_path: Path) -> None:
    """transformers' test_resume_training_with_different_batch_size: with
    auto_find_batch_size, a resumed run trains with the batch size the checkpoint's trainer
    state records, not the one it was started with."""
    root = tmp_path / "root"
    first = run(tmp_path, root, auto_find_batch_size=True, max_steps=8)
    assert first.state.train_batch_size == 4
    callback = AiockptCallback(root)
    t = trainer(tmp_path, callback, auto_find_batch_size=True, per_device_train_batch_size=2)
    folder = callback.resume(t, step=4)
    try:
        t.train(resume_from_checkpoint=folder)
    finally:
        callback.close()
    assert t._train_batch_size == 4
    assert t.state.global_step == STEPS


def test_resume_batch_order(tmp_path: Path) -> None:
    """transformers' test_resume_batch_order: the batches a run resumed from checkpoint 4
    trains on are the uninterrupted run's from step 5 on, in order."""
    root = tmp_path / "root"
    full_data = RecordingDataset()
    run(tmp_path, root, data=full_data)
    assert len(full_data.drawn) == STEPS * 4
    resumed_data = RecordingDataset()
    run(tmp_path, root, step=4, data=resumed_data)
    # The Trainer skips the first 4 steps' batches by drawing their indices, not their rows.
    assert resumed_data.drawn == full_data.drawn[4 * 4 :]
