"""The TrainerCallback: saves at the Trainer's save points through aiockpt, and resumes."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import has_length

from aiockpt import CheckpointManager, SyncSaveHandle

from ._state import (
    capture_rng,
    restore_rng,
    step_metrics,
    trainer_state_values,
    write_resume_folder,
)

#: The events that follow a save point, in the order the Trainer runs them.
_AFTER_LOG = "log"
_AFTER_EVALUATE = "evaluate"


@dataclass
class _Resume:
    """A resume in progress: the step, its folder, and the RNG states still to restore."""

    step: int
    folder: str
    rng: dict[str, Any]
    #: where the Trainer would restore its own RNG file: "epoch" (the resumed epoch's start)
    #: or "step" (the first resumed step, once the skipped batches are passed)
    rng_at: str = ""


class AiockptCallback(TrainerCallback):
    """Checkpoints a :class:`transformers.Trainer` through aiockpt, and resumes it.

    ``root`` and ``manager_kwargs`` go to :class:`aiockpt.CheckpointManager` (``retention``,
    ``storage_options``, ``max_pending``, ...). The callback saves where the Trainer's
    ``save_strategy`` / ``save_steps`` would (``"steps"`` or ``"epoch"``), and writes nothing
    through the Trainer: it turns ``control.should_save`` off. Each save holds the model,
    the optimizer, the LR scheduler, the RNG states and the trainer state; it returns once the
    snapshot is taken, and ``on_train_end`` waits for every save to be durable, then closes
    the manager. To resume::

        callback = AiockptCallback("checkpoints/run")
        trainer = Trainer(..., callbacks=[callback])
        trainer.train(resume_from_checkpoint=callback.resume(trainer))
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, **manager_kwargs: Any) -> None:
        self._root = root
        self._manager_kwargs = manager_kwargs
        self._manager: CheckpointManager | None = None
        self._trainer: Trainer | None = None
        self._handles: list[SyncSaveHandle] = []
        self._due: str | None = None  # a save point passed; the event to save at
        self._saved_step: int | None = None
        self._resume: _Resume | None = None
        #: The step this training resumed from: the save points after it belong to a new
        #: branch, and replace those an earlier run left at the same steps.
        self._resumed_from: int | None = None

    # ------------------------------------------------------------------ the manager

    @property
    def manager(self) -> CheckpointManager:
        """The open :class:`aiockpt.CheckpointManager`, to list steps or load a checkpoint.

        Reading it never opens one (a manager holds the root's lease, and a debugger or a
        logger reading attributes must not take it): the manager opens at :meth:`open`,
        :meth:`resume` or the first save, and closes at ``on_train_end`` or :meth:`close`.
        Raises RuntimeError while it is not open."""
        if self._manager is None:
            raise RuntimeError(
                "the callback's manager is not open: it opens at resume(), at the first save, "
                "or with callback.open()"
            )
        return self._manager

    def open(self) -> CheckpointManager:
        """Open the manager (once; later calls return it) and return it."""
        if self._manager is None:
            manager = CheckpointManager(self._root, **self._manager_kwargs)
            manager.open()
            self._manager = manager
        return self._manager

    def wait(self) -> None:
        """Wait until every save so far is durable and committed; raises a save's error."""
        if self._manager is not None:
            self._manager.wait()
        self._handles.clear()

    def close(self) -> None:
        """Wait for the pending saves, close the manager and remove a resume folder. Called by
        ``on_train_end``; call it yourself when ``train()`` raised. Idempotent."""
        manager, self._manager = self._manager, None
        try:
            if manager is not None:
                try:
                    manager.wait()
                finally:
                    manager.close()
        finally:
            self._handles.clear()
            self._due = None
            if self._resume is not None:
                shutil.rmtree(self._resume.folder, ignore_errors=True)
                self._resume = None

    # ------------------------------------------------------------------ resuming

    def resume(self, trainer: Trainer, step: int | None = None) -> str | None:
        """Prepare ``trainer`` to resume from the checkpoint at ``step`` (the latest when None)
        and return the folder to pass as ``trainer.train(resume_from_checkpoint=...)``; None
        when the root holds no checkpoint, so a fresh run trains from the start.

        The model's weights are restored now, in place. The folder holds what the Trainer
        reads itself: ``trainer_state.json`` (so it skips the steps already trained, and the
        batches of the resumed epoch) and the weights as ``model.safetensors``. The optimizer
        and scheduler states are restored at ``on_train_begin``, once the Trainer has built
        them, and the RNG states where the Trainer would restore its own RNG file.
        """
        if trainer.model is None:
            raise ValueError("the Trainer has no model yet")
        self._trainer = trainer
        manager = self.open()
        if step is None:
            step = manager.latest_step()
            if step is None:
                return None
        saved = manager.load(step, keys=["rng", "trainer_state"])
        manager.load(step, into={"model": trainer.model}, keys=["model"])
        folder = tempfile.mkdtemp(prefix=f"aiockpt-hf-{step}-")
        try:
            write_resume_folder(folder, saved["trainer_state"], trainer.model)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self._resume is not None:
            shutil.rmtree(self._resume.folder, ignore_errors=True)
        self._resume = _Resume(step, folder, saved["rng"])
        return folder

    def _rng_at(self, args: TrainingArguments, state: TrainerState, dataloader: Any) -> str:
        """Where the Trainer restores RNG states on resume (``Trainer._run_epoch``): at the start
        of the resumed epoch when it resumes on an epoch boundary (or skips no data), else
        after the first resumed step's batches are drawn."""
        if has_length(dataloader):
            n = len(dataloader)
            gas = args.gradient_accumulation_steps
            per_epoch = max(n // gas + int(n % gas > 0), 1)
        else:
            per_epoch = state.max_steps
        mid_epoch = state.global_step % per_epoch > 0 and not args.ignore_data_skip
        return "step" if mid_epoch else "epoch"

    def _restore_rng(self) -> None:
        assert self._resume is not None
        restore_rng(self._resume.rng)
        self._resume.rng = {}

    # ------------------------------------------------------------------ saving

    def _save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save the state now: the snapshot is taken before this returns, the write goes on."""
        self._due = None
        if state.global_step == self._saved_step:
            return
        callbacks: list[object] = []
        if self._trainer is not None:
            self._trainer.store_flos()  # as Trainer._save_checkpoint does
            callbacks = list(self._trainer.callback_handler.callbacks)
        values = {
            "model": kwargs["model"],
            "optimizer": kwargs["optimizer"],
            "lr_scheduler": kwargs["lr_scheduler"],
            "rng": capture_rng(),
            "trainer_state": trainer_state_values(state, control, callbacks),
        }
        # As the Trainer overwrites its checkpoint-N folder: a run resumed from an earlier
        # step replaces the abandoned run's later steps as it reaches them, each atomically
        # (the old checkpoint loads until the new one commits). A fresh run never does.
        rewound = self._resumed_from is not None and state.global_step > self._resumed_from
        handle = self.open().save(
            state.global_step, values, metrics=step_metrics(state), overwrite=rewound
        )
        self._saved_step = state.global_step
        for done in [h for h in self._handles if h.done()]:
            self._handles.remove(done)
            done.result()  # a save that failed raises its error here, at the next save point
        self._handles.append(handle)

    def _save_point(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """At a save point the Trainer marked (``control.should_save``): take the save over,
        and make it once this step's log and evaluation are in the trainer state."""
        if self._due is not None:  # a save point whose log never came
            self._save(args, state, control, **kwargs)
        if not control.should_save:
            return
        control.should_save = False
        if control.should_evaluate:
            self._due = _AFTER_EVALUATE
        elif control.should_log:
            self._due = _AFTER_LOG
        else:
            self._save(args, state, control, **kwargs)

    # ------------------------------------------------------------------ the events

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check the arguments and the root; on a resume, restore the optimizer and LR
        scheduler."""
        if args.save_strategy == "best":  # a str enum; SaveStrategy.BEST since 4.46
            raise ValueError(
                'AiockptCallback saves at "steps" or "epoch" save points; for the best '
                'checkpoints, evaluate and keep them with retention=BestN(n, "eval_loss")'
            )
        self._saved_step = None
        resume = self._resume
        self._resumed_from = None if resume is None else resume.step
        if resume is None:
            self._check_fresh_root()
            return
        if state.global_step != resume.step:
            raise RuntimeError(
                f"resume() prepared step {resume.step} but the Trainer starts at step "
                f"{state.global_step}: pass the folder resume() returned to "
                "trainer.train(resume_from_checkpoint=...)"
            )
        into = {"optimizer": kwargs["optimizer"], "lr_scheduler": kwargs["lr_scheduler"]}
        self.open().load(resume.step, into=into, keys=list(into))
        resume.rng_at = self._rng_at(args, state, kwargs.get("train_dataloader"))
        self._saved_step = resume.step

    def _check_fresh_root(self) -> None:
        """Refuse, before the first step, a training that did not resume into a root that
        holds checkpoints: its saves would mix with another run's, and the first one would
        fail on a committed step. The manager opened here is closed again on refusal, so
        the root's lease is not left held by a ``train()`` that raised."""
        opened = self._manager is None
        manager = self.open()
        try:
            latest = manager.latest_step()
        except BaseException:
            if opened:
                self.close()
            raise
        if latest is None:
            return
        if opened:
            self.close()
        raise RuntimeError(
            f"{manager.url} holds checkpoints up to step {latest}, and this training did not "
            "resume: to continue from step "
            f"{latest}, call trainer.train(resume_from_checkpoint=callback.resume(trainer)); "
            "to start fresh, give the callback another root (or delete this root's checkpoints)"
        )

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Restore the RNG states when the resume starts a new epoch."""
        self._save_point_flush(args, state, control, **kwargs)
        if self._resume is not None and self._resume.rng and self._resume.rng_at == "epoch":
            self._restore_rng()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Restore the RNG states when the resume starts inside an epoch."""
        self._save_point_flush(args, state, control, **kwargs)
        if self._resume is not None and self._resume.rng and self._resume.rng_at == "step":
            self._restore_rng()

    def _save_point_flush(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._due is not None:
            self._save(args, state, control, **kwargs)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A save point of ``save_strategy="steps"``."""
        self._save_point(args, state, control, **kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A save point of ``save_strategy="epoch"``."""
        self._save_point(args, state, control, **kwargs)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Save, when the save point waited for this step's log."""
        if self._due == _AFTER_LOG:
            self._save(args, state, control, **kwargs)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Save, when the save point waited for this step's evaluation."""
        if self._due == _AFTER_EVALUATE:
            self._save(args, state, control, **kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Make a save point still waiting, wait until every save is durable, and close."""
        try:
            self._save_point_flush(args, state, control, **kwargs)
        finally:
            self.close()
