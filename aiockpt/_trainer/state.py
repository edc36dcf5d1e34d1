"""Flatten a state into tensors plus a JSON tree (rebuilt or restored on load by
``load/restore.py``).

The tree format is described in ``_core.tree``: one tagged node per value, a tensor's name
being its key path joined by "/". Nothing is pickled: any value that is not a tensor, a JSON
value, or an object with state_dict()/load_state_dict() is refused with its key path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core import values
from .._core.format import fragment_ref
from .._core.gc import gc_paused
from .._core.tree import (
    DICT,
    DTENSOR,
    FLOAT,
    GENERATOR,
    LIST,
    MAX_TREE_DEPTH,
    NDARRAY,
    NP_SCALAR_DTYPES,
    NPSCALAR,
    STATEFUL,
    TENSOR,
    TUPLE,
    VALUE,
    encode_float,
)
from ..errors import UnsupportedValueError
from .dtypes import ST_TO_TORCH as ST_TO_TORCH
from .dtypes import TORCH_TO_ST as TORCH_TO_ST
from .objects import _DTYPE as _DTYPE
from .objects import (
    _PLAIN_TENSORS,
    _check_key,
    _is_sharded_tensor,
    _path,
    _same_tensor,
    _state_dict,
    _subclass_problem,
    _tensor_problem,
    _type_name,
    is_stateful,
)
from .objects import _SHAPE as _SHAPE
from .objects import _dtensor_type as _dtensor_type

#: A mapping with at least this many values, all tensors under str keys, is a fragment: what
#: flatten learns of it is kept and reused while its keys stay the same (see Flattener).
FRAGMENT_MIN = 16
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
    #: The DTensors in tree order (dtensor.Held); the chunks this rank writes are among
    #: ``names`` and ``tensors`` (their local tensors), under their own names.
    dtensors: list[Any] = field(default_factory=list)

    @property
    def chunk_names(self) -> frozenset[str]:
        """The names of the DTensor chunks this rank writes."""
        return frozenset(h.name for h in self.dtensors if h.writes)


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
        """Flatten ``state``; with ``remember`` False (a load looking up the layout of the
        state it restores into) the mappings met for the first time are added to the cache
        and none is dropped: a resumed run's first save then finds what its load learned
        (and the layout the load made, slow to make again at many tensors), and a load into
        another state costs the training loop's saves nothing."""
        met: dict[str, Fragment] = {}
        flat = _Walk(self._fragments if trust else {}, met).flatten(state)
        if remember:
            gone = [f.id for path, f in self._fragments.items() if met.get(path) is not f]
            self._retired.extend(gone)
            self._fragments = met
        else:
            for path, frag in met.items():
                self._fragments.setdefault(path, frag)
        return flat

    def take_retired(self) -> list[int]:
        """Ids of fragments dropped since the last call, ascending."""
        ids, self._retired = sorted(self._retired), []
        return ids


def flatten(state: Any) -> Flat:
    """Walk ``state``; refuse what cannot be saved, naming its key path."""
    return _Walk(None, None).flatten(state)


class _Walk:
    """One flatten: the walk of a state, and the tensors, names and layout key it collects.

    With ``met``, a large tensor mapping becomes a fragment, reused from ``known`` when its
    keys match and recorded in ``met`` (see Flattener).
    """

    __slots__ = (
        "active",
        "by_ptr",
        "cuda",
        "dtensors",
        "fragments",
        "generators",
        "key",
        "known",
        "met",
        "names",
        "seen",
        "tensors",
        "trusted",
    )

    #: Whether this walk records what it refuses and goes on (see problems.py).
    collecting = False

    def __init__(self, known: dict[str, Fragment] | None, met: dict[str, Fragment] | None):
        self.known = known
        self.met = met
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        #: What decides the layout (see Flat.key).
        self.key: list[Any] = []
        self.fragments: dict[int, Any] = {}
        #: The tensor names so far, to refuse two keys that flatten to the same one.
        self.seen: set[str] = set()
        #: ids of the containers being walked, to refuse a reference cycle.
        self.active: set[int] = set()
        self.cuda = False
        self.trusted = True
        self.dtensors: list[Any] = []
        #: The first name and tensor staged at each data pointer, to find a tensor saved under
        #: two keys.
        self.by_ptr: dict[int, tuple[str, torch.Tensor]] = {}
        #: (tensor slot, key slot, generator) of each generator met: captured last.
        self.generators: list[tuple[int, int, torch.Generator]] = []

    def flatten(self, state: Any) -> Flat:
        """The Flat of ``state``, a mapping or a stateful object."""
        if not isinstance(state, Mapping) and not is_stateful(state):
            raise UnsupportedValueError(
                "", f"the state must be a mapping, not {type(state).__name__}"
            )
        # A state tree is thousands of fresh lists and dicts: the cyclic GC would walk them
        # again and again, for as long as the walk itself takes. Nothing here is cyclic.
        with gc_paused():
            try:
                tree = self.walk(state, "", 0)
                _capture_generators(self)
            except UnsupportedValueError as first:
                if self.collecting:
                    raise
                from .problems import every_problem  # (a walk of its own: imports this)

                raise every_problem(state, first) from None
        return Flat(
            self.names,
            self.tensors,
            tree,
            tuple(self.key),
            self.fragments,
            self.cuda,
            self.trusted,
            self.dtensors,
        )

    def walk(self, value: Any, path: str, depth: int) -> Any:
        """The tree node of ``value``, found at key path ``path``."""
        if isinstance(value, torch.Tensor):
            return self.tensor_node(value, path)
        np = sys.modules.get("numpy")  # no numpy value exists unless something imported it
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            return self.numpy_node(value, path, np)
        if isinstance(value, torch.Generator):
            return {GENERATOR: [str(value.device), _add_generator(self, value, path)]}
        if value is None or isinstance(value, (bool, int, str)):
            if isinstance(value, str) and "\x00" in value:
                raise UnsupportedValueError(path, "strings with NUL characters are not stored")
            why = values.scalar_problem(value)  # what the manifest reader would refuse
            if why is not None:
                raise UnsupportedValueError(path, why)
            return {VALUE: value}
        if isinstance(value, float):
            return {VALUE: value} if math.isfinite(value) else {FLOAT: encode_float(value)}
        if id(value) in self.active:
            raise UnsupportedValueError(path, "the state contains a reference cycle")
        if depth >= MAX_TREE_DEPTH:
            raise UnsupportedValueError(
                path, f"the state nests deeper than {MAX_TREE_DEPTH} levels"
            )
        self.active.add(id(value))
        try:
            if isinstance(value, Mapping):
                if self.met is not None and len(value) >= FRAGMENT_MIN:
                    ref = self.fragment(value, path)
                    if ref is not None:
                        return ref
                return self.mapping(value, path, depth)
            if isinstance(value, (list, tuple)):
                if type(value) is not list and type(value) is not tuple:
                    raise UnsupportedValueError(path, _subclass_problem(value))
                tag = LIST if isinstance(value, list) else TUPLE
                return {tag: [self.walk(v, _path(path, i), depth + 1) for i, v in enumerate(value)]}
            if is_stateful(value):
                sd = _state_dict(value, path)
                if not isinstance(sd, Mapping):
                    raise UnsupportedValueError(path, "state_dict() did not return a mapping")
                return {STATEFUL: self.walk(sd, path, depth + 1)}
        finally:
            self.active.discard(id(value))
        if dataclasses.is_dataclass(value):
            raise UnsupportedValueError(
                path,
                f"a dataclass ({_type_name(value)}) is not saved, since it would come back as "
                "a dict: save dataclasses.asdict(value) and rebuild it after loading, or give "
                "it state_dict()/load_state_dict()",
            )
        raise UnsupportedValueError(
            path,
            f"values of type {_type_name(value)} cannot be saved "
            "(tensors, JSON values, and objects with state_dict()/load_state_dict() can)",
        )

    def mapping(self, value: Mapping, path: str, depth: int) -> dict[str, Any]:
        """The DICT node of ``value``."""
        # The hot loop of a big state dict: tensor values and str keys go straight through,
        # without a recursive call or the full key check.
        items = []
        prefix = f"{path}/" if path else ""
        add_tensor, walk = self.add_tensor, self.walk
        for k, v in value.items():
            if (type(k) is not str or "\x00" in k or not k.isascii()) and not self.key_ok(k, path):
                continue
            child = f"{prefix}{k}"
            if type(v) in _PLAIN_TENSORS:
                items.append([k, {TENSOR: add_tensor(v, child)}])
            elif isinstance(v, torch.Tensor):
                items.append([k, self.tensor_node(v, child)])
            else:
                items.append([k, walk(v, child, depth + 1)])
        return {DICT: items}

    def numpy_node(self, value: Any, path: str, np: Any) -> dict[str, Any]:
        """The node of a numpy array (stored as a tensor) or numpy scalar (as a value)."""
        if isinstance(value, np.generic):
            kind = value.dtype.name
            if kind not in NP_SCALAR_DTYPES:
                raise UnsupportedValueError(path, f"numpy scalars of {kind} are not saved")
            item = value.item()
            if isinstance(item, float) and not math.isfinite(item):
                item = encode_float(item)
            return {NPSCALAR: [kind, item]}
        if value.dtype.byteorder == ">" or value.dtype.hasobject:
            raise UnsupportedValueError(
                path, f"numpy arrays of {value.dtype} are not saved (native numeric dtypes are)"
            )
        array = np.ascontiguousarray(value)
        if not array.flags.writeable:
            array = array.copy()  # torch.from_numpy warns on read-only memory
        try:
            t = torch.from_numpy(array)
        except TypeError:
            raise UnsupportedValueError(
                path, f"numpy arrays of {value.dtype} have no torch equivalent"
            ) from None
        return {NDARRAY: self.add_tensor(t, path, alias=False)}

    def key_ok(self, key: Any, path: str) -> bool:
        """True for a key the tree can hold; else raises UnsupportedValueError."""
        _check_key(key, path)
        return True

    def fragment(self, value: Mapping, path: str) -> str | dict | None:
        """The mapping as a fragment reference; None when it is not all tensors; its plain
        node when it holds a tensor met before."""
        keys = tuple(value)
        values = list(value.values())
        if not set(map(type, values)) <= _PLAIN_TENSORS or set(map(type, keys)) != {str}:
            return None
        assert self.known is not None
        assert self.met is not None
        frag = self.known.get(path)
        if frag is not None and frag.keys == keys:
            self.reuse(frag, values)
        else:
            first, was_cuda = len(self.names), self.cuda
            self.cuda = False
            node = self.mapping(value, path, 0)
            if len(self.names) - first != len(values):
                # A tensor of it was met before: a tied weight. Its node names the first key,
                # which reuse on trust could not check: it stays a plain mapping.
                self.cuda = self.cuda or was_cuda
                return node
            frag = Fragment(next(_fragment_ids), keys, tuple(self.names[first:]), node, self.cuda)
            self.cuda = self.cuda or was_cuda
            del self.key[len(self.key) - len(frag.names) :]  # the fragment's id stands for them
        self.met[path] = frag
        self.key.append(frag.id)
        self.fragments[frag.id] = frag.node
        return fragment_ref(frag.id)

    def reuse(self, frag: Fragment, values: list[torch.Tensor]) -> None:
        """Take a known fragment's names for ``values`` on trust (see Flattener)."""
        seen = self.seen
        n = len(seen)
        seen.update(frag.names)
        if len(seen) != n + len(frag.names):
            prior = set(self.names)
            name = next(x for x in frag.names if x in prior)
            raise UnsupportedValueError(
                name, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
            )
        self.names.extend(frag.names)
        self.tensors.extend(values)
        self.trusted = False
        self.cuda = self.cuda or frag.cuda

    def tensor_node(self, t: torch.Tensor, path: str) -> dict[str, str]:
        """The tree node of tensor ``t`` (a DTensor's too), recorded under ``path``."""
        dtensor_type = _dtensor_type()
        if dtensor_type is not None and isinstance(t, dtensor_type):
            return {DTENSOR: self.add_dtensor(t, path)}
        if _is_sharded_tensor(t):
            # Its dtype, layout or data pointer each raise inside torch: refuse it by name.
            raise UnsupportedValueError(
                path,
                "a ShardedTensor (FSDP1's sharded state dict) is not saved: use FSDP2 "
                "(fully_shard), whose parameters are DTensors, or get the state dict with "
                "torch.distributed.checkpoint.state_dict.get_state_dict, which gives DTensors",
            )
        return {TENSOR: self.add_tensor(t, path)}

    def add_dtensor(self, t: Any, path: str) -> str:
        """Record DTensor ``t`` under ``path``: the chunk this rank writes, if any, is staged
        like a tensor of its own."""
        from . import dtensor

        if t.dtype not in TORCH_TO_ST:
            raise UnsupportedValueError(path, _tensor_problem(t))
        held = dtensor.describe(t, path)
        if path in self.seen:
            raise UnsupportedValueError(
                path, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
            )
        self.dtensors.append(held)
        if held.writes:
            self.add_tensor(t._local_tensor, path, alias=False)  # its own chunk, always
        else:
            self.seen.add(path)
        self.key.append((DTENSOR, path, t.dtype, *held.key))
        return path

    def add_tensor(self, t: torch.Tensor, path: str, *, alias: bool = True) -> str:
        """Record tensor ``t`` under its name ``path``; return the name (with ``alias``, the
        name of the same tensor met before under another key, if any)."""
        # The hot loop at 20k tensors: few attribute reads, no detach (copy_ runs under
        # no_grad), and (name, dtype, shape) kept for the layout cache's key.
        dtype = t.dtype
        if (
            dtype not in TORCH_TO_ST
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or not (t.is_cpu or t.is_cuda)
        ):
            raise UnsupportedValueError(path, _tensor_problem(t))
        seen = self.seen
        if path in seen:
            raise UnsupportedValueError(
                path, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
            )
        if not t.is_cpu:
            self.cuda = True
        seen.add(path)
        ptr = t.data_ptr()
        first = self.by_ptr.get(ptr) if alias else None
        if first is not None and _same_tensor(first[1], t):
            # The same tensor under another key (tied weights): stored once, both keys name it.
            self.key.append(("=", path, first[0]))
            return first[0]
        self.by_ptr[ptr] = (path, t)
        self.names.append(path)
        self.tensors.append(t)
        self.key.append((path, dtype, t.shape))
        return path


def _add_generator(walk: _Walk, gen: torch.Generator, path: str) -> str:
    """Keep generator ``gen``'s place in ``walk``, under its name ``path``: its state is
    captured once the whole state is walked, after every other ``state_dict()`` call, which
    may draw from it (a sampler, an augmentation), as a load restores it after every other
    ``load_state_dict()``."""
    if path in walk.seen:
        raise UnsupportedValueError(
            path, "two keys flatten to this tensor name (e.g. int 0 and str '0')"
        )
    walk.seen.add(path)
    walk.generators.append((len(walk.tensors), len(walk.key), gen))
    walk.names.append(path)
    walk.tensors.append(_NO_STATE)
    walk.key.append(None)
    return path


def _capture_generators(walk: _Walk) -> None:
    """Capture the state of every generator ``walk`` met (see :func:`_add_generator`)."""
    for slot, key_slot, gen in walk.generators:
        state = gen.get_state()  # a fresh CPU byte tensor, whatever the generator's device
        walk.tensors[slot] = state
        walk.key[key_slot] = (walk.names[slot], state.dtype, state.shape)


#: What a generator's slot holds until its state is captured.
_NO_STATE = torch.empty(0, dtype=torch.uint8)
