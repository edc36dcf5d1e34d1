"""Flatten a state tree into tensors plus a JSON tree, and rebuild or restore it on load.

The tree keeps the state's exact nesting in JSON, one tagged node per value:

    {"T": name}              a tensor, stored in the shard under ``name``
    {"D": [[key, node], …]}  a dict; keys are str or int (optimizers key their state by int)
    {"L": [node, …]}         a list
    {"U": [node, …]}         a tuple
    {"S": node}              an object with state_dict()/load_state_dict(); node is its state dict
    {"V": value}             int, str, bool, None or a finite float
    {"F": "nan"|"inf"|"-inf"} a non-finite float (JSON has no literal for it)

Tensor names are the key path joined by "/", so a checkpoint opened with safetensors reads as
``model/layer.weight``. Nothing is pickled: any other value is refused with its key path.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._format import MAX_TREE_DEPTH
from .errors import LoadMismatchError, UnsupportedValueError

#: torch dtype <-> safetensors dtype name.
TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, torch.Tensor)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


@dataclass(slots=True)
class Flat:
    """A flattened state: tensors in tree order and the JSON-able tree."""

    names: list[str]
    tensors: list[torch.Tensor]
    tree: Any
    #: What decides the layout: names, dtypes and shapes, in order.
    key: tuple


def _path(parent: str, key: object) -> str:
    return f"{parent}/{key}" if parent else str(key)


def flatten(state: Any) -> Flat:
    """Walk ``state``; refuse what cannot be saved, naming its key path."""
    if not isinstance(state, Mapping) and not is_stateful(state):
        raise UnsupportedValueError("", f"the state must be a mapping, not {type(state).__name__}")
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    shapes: list[tuple[torch.dtype, torch.Size]] = []
    seen: set[str] = set()
    active: set[int] = set()

    def walk(value: Any, path: str, depth: int = 0) -> Any:
        if isinstance(value, torch.Tensor):
            return {"T": add_tensor(value, path)}
        if value is None or isinstance(value, (bool, int, str)):
            if isinstance(value, str) and "\x00" in value:
                raise UnsupportedValueError(path, "strings with NUL characters are not stored")
            return {"V": value}
        if isinstance(value, float):
            if math.isfinite(value):
                return {"V": value}
            return {"F": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if id(value) in active:
            raise UnsupportedValueError(path, "the state contains a reference cycle")
        if depth >= MAX_TREE_DEPTH:
            raise UnsupportedValueError(
                path, f"the state nests deeper than {MAX_TREE_DEPTH} levels"
            )
        active.add(id(value))
        try:
            if isinstance(value, Mapping):
                # The hot loop of a big state dict: tensor values and str keys go straight
                # through, without a recursive call or the full key check.
                items = []
                prefix = f"{path}/" if path else ""
                for k, v in value.items():
                    if type(k) is not str or "\x00" in k:
                        check_key(k, path)
                    child = f"{prefix}{k}"
                    if isinstance(v, torch.Tensor):
                        items.append([k, {"T": add_tensor(v, child)}])
                    else:
                        items.append([k, walk(v, child, depth + 1)])
                return {"D": items}
            if isinstance(value, list):
                return {"L": [walk(v, _path(path, i), depth + 1) for i, v in enumerate(value)]}
            if isinstance(value, tuple):
                return {"U": [walk(v, _path(path, i), depth + 1) for i, v in enumerate(value)]}
            if is_stateful(value):
                sd = value.state_dict()
                if not isinstance(sd, Mapping):
                    raise UnsupportedValueError(path, "state_dict() did not return a mapping")
                return {"S": walk(sd, path, depth + 1)}
        finally:
            active.discard(id(value))
        raise UnsupportedValueError(
            path,
            f"values of type {type(value).__module__}.{type(value).__qualname__} cannot be saved "
            "(tensors, JSON values, and objects with state_dict()/load_state_dict() can)",
        )

    def check_key(key: Any, path: str) -> Any:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise UnsupportedValueError(
                _path(path, repr(key)), f"dict keys must be str or int, not {type(key).__name__}"
            )
        if isinstance(key, str) and "\x00" in key:
            raise UnsupportedValueError(
                _path(path, repr(key)), "keys with NUL characters are refused"
            )
        return key

    def add_tensor(t: torch.Tensor, path: str) -> str:
        # The hot loop at 20k tensors: few attribute reads, no detach (copy_ runs under
        # no_grad), and (dtype, shape) kept for the layout cache's key.
        dtype = t.dtype
        if (
            dtype not in TORCH_TO_ST
            or t.layout is not torch.strided
            or t.is_quantized
            or not (t.is_cpu or t.is_cuda)
        ):
            raise UnsupportedValueError(path, _tensor_problem(t))
        if path in seen:
            raise UnsupportedValueError(
                path, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
            )
        seen.add(path)
        names.append(path)
        tensors.append(t)
        shapes.append((dtype, t.shape))
        return path

    # A state tree is thousands of fresh lists and dicts: the cyclic GC would walk them again
    # and again (measured: it doubled flatten's time at 20k tensors). Nothing here is cyclic.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        tree = walk(state, "")
    finally:
        if gc_was_enabled:
            gc.enable()
    return Flat(names, tensors, tree, (tuple(names), tuple(shapes)))


def _tensor_problem(t: torch.Tensor) -> str:
    if t.layout is not torch.strided or t.is_quantized:
        return f"only dense tensors are saved, not {'quantized' if t.is_quantized else t.layout}"
    if t.dtype not in TORCH_TO_ST:
        return f"dtype {t.dtype} has no safetensors equivalent"
    return f"tensors on {t.device.type} are not supported"


# --------------------------------------------------------------------------- load


def unflatten(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the saved nesting; objects saved through state_dict() come back as their dicts."""
    tag, body = next(iter(tree.items()))
    if tag == "T":
        return tensors[body]
    if tag == "D":
        return {k: unflatten(v, tensors) for k, v in body}
    if tag == "L":
        return [unflatten(v, tensors) for v in body]
    if tag == "U":
        return tuple(unflatten(v, tensors) for v in body)
    if tag == "S":
        return unflatten(body, tensors)
    if tag == "F":
        return float(body)
    return body


def load_into(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    path: str = "",
    *,
    owned: bool = True,
) -> Any:
    """Restore ``tree`` into ``target`` in place where it can; return the restored value.

    Tensors are copied into the target's tensors; anything else gets ``tensors`` themselves,
    or clones of them when they are not ``owned`` (views of a buffer that will be reused).
    """
    fresh = tensors if owned else _Cloning(tensors)
    tag, body = next(iter(tree.items()))
    if isinstance(target, torch.Tensor):
        if tag != "T":
            raise LoadMismatchError(f"{path or '<root>'}: the checkpoint holds no tensor here")
        src = tensors[body]
        if src.shape != target.shape or src.dtype != target.dtype:
            raise LoadMismatchError(
                f"{path or '<root>'}: saved {src.dtype}{list(src.shape)} does not fit "
                f"{target.dtype}{list(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(src)
        return target
    if is_stateful(target):
        inner = body if tag == "S" else tree
        target.load_state_dict(unflatten(inner, fresh))
        return target
    if tag == "S":
        tag, body = next(iter(body.items()))
    if isinstance(target, dict) and tag == "D":
        for k, node in body:
            if k in target:
                target[k] = load_into(target[k], node, tensors, _path(path, k), owned=owned)
            else:
                target[k] = unflatten(node, fresh)
        return target
    if isinstance(target, list) and tag in ("L", "U") and len(target) == len(body):
        for i, node in enumerate(body):
            target[i] = load_into(target[i], node, tensors, _path(path, i), owned=owned)
        return target
    return unflatten({tag: body}, fresh)


class _Cloning(Mapping):
    """Clones of the tensors of another mapping, made as they are asked for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name].clone()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
