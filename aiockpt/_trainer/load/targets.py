"""What a load into existing objects learns of its target before it asks for bytes: the
keys it asks for, what its DTensors want, its optimizers' states; and what it left out."""

from __future__ import annotations

from typing import Any

import torch

from ..._core.protocol import LoadReply, Wanted
from ...errors import InvalidStepError
from ...events import logger
from ..objects import _dtensor_type, is_stateful
from ..state import TORCH_TO_ST
from .restore import Restored


def wanted_boxes(held: dict[str, Any]) -> dict[str, Wanted]:
    """What each DTensor of a target (dtensor.Held, by key path) wants of a load: its dtype,
    global shape and this rank's box (None: it holds none)."""
    return {
        h.name: (
            TORCH_TO_ST[h.tensor.dtype],
            h.shape,
            None if h.chunk is None else (h.chunk.offsets, h.chunk.sizes),
        )
        for h in held.values()
    }


def _say_left_out(reply: LoadReply, restored: Restored, required: bool) -> None:
    """Warn of what a ``strict=False`` restore left out, if anything."""
    only_saved = [*restored.only_saved, *(reply.left_out if not required else ())]
    if only_saved or restored.only_target:
        logger.warning(
            "load(strict=False) of step %d restored what both hold; not restored "
            "(saved, not in the target): %s; left as they were (in the target, not "
            "saved): %s",
            reply.step,
            sorted(only_saved) or "none",
            list(restored.only_target) or "none",
        )


def check_keys(keys: Any) -> tuple[str, ...] | None:
    """``load(keys=...)``: None, a key path, or an iterable of them (non-empty str each, no
    leading or trailing "/")."""
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    try:
        out = tuple(keys)
    except TypeError:
        raise TypeError(f"keys must be a str or an iterable of str, not {keys!r}") from None
    for k in out:
        if not isinstance(k, str) or not k or k.startswith("/") or k.endswith("/"):
            raise ValueError(f"keys must be key paths like 'model' or 'model/layers.3', not {k!r}")
    if not out:
        raise ValueError("keys is empty: give the key paths to load, or None for all")
    return out


def target_paths(into: Any) -> tuple[str, ...] | None:
    """The key paths of everything ``into`` holds (its dicts walked, anything else a leaf);
    None when ``into`` is not a dict (then all is read)."""
    if not isinstance(into, dict):
        return None
    paths: list[str] = []
    stack: list[tuple[str, Any]] = [("", into)]
    while stack:
        prefix, mapping = stack.pop()
        for k, v in mapping.items():
            path = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, dict) and v and not is_stateful(v):
                stack.append((path, v))
            else:
                paths.append(path)
    return tuple(paths) if paths else None


def init_optimizer_states(into: Any) -> None:
    """Give each optimizer in ``into`` (at the top or in its dicts and lists) whose parameters
    include DTensors and whose state is still empty its state, as one step with zero
    gradients and a learning rate of 0 would: restoring needs DTensor moments to restore
    into (load_state_dict of a fresh optimizer would take the saved moments as plain tensors,
    which FSDP2's step then refuses). An optimizer with state, or with gradients already, is
    left alone. Without DTensors imported no optimizer has one, and nothing is walked."""
    if _dtensor_type() is None:
        return
    optimizer, containers = torch.optim.Optimizer, (dict, list, tuple)
    stack, seen = [into], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, optimizer):
            _init_state(value)
        elif isinstance(value, containers):
            # Only what may hold an optimizer is walked on, not every tensor of the state.
            values = value.values() if isinstance(value, dict) else value
            stack.extend(v for v in values if isinstance(v, (optimizer, *containers)))


def _init_state(opt: torch.optim.Optimizer) -> None:
    dtensor_type = _dtensor_type()
    params = [p for group in opt.param_groups for p in group["params"]]
    if (
        opt.state
        or dtensor_type is None
        or not any(isinstance(p, dtensor_type) for p in params)
        or any(p.grad is not None for p in params)
    ):
        return
    lrs = [group.get("lr") for group in opt.param_groups]
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            if "lr" in group:
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
        opt.zero_grad(set_to_none=True)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidStepError(f"step must be a non-negative int or None, not {step!r}")
