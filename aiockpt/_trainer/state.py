"""Flatten a state tree into tensors plus a JSON tree, and rebuild or restore it on load.

The tree keeps the state's exact nesting in JSON, one tagged node per value:

    {"T": name}              a tensor, stored in the shard under ``name``
    {"D": [[key, node], …]}  a dict; keys are str or int (optimizers key their state by int)
    {"L": [node, …]}         a list
    {"U": [node, …]}         a tuple
    {"S": node}              an object with state_dict()/load_state_dict(); node is its state dict
    {"V": value}             int, str, bool, None or a finite float
    {"F": "nan"|"inf"|"-inf"} a non-finite float (JSON has no literal for it)

and, only on the pipe to the daemon, a reference string (``_format.fragment_ref``) in place of
a mapping of tensors sent before (see Flattener); the daemon splices the mapping back in, so a
stored tree never holds one.

Tensor names are the key path joined by "/", so a checkpoint opened with safetensors reads as
``model/layer.weight``. Nothing is pickled: any other value is refused with its key path.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.format import MAX_TREE_DEPTH, fragment_ref
from .._core.gc import gc_paused, no_gc
from ..errors import LoadMismatchError, UnsupportedValueError

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


#: A mapping with at least this many values, all tensors under str keys, is a fragment: what
#: flatten learns of it is kept and reused while its keys stay the same (see Flattener).
FRAGMENT_MIN = 16

_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_fragment_ids = itertools.count(1)


class StaleFlat(Exception):
    """A flatten that took a cached mapping on trust does not match the tensors it holds now
    (a dtype, shape, device or layout changed under the same key): flatten it afresh."""


@dataclass(slots=True, eq=False)
class Fragment:
    """A mapping of tensors as flattened once: its keys, tensor names and tree node."""

    id: int
    keys: tuple[str, ...]
    names: tuple[str, ...]
    node: dict[str, Any]
    cuda: bool


@dataclass(slots=True)
class Flat:
    """A flattened state: tensors in tree order and the JSON-able tree."""

    names: list[str]
    tensors: list[torch.Tensor]
    #: The tree; a cached mapping appears in it as ``fragment_ref(id)`` (see Flattener).
    tree: Any
    #: What decides the layout: a fragment's id, or a loose tensor's (name, dtype, shape).
    key: tuple
    #: The nodes of the fragments the tree refers to, by id.
    fragments: dict[int, Any] = field(default_factory=dict)
    #: Whether any tensor is on a CUDA device (as far as this flatten looked).
    cuda: bool = False
    #: False when a cached mapping's tensors were taken on trust: the staging copy checks each
    #: one against the layout and raises StaleFlat on a mismatch.
    trusted: bool = True


def _path(parent: str, key: object) -> str:
    return f"{parent}/{key}" if parent else str(key)


class Flattener:
    """``flatten`` that remembers the large tensor mappings of the previous call.

    A training loop saves the same state over and over: at 20,000 tensors walking it costs
    more than copying it. A mapping of FRAGMENT_MIN or more tensors under str keys becomes a
    fragment; the next flatten that finds the same keys at the same key path reuses its names
    and tree node without looking at a tensor. The tensors' dtypes, shapes, devices and
    layouts are checked later, by the staging copy, against the layout (Flat.trusted is
    False); on a mismatch the caller flattens again with ``trust=False``.

    Fragments not met by a flatten are dropped; their ids are handed out by take_retired()
    so the daemon can forget their encoded trees.
    """

    def __init__(self) -> None:
        self._fragments: dict[str, Fragment] = {}
        self._retired: list[int] = []

    def flatten(self, state: Any, *, trust: bool = True, remember: bool = True) -> Flat:
        """Flatten ``state``; with ``remember`` False the cache is consulted but left as it
        was (a load looking up the layout of the state it restores into)."""
        met: dict[str, Fragment] = {}
        flat = _flatten(state, self._fragments if trust else {}, met)
        if remember:
            gone = [f.id for path, f in self._fragments.items() if met.get(path) is not f]
            self._retired.extend(gone)
            self._fragments = met
        return flat

    def take_retired(self) -> list[int]:
        """Ids of fragments dropped since the last call, ascending."""
        ids, self._retired = sorted(self._retired), []
        return ids


def flatten(state: Any) -> Flat:
    """Walk ``state``; refuse what cannot be saved, naming its key path."""
    return _flatten(state, None, None)


def _flatten(
    state: Any, known: dict[str, Fragment] | None, met: dict[str, Fragment] | None
) -> Flat:
    """The walk. With ``met``, large tensor mappings become fragments, reused from ``known``
    when their keys match and recorded in ``met``."""
    if not isinstance(state, Mapping) and not is_stateful(state):
        raise UnsupportedValueError("", f"the state must be a mapping, not {type(state).__name__}")
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    key: list[Any] = []
    fragments: dict[int, Any] = {}
    seen: set[str] = set()
    active: set[int] = set()
    cuda = False
    trusted = True

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
                if met is not None and len(value) >= FRAGMENT_MIN:
                    ref = fragment(value, path)
                    if ref is not None:
                        return ref
                return mapping(value, path, depth)
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

    def mapping(value: Mapping, path: str, depth: int) -> dict[str, Any]:
        # The hot loop of a big state dict: tensor values and str keys go straight through,
        # without a recursive call or the full key check.
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

    def fragment(value: Mapping, path: str) -> str | None:
        """The mapping as a fragment reference, or None when it is not all tensors."""
        nonlocal cuda, trusted
        keys = tuple(value)
        values = list(value.values())
        if not set(map(type, values)) <= _PLAIN_TENSORS or set(map(type, keys)) != {str}:
            return None
        assert known is not None
        assert met is not None
        frag = known.get(path)
        if frag is not None and frag.keys == keys:
            n = len(seen)
            seen.update(frag.names)
            if len(seen) != n + len(frag.names):
                prior = set(names)
                name = next(x for x in frag.names if x in prior)
                raise UnsupportedValueError(
                    name, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
                )
            names.extend(frag.names)
            tensors.extend(values)
            trusted = False
            cuda = cuda or frag.cuda
        else:
            first, was_cuda = len(names), cuda
            cuda = False
            node = mapping(value, path, 0)
            frag = Fragment(next(_fragment_ids), keys, tuple(names[first:]), node, cuda)
            cuda = cuda or was_cuda
            del key[len(key) - len(frag.names) :]  # the fragment's id stands for its tensors
        met[path] = frag
        key.append(frag.id)
        fragments[frag.id] = frag.node
        return fragment_ref(frag.id)

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
        # no_grad), and (name, dtype, shape) kept for the layout cache's key.
        nonlocal cuda
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
        if not t.is_cpu:
            cuda = True
        seen.add(path)
        names.append(path)
        tensors.append(t)
        key.append((path, dtype, t.shape))
        return path

    # A state tree is thousands of fresh lists and dicts: the cyclic GC would walk them again
    # and again (measured: it doubled flatten's time at 20k tensors). Nothing here is cyclic.
    with gc_paused():
        tree = walk(state, "")
    return Flat(names, tensors, tree, tuple(key), fragments, cuda, trusted)


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


@no_gc
def load_into(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    owned: bool = True,
    copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] = torch._foreach_copy_,
) -> Any:
    """Restore ``tree`` into ``target`` in place where it can; return the restored value.

    Tensors are copied into the target's tensors, all in one ``copy(targets, sources)`` call
    at the end; anything else gets ``tensors`` themselves, or clones of them when they are not
    ``owned`` (views of a buffer that will be reused).
    """
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    result = _restore(target, tree, tensors, "", owned, copies)
    if copies[0]:
        with torch.no_grad():
            copy(*copies)
    return result


def _restore(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    path: str,
    owned: bool,
    copies: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> Any:
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
        copies[0].append(target)
        copies[1].append(src)
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
                target[k] = _restore(target[k], node, tensors, _path(path, k), owned, copies)
            else:
                target[k] = unflatten(node, fresh)
        return target
    if isinstance(target, list) and tag in ("L", "U") and len(target) == len(body):
        for i, node in enumerate(body):
            target[i] = _restore(target[i], node, tensors, _path(path, i), owned, copies)
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
