"""What a checkpoint holds besides the model, optimizer and scheduler, in values aiockpt stores
without pickle: the random number generators, the trainer's state, and the resume folder the
Trainer reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import TrainerControl, TrainerState, trainer_callback

#: The file names the Trainer looks for in a checkpoint folder (``transformers.trainer``).
TRAINER_STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
#: The base of callbacks whose state the Trainer saves (transformers 4.41 and later).
_EXPORTABLE: Any = getattr(trainer_callback, "ExportableState", None)


def capture_rng() -> dict[str, Any]:
    """The state of every generator the Trainer itself saves: Python's, numpy's legacy global
    one, torch's CPU one and, when CUDA is up, every CUDA device's."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    """Set the generators to ``states``, as :func:`capture_rng` took them."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(states["numpy"]))
    # Copies: a loaded tensor may be a view into a larger buffer, and set_rng_state reads a
    # view at a storage offset wrongly (torch 2.13 crashes on one).
    torch.random.set_rng_state(states["cpu"].clone())
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.clone() for s in cuda])
        else:  # another device count: the current device takes the first state, as HF does
            torch.cuda.set_rng_state(cuda[0].clone())


def callback_states(
    control: TrainerControl, callbacks: Iterable[Any]
) -> dict[str, dict[str, Any] | list[dict[str, Any]]]:
    """``TrainerState.stateful_callbacks`` as the Trainer writes it when it saves: each
    ``ExportableState`` callback's current ``state()`` under its class name, a list when
    several share one."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for cb in [*callbacks, control]:
        if _EXPORTABLE is not None and isinstance(cb, _EXPORTABLE):
            grouped.setdefault(type(cb).__name__, []).append(cb.state())
    return {name: found[0] if len(found) == 1 else found for name, found in grouped.items()}


def trainer_state_values(
    state: TrainerState, control: TrainerControl, callbacks: Iterable[Any] = ()
) -> dict[str, Any]:
    """``state`` as plain JSON values (numbers, strings, lists, dicts with str keys): what the
    Trainer writes to ``trainer_state.json``, the callbacks' states taken now."""
    values = dataclasses.asdict(state)
    if "stateful_callbacks" in values:
        values["stateful_callbacks"] = callback_states(control, callbacks)
    plain: dict[str, Any] = json.loads(json.dumps(values))
    return plain


def step_metrics(state: TrainerState) -> dict[str, float]:
    """The numbers logged at the current step (loss, learning rate, eval metrics), for
    retention policies such as ``BestN(3, "eval_loss")``."""
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != state.global_step:
            continue
        for name, value in entry.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name != "step" and number and math.isfinite(value):
                metrics[name] = float(value)
    return metrics


def write_resume_folder(
    folder: str, trainer_state: Mapping[str, Any], model: torch.nn.Module
) -> None:
    """Write what ``Trainer.train(resume_from_checkpoint=folder)`` needs to find: the trainer
    state as JSON and the model's weights as safetensors. No optimizer, scheduler or RNG file:
    the Trainer skips those, and the callback restores them from aiockpt instead."""
    TrainerState(**trainer_state).save_to_json(os.path.join(folder, TRAINER_STATE_FILE))
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        # safetensors refuses two names on one storage (tied weights): the second gets a copy,
        # so loading the file sets both names and reports no missing key.
        t = t.clone() if ptr in storages else t.contiguous()
        storages.add(ptr)
        tensors[name] = t
    safetensors.torch.save_file(tensors, os.path.join(folder, WEIGHTS_FILE), {"format": "pt"})
