"""Checks of what a caller hands the manager, made before anything reaches the daemon."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from .._core import values
from .._core.tree import encode_float
from ..errors import UnsupportedValueError
from ..retention import RetentionPolicy

#: Where checkpoints go when neither the root argument nor $AIOCKPT_ROOT names a place.
DEFAULT_ROOT = "checkpoints"


def root_url(root: str | os.PathLike[str] | None) -> str:
    """The checkpoint root as a path or URL: ``root``, else $AIOCKPT_ROOT, else DEFAULT_ROOT."""
    if root is None:
        root = os.environ.get("AIOCKPT_ROOT") or DEFAULT_ROOT
    url = os.fspath(root)
    if not url:
        raise ValueError("root must not be empty")
    return url


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    return value


def staging_memory(value: Any) -> int | float | None:
    """``staging_memory``: None (no cap), an int of bytes (at least 1), or a float fraction of
    the shard's size in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"staging_memory must be an int of bytes or a float fraction, not {value!r}"
        )
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError(
            f"staging_memory as a float is a fraction of the shard's size, in (0, 1]: "
            f"not {value!r} (give bytes as an int)"
        )
    if isinstance(value, int) and value < 1:
        raise ValueError(f"staging_memory must be at least 1 byte, not {value!r}")
    return value


def flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def positive_float(name: str, value: Any) -> float:
    """``value`` as a float, if it is positive."""
    if not value > 0:
        raise ValueError(f"{name} must be positive, not {value!r}")
    return float(value)


def sigterm_mode(value: Any) -> str | None:
    """``value`` if it is an on_sigterm mode: None or "flush"."""
    if value not in (None, "flush"):
        raise ValueError(f"on_sigterm must be None or 'flush', not {value!r}")
    return value


def retention_policy(policy: Any) -> RetentionPolicy | None:
    """``policy`` if the daemon can run it: a policy instance, picklable by reference."""
    if policy is None:
        return None
    if isinstance(policy, type) or not isinstance(policy, RetentionPolicy):
        what = f"the class {policy.__name__}" if isinstance(policy, type) else type(policy).__name__
        raise TypeError(f"retention must be a policy with a keep() method, not {what}")
    try:
        pickle.dumps(policy)
    except Exception as e:
        raise TypeError(
            f"the retention policy {policy!r} cannot be sent to the daemon: {e}"
        ) from None
    # Pickle finds classes by module: the daemon never imports the trainer's __main__.
    stack = [policy]
    while stack:
        p = stack.pop()
        if type(p).__module__ == "__main__":
            raise TypeError(
                f"the retention policy {p!r} is defined in __main__, which the daemon does not "
                "import; define it in an importable module"
            )
        stack.extend(getattr(p, "policies", ()))
    return policy


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """The metrics as JSON numbers by name; a non-finite float becomes "nan", "inf" or
    "-inf", as the manifest stores it. What the manifest reader would refuse is refused here,
    by the same rules (``_core.values``): a metric it cannot read would commit a checkpoint
    that retention and best_step skip, or prefer to a good one."""
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise UnsupportedValueError(f"metrics/{k!r}", "metric names must be str")
        why = values.text_problem(k)
        if why is not None:
            raise UnsupportedValueError(f"metrics/{k}", why)
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise UnsupportedValueError(f"metrics/{k}", "a tensor metric must hold one value")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UnsupportedValueError(
                f"metrics/{k}", f"metrics must be numbers, not {type(v).__name__}"
            )
        stored = encode_float(v) if isinstance(v, float) else v
        why = values.metric_problem(stored)
        if why is not None:
            raise UnsupportedValueError(f"metrics/{k}", why)
        out[k] = stored
    return out


def clean_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The metadata as a dict, refused unless it is plain JSON that the manifest reader keeps
    (``_core.values``: its strings, numbers and depth)."""
    data = dict(metadata or {})
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        # json_problem names the key path of what it refuses; json.dumps what else it does.
        found = values.json_problem(data)
        if found is not None:
            raise UnsupportedValueError(_under("metadata", found[0]), found[1]) from None
        raise UnsupportedValueError("metadata", f"metadata must be plain JSON: {e}") from None
    found = values.json_problem(data)
    if found is not None:
        raise UnsupportedValueError(_under("metadata", found[0]), found[1])
    return data


def _under(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if path else prefix
