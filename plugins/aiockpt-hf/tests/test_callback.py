"""AiockptCallback with the real Trainer: a tiny GPT-2 trained on CPU, saved through aiockpt,
stopped, and resumed in a fresh process, against one uninterrupted run.

The uninterrupted and the stopped runs train in this process; each resume runs
``_hf_run.py`` in a new interpreter, so nothing of the first run survives in memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _hf_run
import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from aiockpt import CheckpointManager
from aiockpt_hf import AiockptCallback

pytestmark = pytest.mark.slow

ALL_STEPS = list(range(4, 37, 4))  # save_steps=4 over 3 epochs of 12 steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of all 36 steps, probed where the resumes below start (steps 20 and 24)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _hf_run.train(str(out / "root"), out, probes=(20, 24))
    return out


def _run(out: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((out / "run.json").read_text())
    return record


def _resume_in_a_fresh_process(root: Path, out: Path, probe: int) -> dict[str, Any]:
    script = Path(_hf_run.__file__)
    cmd = [sys.executable, str(script), str(root), str(out), "--resume", "--probe", str(probe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _run(out)


def _losses(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-step training log entries: step, epoch, loss, grad_norm, learning_rate."""
    return [entry for entry in record["log_history"] if "loss" in entry]


@pytest.mark.parametrize(
    ("stop_after", "latest"),
    [(22, 20), (26, 24)],
    ids=["inside-an-epoch", "on-an-epoch-boundary"],
)
def test_a_resumed_run_continues_exactly_like_an_uninterrupted_one(
    uninterrupted: Path, tmp_path: Path, stop_after: int, latest: int
) -> None:
    root = tmp_path / "root"
    stopped = _hf_run.train(str(root), tmp_path / "stopped", stop_after=stop_after)
    assert stopped["steps"] == [s for s in ALL_STEPS if s <= stop_after]
    assert stopped["steps"][-1] == latest

    resumed = _resume_in_a_fresh_process(root, tmp_path / "resumed", probe=latest)
    full = _run(uninterrupted)

    # Every step's loss, grad norm and learning rate, bit for bit: steps 1..latest come back
    # with the trainer state, the later ones are trained again from the checkpoint.
    assert len(_losses(full)) == 36
    assert _losses(resumed) == _losses(full)
    assert resumed["steps"] == ALL_STEPS
    assert resumed["resumed_from"] is not None
    assert not os.path.exists(resumed["resumed_from"])  # the resume folder is cleaned up

    # The first resumed step starts from the same weights, Adam moments and steps, LR
    # scheduler, and torch / numpy / Python RNG states as that step of the uninterrupted run.
    expected = load_file(uninterrupted / f"probe-{latest}.safetensors")
    got = load_file(tmp_path / "resumed" / f"probe-{latest}.safetensors")
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert any(k.endswith("/exp_avg_sq") for k in got)  # the optimizer did have state to restore
    assert resumed["probes"][str(latest)] == full["probes"][str(latest)]
    assert resumed["probes"][str(latest)]["lr_scheduler"]["last_epoch"] == latest
    torch.manual_seed(0)
    assert not torch.equal(got["rng/torch"], torch.random.get_rng_state())  # not a fresh seed

    final, final_resumed = (
        load_file(uninterrupted / "final.safetensors"),
        load_file(tmp_path / "resumed" / "final.safetensors"),
    )
    assert all(torch.equal(final[k], final_resumed[k]) for k in final)


def test_a_checkpoint_holds_the_training_state_and_the_trainer_writes_none(
    uninterrupted: Path,
) -> None:
    with CheckpointManager(uninterrupted / "root") as manager:
        assert manager.steps() == ALL_STEPS
        saved = manager.load(20, keys=["trainer_state", "rng", "lr_scheduler"])
        weights = manager.load(20, keys=["model"])["model"]
        optimizer = manager.load(20, keys=["optimizer"])["optimizer"]
        assert manager.best_step("loss") in ALL_STEPS  # the step's logged values are metrics
    state = saved["trainer_state"]
    assert (state["global_step"], state["epoch"]) == (20, 1 + 8 / 12)  # as the Trainer sums it
    # Saved once the step's log entry was in: the history ends with step 20's loss.
    assert [e["step"] for e in state["log_history"]] == list(range(1, 21))
    assert state["stateful_callbacks"]["TrainerControl"]["args"]["should_training_stop"] is False
    assert set(saved["rng"]) == {"python", "numpy", "cpu"}
    assert saved["lr_scheduler"]["last_epoch"] == 20
    assert "transformer.h.1.mlp.c_fc.weight" in weights
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(optimizer["state"][0])
    # The Trainer's own checkpointing is off: no checkpoint-N folder in its output_dir.
    hf_output = uninterrupted / "hf"
    assert not hf_output.exists() or not any(hf_output.glob("checkpoint-*"))


def _trainer(tmp_path: Path, callback: AiockptCallback, **overrides: Any) -> Trainer:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "hf"),
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "save_strategy": "steps",
        "save_steps": 1,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
    }
    options.update(overrides)
    model = _hf_run.GPT2LMHeadModel(_hf_run.model_config())
    data = _hf_run.TokenDataset()
    args = TrainingArguments(**options)
    return Trainer(model, args, train_dataset=data, eval_dataset=data, callbacks=[callback])


def test_resume_on_an_empty_root_returns_none_and_training_starts_fresh(tmp_path: Path) -> None:
    callback = AiockptCallback(tmp_path / "root")
    trainer = _trainer(tmp_path, callback)
    assert callback.resume(trainer) is None
    trainer.train(resume_from_checkpoint=None)
    with CheckpointManager(tmp_path / "root") as manager:
        assert manager.steps() == [1, 2]


def test_resume_refuses_a_train_call_without_its_folder(tmp_path: Path) -> None:
    first = AiockptCallback(tmp_path / "root")
    _trainer(tmp_path, first).train()
    callback = AiockptCallback(tmp_path / "root")
    trainer = _trainer(tmp_path, callback)
    folder = callback.resume(trainer)
    assert folder is not None
    assert os.path.isfile(os.path.join(folder, "trainer_state.json"))
    try:
        with pytest.raises(RuntimeError, match="resume_from_checkpoint"):
            trainer.train()  # the folder not passed: the Trainer would start again at step 0
    finally:
        callback.close()
    assert not os.path.exists(folder)


class _StepCounter(TrainerCallback):
    """Counts the training steps begun."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1


def test_training_into_a_root_with_checkpoints_without_resume_fails_before_the_first_step(
    tmp_path: Path,
) -> None:
    first = AiockptCallback(tmp_path / "root")
    first_trainer = _trainer(tmp_path, first)
    first_trainer.train()  # no checkpoint yet: trains without resume(), as it always has
    assert first_trainer.state.global_step == 2
    with CheckpointManager(tmp_path / "root") as manager:
        assert manager.steps() == [1, 2]

    callback = AiockptCallback(tmp_path / "root")
    counter = _StepCounter()
    trainer = _trainer(tmp_path, callback)
    trainer.add_callback(counter)
    try:
        with pytest.raises(RuntimeError) as raised:
            trainer.train()  # resume() forgotten
    finally:
        callback.close()
    message = str(raised.value)
    assert "callback.resume(trainer)" in message
    assert "step 2" in message  # the newest step in the root
    assert "another root" in message  # how to start fresh instead
    # At train begin: not one step trained, nothing saved, and the lease is given back.
    assert counter.steps == 0
    assert trainer.state.global_step == 0
    with pytest.raises(RuntimeError, match="not open"):
        _ = callback.manager
    with CheckpointManager(tmp_path / "root") as manager:
        assert manager.steps() == [1, 2]

    # The same program, resuming, goes on from step 2.
    callback = AiockptCallback(tmp_path / "root")
    trainer = _trainer(tmp_path, callback, max_steps=3)
    trainer.train(resume_from_checkpoint=callback.resume(trainer))
    assert trainer.state.global_step == 3
    with CheckpointManager(tmp_path / "root") as manager:
        assert manager.steps() == [1, 2, 3]


def test_save_strategy_best_is_refused(tmp_path: Path) -> None:
    callback = AiockptCallback(tmp_path / "root")
    trainer = _trainer(
        tmp_path,
        callback,
        save_strategy="best",
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="loss",
    )
    try:
        with pytest.raises(ValueError, match="BestN"):
            trainer.train()
    finally:
        callback.close()


def test_reading_the_manager_property_opens_nothing(tmp_path: Path) -> None:
    callback = AiockptCallback(tmp_path / "root")
    with pytest.raises(RuntimeError, match="not open"):
        _ = callback.manager
    assert not (tmp_path / "root").exists()  # no manager, no lease taken
    manager = callback.open()
    try:
        assert callback.manager is manager
        assert callback.open() is manager
        assert manager.steps() == []
    finally:
        callback.close()
    with pytest.raises(RuntimeError, match="not open"):
        _ = callback.manager
