"""What flattening and restoring a state ask of its values: which are saved through
state_dict(), which are DTensors, which keys a tree holds, and why a value is refused."""

from __future__ import annotations

import operator
import sys
from typing import Any

import torch

from .._core import values
from ..errors import StateDictError, UnsupportedValueError
from .dtypes import TORCH_TO_ST


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is saved through its state_dict() and restored by load_state_dict()."""
    return (
        not isinstance(obj, torch.Tensor)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})

#: What a restore compares of a dict's tensors, many at a time.
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _path(parent: str, key: object) -> str:
    return f"{parent}/{key}" if parent else str(key)


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _subclass_problem(value: Any) -> str:
    """Why a list or tuple subclass (a namedtuple, say) is refused, and what to do instead:
    it would come back as a plain list or tuple, and nothing is pickled."""
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return (
            f"a namedtuple ({_type_name(value)}) would come back as a plain tuple: save "
            "value._asdict() (a dict) and rebuild it after loading"
        )
    kind = "list" if isinstance(value, list) else "tuple"
    return (
        f"a {kind} subclass ({_type_name(value)}) would come back as a plain {kind}: save "
        f"{kind}(value)"
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (at one data pointer) are views of the same bytes: same dtype,
    device, shape and strides, and not empty."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and a.stride() == b.stride()
        and a.numel() > 0
    )


def _dtensor_type() -> type | None:
    """The DTensor class, or None when nothing imported it (then no value is one): importing
    torch.distributed.tensor costs a second, which a run without DTensors never pays."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _check_key(key: Any, path: str) -> None:
    """Refuse a dict key the tree cannot hold: not a str or int the manifest keeps (see
    values.key_problem), or holding a NUL."""
    why = values.key_problem(key)
    if why is None and isinstance(key, str) and "\x00" in key:
        why = "keys with NUL characters are refused"
    if why is not None:
        try:
            shown = repr(key)
        except ValueError:  # an int past 4300 digits
            shown = f"<an int of {key.bit_length()} bits>"
        raise UnsupportedValueError(_path(path, shown), why)


def _state_dict(obj: Any, path: str) -> Any:
    """``obj.state_dict()``; what it raises, as a StateDictError naming ``path`` (the error
    itself its cause): a bare error from deep inside a model names no key."""
    try:
        return obj.state_dict()
    except Exception as e:
        raise StateDictError(
            path, f"{_type_name(obj)}.state_dict() raised {type(e).__name__}: {e}"
        ) from e


def _is_sharded_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ShardedTensor (only once something imported the class)."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    cls = getattr(module, "ShardedTensor", None)
    return cls is not None and isinstance(t, cls)


def _tensor_problem(t: torch.Tensor) -> str:
    if t.is_nested:
        return "nested tensors are not saved (unbind() it into a list of tensors)"
    if t.layout is not torch.strided or t.is_quantized:
        return f"only dense tensors are saved, not {'quantized' if t.is_quantized else t.layout}"
    if t.dtype not in TORCH_TO_ST:
        return f"dtype {t.dtype} has no safetensors equivalent"
    return f"tensors on {t.device.type} are not supported"
