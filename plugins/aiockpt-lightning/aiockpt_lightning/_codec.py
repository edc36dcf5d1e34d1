"""A Lightning checkpoint dict to and from a state aiockpt stores without pickle, losslessly.

aiockpt keeps tensors, plain JSON values, dicts with str or int keys, lists, tuples, numpy
arrays and scalars as they are. A Lightning checkpoint also holds
values that aiockpt would change or refuse: ``OrderedDict`` state dicts (with their
``_metadata``), ``AttributeDict`` hyper-parameters, dicts keyed by other hashable values,
paths, dtypes, generators. Each of those becomes a *marked* dict, ``{MARK: kind, ...}``, which
:func:`decode` turns back into the value it was. What cannot come back as it was (a
``defaultdict``, an arbitrary object, a module that would come back as its state dict) is
refused, every key path at fault named in one :class:`~aiockpt.UnsupportedValueError`.

DTensors (the sharded state AiockptFSDPStrategy saves) are kept as they are when
:func:`encode` is asked to: aiockpt saves each rank's chunks and loads them back resharded.
"""

from __future__ import annotations

import pathlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict

from aiockpt.errors import CorruptCheckpointError, UnsupportedValueError

__all__ = ["MARK", "decode", "encode"]

#: The key of a marked dict. A checkpoint dict that holds this key itself is refused.
MARK = "__aiockpt_lightning__"

_PLAIN = (str, int, float, bool, type(None))
#: The path classes kept, by name: the pure ones and this platform's concrete one.
_PATHS: dict[str, type[pathlib.PurePath]] = {
    cls.__name__: cls
    for cls in (pathlib.PurePosixPath, pathlib.PureWindowsPath, type(pathlib.Path()))
}
#: The dict subclasses kept, by the name their marked dict carries: they hold nothing but
#: their items (an OrderedDict also a state dict's ``_metadata``).
_DICTS: dict[str, type[dict]] = {
    "OrderedDict": OrderedDict,
    "AttributeDict": AttributeDict,
    "FabricAttributeDict": FabricAttributeDict,
}
_DICT_NAMES = {cls: name for name, cls in _DICTS.items()}


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def _type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def encode(checkpoint: Mapping[str, Any], *, dtensors: bool = False) -> dict[str, Any]:
    """The state aiockpt saves for ``checkpoint``; raises UnsupportedValueError naming every
    key path whose value cannot be stored and restored as it is. With ``dtensors``, DTensors
    are kept (detached) for aiockpt to save as distributed tensors."""
    encoder = _Encoder(dtensors)
    state = encoder.mapping(checkpoint, "")
    if encoder.problems:
        (path, why), *more = encoder.problems
        raise UnsupportedValueError(path, why, more=more)
    return state


class _Encoder:
    """One encode: the walk, and every problem it met (it goes on past each)."""

    def __init__(self, dtensors: bool = False) -> None:
        self.dtensors = dtensors
        self.problems: list[tuple[str, str]] = []
        #: ids of the containers being walked, to refuse a reference cycle.
        self.active: set[int] = set()

    def refuse(self, path: str, why: str) -> None:
        """Record that the value at ``path`` is refused, and why."""
        self.problems.append((path, why))

    def value(self, v: Any, path: str) -> Any:
        """The stored form of ``v``, found at key path ``path``."""
        kind = type(v)
        if kind in _PLAIN:
            if kind is str and "\x00" in v:
                self.refuse(path, "strings with NUL characters cannot be stored")
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        simple = _SIMPLE.get(kind)
        if simple is not None:
            return simple(v)
        np = sys.modules.get("numpy")
        if np is not None and (kind is np.ndarray or isinstance(v, np.generic)):
            return v  # aiockpt keeps numpy arrays and scalars with their dtype
        if kind is torch.Generator:
            # Its state is a fresh CPU byte tensor, whatever the generator's device.
            return {MARK: "generator", "device": str(v.device), "state": v.get_state()}
        if id(v) in self.active:
            self.refuse(path, "the checkpoint contains a reference cycle")
            return None
        self.active.add(id(v))
        try:
            return self.container(v, path)
        finally:
            self.active.discard(id(v))

    def container(self, v: Any, path: str) -> Any:
        """The stored form of a container, or None (and a problem) for anything else."""
        kind = type(v)
        if kind is dict:
            return self.mapping(v, path)
        if kind is list:
            return [self.value(x, _join(path, i)) for i, x in enumerate(v)]
        if kind is tuple:
            return tuple(self.value(x, _join(path, i)) for i, x in enumerate(v))
        if kind in _DICT_NAMES:
            return self.dict_subclass(v, path)
        if kind is set or kind is frozenset:
            items = [self.value(x, _join(path, i)) for i, x in enumerate(v)]
            return {MARK: kind.__name__, "items": items}
        self.refuse(path, _why_not(v))
        return None

    def tensor(self, t: torch.Tensor, path: str) -> Any:
        """A tensor as it is, or marked when it is a Parameter or requires grad."""
        if type(t) is torch.Tensor:
            if not t.requires_grad:
                return t
            return {MARK: "tensor", "requires_grad": True, "value": t.detach()}
        if type(t) is torch.nn.Parameter:
            return {MARK: "parameter", "requires_grad": t.requires_grad, "value": t.detach()}
        if self.dtensors and _is_dtensor(t):
            return t.detach() if t.requires_grad else t
        self.refuse(
            path,
            f"a tensor subclass ({_type_name(t)}) would come back as a plain tensor: store "
            "a plain tensor (or its full tensor) in the checkpoint",
        )
        return None

    def dict_subclass(self, v: dict, path: str) -> dict[str, Any]:
        """An OrderedDict (with a state dict's ``_metadata``) or AttributeDict, marked."""
        attributes = dict(vars(v))
        metadata = attributes.pop("_metadata", None) if type(v) is OrderedDict else None
        if attributes:
            self.refuse(
                path,
                f"the attributes of this {type(v).__name__} ({', '.join(attributes)}) would be "
                "lost: store them as items",
            )
        node: dict[str, Any] = {MARK: _DICT_NAMES[type(v)], "items": self.mapping(v, path)}
        if metadata is not None:
            node["metadata"] = self.value(metadata, _join(path, "<_metadata>"))
        return node

    def mapping(self, m: Mapping[Any, Any], path: str) -> dict[Any, Any]:
        """A dict of str or int keys as a dict; any other keys as a marked list of pairs."""
        if MARK in m:
            self.refuse(_join(path, MARK), "this key is reserved by aiockpt-lightning")
            return {}
        keys = set(map(type, m))
        if keys <= {str, int} and not (
            int in keys and str in keys and any(str(k) in m for k in m if type(k) is int)
        ):
            out = {}
            for k, v in m.items():
                if type(k) is str and "\x00" in k:
                    self.refuse(_join(path, repr(k)), "keys with NUL characters cannot be stored")
                # The hot case, a state dict: plain tensors pass as they are.
                if type(v) is torch.Tensor and not v.requires_grad:
                    out[k] = v
                else:
                    out[k] = self.value(v, _join(path, k))
            return out
        pairs = [
            [self.value(k, _join(path, f"<key {k!r}>")), self.value(v, _join(path, repr(k)))]
            for k, v in m.items()
        ]
        return {MARK: "pairs", "items": pairs}


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (only once something imported the class)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and type(t) is cls


def _why_not(v: Any) -> str:
    """Why ``v`` is refused, and what to store instead."""
    if isinstance(v, Mapping):
        return (
            f"a {_type_name(v)} would come back as a plain dict (and anything it holds besides "
            "its items, such as a defaultdict's default_factory, would be lost): store "
            "dict(value)"
        )
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return (
            f"a namedtuple ({_type_name(v)}) would come back as a plain tuple: store "
            "value._asdict()"
        )
    if isinstance(v, (list, tuple, set, frozenset)):
        return f"a {_type_name(v)} would come back as its base type: store a plain one"
    if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
        return (
            f"a {_type_name(v)} would come back as its state dict, not as the object: store "
            "value.state_dict()"
        )
    return (
        f"values of type {_type_name(v)} cannot be stored without pickle (tensors, numpy "
        "arrays, plain Python values and containers of them can)"
    )


def _bytes_tensor(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


_SIMPLE: dict[type, Callable[[Any], dict[str, Any]]] = {
    bytes: lambda v: {MARK: "bytes", "value": _bytes_tensor(v)},
    bytearray: lambda v: {MARK: "bytearray", "value": _bytes_tensor(v)},
    torch.dtype: lambda v: {MARK: "dtype", "value": str(v).removeprefix("torch.")},
    torch.device: lambda v: {MARK: "device", "value": str(v)},
    **{
        cls: lambda v: {MARK: "path", "type": type(v).__name__, "value": str(v)}
        for cls in _PATHS.values()
    },
}


# --------------------------------------------------------------------------- decode


def decode(state: Any) -> Any:
    """The checkpoint dict that ``encode`` made ``state`` of (as aiockpt loaded it)."""
    if isinstance(state, dict):
        if MARK in state:
            return _unmark(state)
        return {k: decode(v) for k, v in state.items()}
    if isinstance(state, list):
        return [decode(v) for v in state]
    if isinstance(state, tuple):
        return tuple(decode(v) for v in state)
    return state


def _unmark(node: dict[str, Any]) -> Any:
    """The value a marked dict stands for; CorruptCheckpointError for one encode never made."""
    kind = node[MARK]
    try:
        if kind in _DICTS:
            out: Any = _DICTS[kind](decode(node["items"]))
            if "metadata" in node and kind == "OrderedDict":
                out._metadata = decode(node["metadata"])
            return out
        if kind == "pairs":
            return {decode(k): decode(v) for k, v in node["items"]}
        if kind in ("set", "frozenset"):
            return (set if kind == "set" else frozenset)(decode(x) for x in node["items"])
        if kind in ("tensor", "parameter"):
            t = node["value"]
            if kind == "parameter":
                return torch.nn.Parameter(t, requires_grad=node["requires_grad"])
            return t.requires_grad_(node["requires_grad"])
        if kind in ("bytes", "bytearray"):
            data = node["value"].numpy().tobytes()
            return data if kind == "bytes" else bytearray(data)
        if kind == "generator":
            gen = torch.Generator(device=node["device"])
            # A copy of its own: set_state reads a tensor's storage from its start, and a
            # loaded tensor may be a view into a larger buffer.
            return gen.set_state(node["state"].clone())
        if kind == "dtype":
            dtype = getattr(torch, node["value"], None)
            if isinstance(dtype, torch.dtype):
                return dtype
        if kind == "device":
            return torch.device(node["value"])
        if kind == "path" and node["type"] in _PATHS:
            return _PATHS[node["type"]](node["value"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CorruptCheckpointError(f"a malformed {kind!r} value in the checkpoint: {e}") from e
    raise CorruptCheckpointError(f"a {MARK} value of unknown kind {kind!r} in the checkpoint")
