"""Flatten a state into tensors plus a JSON tree, and rebuild or restore it on load.

The tree format is described in ``_core.tree``: one tagged node per value, a tensor's name
being its key path joined by "/". Nothing is pickled: any value that is not a tensor, a JSON
value, or an object with state_dict()/load_state_dict() is refused with its key path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from .._core import values
from .._core.format import fragment_ref
from .._core.gc import gc_paused, no_gc
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
    KeyPaths,
    decode_float,
    encode_float,
)
from ..errors import LoadMismatchError, StateDictError, UnsupportedValueError
from .dtypes import ST_TO_TORCH as ST_TO_TORCH
from .dtypes import TORCH_TO_ST as TORCH_TO_ST


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is saved through its state_dict() and restored by load_state_dict()."""
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
    #: The DTensors in tree order (dtensor.Held); the chunks this rank writes are among
    #: ``names`` and ``tensors`` (their local tensors), under their own names.
    dtensors: list[Any] = field(default_factory=list)

    @property
    def chunk_names(self) -> frozenset[str]:
        """The names of the DTensor chunks this rank writes."""
        return frozenset(h.name for h in self.dtensors if h.writes)


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
        """Flatten ``state``; with ``remember`` False (a load looking up the layout of the
        state it restores into) the mappings met for the first time are added to the cache
        and none is dropped: a resumed run's first save then finds what its load learned
        (and the layout the load made: at 20k tensors 0.2-0.4 s), and a load into another
        state costs the training loop's saves nothing."""
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
        "key",
        "known",
        "met",
        "names",
        "seen",
        "tensors",
        "trusted",
    )

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

    def flatten(self, state: Any) -> Flat:
        """The Flat of ``state``, a mapping or a stateful object."""
        if not isinstance(state, Mapping) and not is_stateful(state):
            raise UnsupportedValueError(
                "", f"the state must be a mapping, not {type(state).__name__}"
            )
        # A state tree is thousands of fresh lists and dicts: the cyclic GC would walk them
        # again and again (measured: it doubled flatten's time at 20k tensors). Nothing here
        # is cyclic.
        with gc_paused():
            try:
                tree = self.walk(state, "", 0)
            except UnsupportedValueError as first:
                if isinstance(self, _Collecting):
                    raise
                raise _every_problem(state, first) from None
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
            # Its state is a fresh CPU byte tensor, whatever the generator's device.
            name = self.add_tensor(value.get_state(), path, alias=False)
            return {GENERATOR: [str(value.device), name]}
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


class _Collecting(_Walk):
    """A walk that records every value it refuses and goes on: what a refused state is walked
    again with, so that one error names every key path at fault, not one per attempt."""

    __slots__ = ("problems",)

    def __init__(self) -> None:
        super().__init__(None, None)
        self.problems: list[UnsupportedValueError] = []

    def walk(self, value: Any, path: str, depth: int) -> Any:
        try:
            return super().walk(value, path, depth)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return {VALUE: None}

    def tensor_node(self, t: torch.Tensor, path: str) -> dict[str, str]:
        try:
            return super().tensor_node(t, path)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return {VALUE: None}  # type: ignore[dict-item]

    def add_tensor(self, t: torch.Tensor, path: str, *, alias: bool = True) -> str:
        try:
            return super().add_tensor(t, path, alias=alias)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return path

    def key_ok(self, key: Any, path: str) -> bool:
        try:
            return super().key_ok(key, path)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return False


def _every_problem(state: Any, first: UnsupportedValueError) -> UnsupportedValueError:
    """One error naming every value of ``state`` that cannot be saved (``first`` was the
    first found)."""
    walk = _Collecting()
    with contextlib.suppress(Exception):  # a state_dict() failing the second time
        walk.walk(state, "", 0)
    found = [(p, m) for e in walk.problems for p, m in e.problems] or first.problems
    return UnsupportedValueError(found[0][0], found[0][1], more=found[1:])


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


# --------------------------------------------------------------------------- load


def unflatten(
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    held: Mapping[str, Any] | None = None,
    later: list[Callable[[], object]] | None = None,
) -> Any:
    """Rebuild the saved nesting; objects saved through state_dict() come back as their dicts.

    A distributed tensor comes back whole, as a plain tensor, unless ``held`` has a DTensor
    (dtensor.Held) of its name: then as a DTensor like that one, of this rank's chunk. With
    ``later``, a generator's state is set by a call appended there, not now (a restore
    plans before its tensors hold their bytes).
    """
    # Recursive, unlike _core.tree.walk: a rebuild needs its children's values, and the tree
    # was checked (its depth bounded) before it got here.
    tag, body = next(iter(tree.items()))
    if tag in (TENSOR, DTENSOR):
        if held and body in held:
            return _as_dtensor(held[body], tensors[body], body)
        return tensors[body]
    if tag == DICT:
        return {k: unflatten(v, tensors, held, later) for k, v in body}
    if tag == LIST:
        return [unflatten(v, tensors, held, later) for v in body]
    if tag == TUPLE:
        return tuple(unflatten(v, tensors, held, later) for v in body)
    if tag == STATEFUL:
        return unflatten(body, tensors, held, later)
    if tag == FLOAT:
        return decode_float(body)
    if tag == NDARRAY:
        return tensors[body].numpy()
    if tag == GENERATOR:
        gen = torch.Generator(device=body[0])
        # A copy of its own: set_state reads the storage from its start, ignoring the offset
        # of a view into the loaded buffer.
        state = tensors[body[1]]
        if later is None:
            gen.set_state(state.clone())
        else:
            later.append(lambda: gen.set_state(state.clone()))
        return gen
    if tag == NPSCALAR:
        import numpy as np

        value = decode_float(body[1]) if isinstance(body[1], str) else body[1]
        return np.dtype(body[0]).type(value)
    return body


def local_part(held: Any, src: torch.Tensor, path: str) -> torch.Tensor | None:
    """This rank's chunk of the DTensor ``held`` from ``src``: the chunk itself as loaded,
    or cut out of the whole tensor; None on a rank outside the mesh."""
    chunk = held.chunk
    if chunk is None:
        return None
    if tuple(src.shape) == chunk.sizes:
        return src
    if tuple(src.shape) == held.shape:
        return src[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]
    raise LoadMismatchError(
        f"{path or '<root>'}: saved {src.dtype}{list(src.shape)} does not fit the DTensor "
        f"{held.tensor.dtype}{list(held.shape)}"
    )


def _dry_run(obj: Any, value: Any, path: str, own: Any = None, strict: bool = True) -> None:
    """Raise LoadMismatchError for what ``obj.load_state_dict(value)`` would refuse, where that
    can be told without calling it: a module's missing or unexpected keys (``strict``) and
    tensor shapes (but where the module resizes as it loads, see _resizes), an optimizer's
    parameter groups and their sizes. ``own``: the module's state dict, when known."""
    where = path or "<root>"
    if isinstance(obj, torch.nn.Module) and isinstance(value, Mapping):
        own = _state_dict(obj, path) if own is None else own
        missing = [k for k in own if k not in value]
        unexpected = [k for k in value if k not in own]
        if strict and (missing or unexpected):
            raise LoadMismatchError(
                f"{where}: the module's load_state_dict would refuse the saved state dict "
                f"(missing: {_listed(missing) or 'none'}; unexpected: "
                f"{_listed(unexpected) or 'none'})"
            )
        for k, mine in own.items():
            saved = value.get(k)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(saved, torch.Tensor)
                and (is_lazy(mine) or mine.shape != saved.shape)
                and not _resizes(obj, k)
            ):
                raise LoadMismatchError(
                    f"{_path(path, k)}: saved {saved.dtype}{list(saved.shape)} does not "
                    f"fit {mine.dtype}{list(mine.shape)}"
                )
    elif isinstance(obj, torch.optim.Optimizer) and isinstance(value, Mapping):
        groups = value.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(obj.param_groups):
            n = len(groups) if isinstance(groups, list) else "no"
            raise LoadMismatchError(
                f"{where}: saved {n} parameter groups, the optimizer has {len(obj.param_groups)}"
            )
        for i, (saved, mine) in enumerate(zip(groups, obj.param_groups, strict=True)):
            params = saved.get("params") if isinstance(saved, Mapping) else None
            if not isinstance(params, list) or len(params) != len(mine["params"]):
                raise LoadMismatchError(
                    f"{where}: parameter group {i} was saved with "
                    f"{len(params) if isinstance(params, list) else 'no'} parameters, the "
                    f"optimizer's has {len(mine['params'])}"
                )


_MODULE_LOAD = torch.nn.Module.load_state_dict
_MODULE_LOAD_FROM = torch.nn.Module._load_from_state_dict


def _resizes(module: torch.nn.Module, key: str) -> bool:
    """Whether ``module``'s load_state_dict decides for itself what its state dict's ``key``
    may hold: it is not torch's own, or the submodule owning the key loads its state its own
    way (``_load_from_state_dict`` overridden, as a module resizing a buffer does), or a load
    pre-hook on the way to it may change what it gets (lazy modules materialize so). A shape
    the module would refuse is then refused by the module, when it loads."""
    if type(module).load_state_dict is not _MODULE_LOAD:
        return True
    owner: torch.nn.Module | None = module
    for name in key.split(".")[:-1]:
        assert owner is not None
        if owner._load_state_dict_pre_hooks:
            return True
        owner = owner._modules.get(name)
        if owner is None:
            return False
    assert owner is not None
    return bool(owner._load_state_dict_pre_hooks) or (
        type(owner)._load_from_state_dict is not _MODULE_LOAD_FROM
    )


class _Lenient:
    """A module to load with ``strict=False``: what the checkpoint lacks keeps its value,
    what the module lacks is left out (load(strict=False) all the way down)."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load_state_dict(self, value: Mapping[str, Any]) -> None:
        self.module.load_state_dict(value, strict=False)


def _as_dtensor(held: Any, src: torch.Tensor, path: str) -> Any:
    """A DTensor placed like ``held`` holding this rank's chunk of ``src``."""
    from torch.distributed.tensor import DTensor

    like = held.tensor
    local = local_part(held, src, path)
    if local is None:
        local = like._local_tensor.new_empty(like._local_tensor.shape)
    if src.dtype != like.dtype:
        raise LoadMismatchError(
            f"{path or '<root>'}: saved {src.dtype} does not fit the DTensor's {like.dtype}"
        )
    local = local.to(like._local_tensor.device)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


@no_gc
def load_into(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] = torch._foreach_copy_,
    held: Mapping[str, Any] | None = None,
    strict: bool = True,
    scope: tuple[str, ...] | None = None,
) -> Any:
    """Restore ``tree`` into ``target`` in place where it can; return the restored value.

    Everything is checked before anything changes: keys (with ``strict``: the saved keys and
    the target's keys of every dict must be the same), tensor shapes and dtypes, and what a
    module's or optimizer's load_state_dict would refuse. A mismatch raises
    :class:`LoadMismatchError` and leaves ``target`` as it was. Then tensors are copied into
    the target's tensors (a DTensor's: into its local tensor), all in one ``copy(targets,
    sources)`` call; anything else gets ``tensors`` themselves (a load that reads into a
    reused slab plans with plan_restore instead, handing over tensors of their own).
    ``held`` has the target's DTensors by key path (dtensor.Held). Without ``strict``, what
    both hold is restored and the rest left as it is: saved keys the target lacks are not
    added, target keys the checkpoint lacks keep their values; the returned Restored says
    which. ``scope`` (the key
    paths a load selected) limits the key check to what lies under them.
    """
    return plan_restore(target, tree, tensors, tensors, held, strict, scope).finish(copy)


@no_gc  # the walk's lists and sizes: a full GC pass of up to 80 ms at 20k tensors
def plan_restore(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    fresh: Mapping[str, torch.Tensor],
    held: Mapping[str, Any] | None,
    strict: bool,
    scope: tuple[str, ...] | None,
    make: Callable[..., _Restorer] | None = None,
) -> _Restorer:
    """The checks and the plan of :func:`load_into`, nothing changed yet: ``tensors`` are
    the sources copied in place (``Restorer.srcs`` are them or views of them), ``fresh``
    gives the values that are handed over instead (a module's or optimizer's state dict, a
    tensor with no tensor to copy into); ``finish`` then makes the changes. ``make``: the
    restorer's class (a subclass that carries the plan out in another order, say)."""
    restorer = (make or _Restorer)(tensors, fresh, held or {})
    restorer.strict = strict
    restorer.result = restorer.restore(target, tree, "")
    if scope is not None:  # target keys outside the selection read were not asked for
        asked = KeyPaths(scope)
        restorer.only_target = [p for p in restorer.only_target if asked.selects(p)]
    if strict and (restorer.only_saved or restorer.only_target):
        raise LoadMismatchError(restorer.key_difference())
    return restorer


@dataclass(frozen=True, slots=True)
class Restored:
    """What load_into did: the restored value, and the key paths the checkpoint and the target
    did not share."""

    value: Any
    #: Saved key paths the target lacked (not restored).
    only_saved: tuple[str, ...] = ()
    #: Target key paths the checkpoint lacked (left as they were).
    only_target: tuple[str, ...] = ()


#: The size from which a dict is first tried as a whole by _Restorer.tensor_dict.
BATCH_MIN = 32
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _listed(paths: list[str], limit: int = 10) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", … ({len(paths)} in all)" if len(paths) > limit else "")


class _Restorer:
    """One load_into: the walk of the target against the tree, checking as it goes and
    collecting what to change; nothing changes until the walk is over."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        fresh: Mapping[str, torch.Tensor],
        held: Mapping[str, Any],
    ) -> None:
        self.tensors = tensors
        self.fresh = fresh
        self.held = held
        self.result: Any = None
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        #: (container, key, value): an item to set; (object, state dict): a load_state_dict.
        self.sets: list[tuple[Any, Any, Any]] = []
        self.loads: list[tuple[Any, Any]] = []
        #: Other in-place restores (a generator's state, a numpy array's bytes).
        self.calls: list[Callable[[], object]] = []
        self.only_saved: list[str] = []
        self.only_target: list[str] = []
        #: Whether keys must match; without, a module loads with strict=False too.
        self.strict = True

    def lenient(self, module: torch.nn.Module, value: Any, path: str) -> _Lenient:
        """Plan a ``strict=False`` load of ``module``: the keys it and the checkpoint do not
        share noted, and checked as its load_state_dict(strict=False) would check them."""
        own = _state_dict(module, path)
        if isinstance(value, Mapping):
            self.only_saved.extend(_path(path, k) for k in value if k not in own)
            self.only_target.extend(_path(path, k) for k in own if k not in value)
        _dry_run(module, value, path, own, strict=False)
        return _Lenient(module)

    def finish(self, copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> Restored:
        """Make the planned changes: ``copy(dsts, srcs)``, then the items set, the in-place
        restores and the load_state_dict calls."""
        if self.dsts:
            with torch.no_grad():
                copy(self.dsts, self.srcs)
        for container, key, value in self.sets:
            container[key] = value
        for call in self.calls:
            call()
        for obj, value in self.loads:
            obj.load_state_dict(value)
        return Restored(self.result, tuple(self.only_saved), tuple(self.only_target))

    def key_difference(self) -> str:
        parts = []
        if self.only_saved:
            parts.append(f"saved but not in the target: {_listed(self.only_saved)}")
        if self.only_target:
            parts.append(f"in the target but not saved: {_listed(self.only_target)}")
        return (
            "the checkpoint and the target hold different keys ("
            + "; ".join(parts)
            + "); nothing was restored (strict=False restores what matches)"
        )

    def restore(self, target: Any, tree: Any, path: str) -> Any:
        """The restored value of ``target``, found at key path ``path``."""
        tag, body = next(iter(tree.items()))
        if isinstance(target, torch.Tensor):
            return self.tensor(target, tag, body, path)
        if isinstance(target, torch.Generator) and tag == GENERATOR:
            state = self.fresh[body[1]]
            self.calls.append(lambda: target.set_state(state.clone()))  # see unflatten
            return target
        if tag == NDARRAY and type(target).__name__ == "ndarray":
            return self.ndarray(target, body, path)
        if is_stateful(target):
            inner = body if tag == STATEFUL else tree
            value = unflatten(inner, self.fresh, self.held, self.calls)
            if self.strict or not isinstance(target, torch.nn.Module):
                _dry_run(target, value, path)
                self.loads.append((target, value))
            else:
                self.loads.append((self.lenient(target, value, path), value))
            return target
        if tag == STATEFUL:
            tag, body = next(iter(body.items()))
        if isinstance(target, dict) and tag == DICT:
            if len(body) >= BATCH_MIN and self.tensor_dict(target, body):
                return target
            saved = set()
            for k, node in body:
                saved.add(k)
                child = _path(path, k)
                if k in target:
                    value = self.restore(target[k], node, child)
                    if value is not target[k]:
                        self.sets.append((target, k, value))
                else:
                    self.only_saved.append(child)
            self.only_target.extend(_path(path, k) for k in target if k not in saved)
            return target
        if isinstance(target, list) and tag in (LIST, TUPLE) and len(target) == len(body):
            for i, node in enumerate(body):
                value = self.restore(target[i], node, _path(path, i))
                if value is not target[i]:
                    self.sets.append((target, i, value))
            return target
        return unflatten({tag: body}, self.fresh, later=self.calls)

    def tensor_dict(self, target: dict, body: list) -> bool:
        """Plan the restore of ``target``, a dict of plain tensors saved as one (a model's
        state dict), in a few passes over it instead of a walk and a check per key: 77 ms ->
        42 ms at 20k tensors, most of it reading 40k shapes and dtypes. (A load(into=) plans
        while the daemon reads, see Loader._restore_while_read: on 2 cores they compete.)
        False, nothing planned, where that does not apply: the keys differ, a value is not a
        plain tensor on either side, a shape or dtype differs, or DTensors are held (they
        are matched by key path); the walk then takes each key in turn and words what is
        wrong."""
        keys = {k for k, _ in body}
        if self.held or len(keys) != len(body) or target.keys() != keys:
            return False
        try:
            names = [node[TENSOR] for _, node in body]
            srcs = [self.tensors[name] for name in names]
        except (KeyError, TypeError):
            return False
        dsts = [target[k] for k, _ in body]
        if (
            not _PLAIN_TENSORS.issuperset(map(type, dsts))
            or not _PLAIN_TENSORS.issuperset(map(type, srcs))
            or list(map(_DTYPE, srcs)) != list(map(_DTYPE, dsts))
            or list(map(_SHAPE, srcs)) != list(map(_SHAPE, dsts))
        ):
            return False
        self.dsts += dsts
        self.srcs += srcs
        return True

    def ndarray(self, target: Any, name: str, path: str) -> Any:
        """Restore a numpy array in place (it is checked now, copied when all is checked)."""
        src = self.fresh[name].numpy()
        if src.shape != target.shape or src.dtype != target.dtype or not target.flags.writeable:
            raise LoadMismatchError(
                f"{path or '<root>'}: saved numpy {src.dtype}{list(src.shape)} does not fit "
                f"{target.dtype}{list(target.shape)}"
                + ("" if target.flags.writeable else " (read-only)")
            )
        import numpy as np

        self.calls.append(lambda: np.copyto(target, src))
        return target

    def tensor(self, target: torch.Tensor, tag: str, body: Any, path: str) -> torch.Tensor:
        if tag not in (TENSOR, DTENSOR):
            raise LoadMismatchError(f"{path or '<root>'}: the checkpoint holds no tensor here")
        src: torch.Tensor | None = self.tensors[body]
        dst = target
        held = self.held.get(path)
        if held is not None and held.tensor is target:
            assert src is not None
            if src.dtype != target.dtype:
                raise LoadMismatchError(
                    f"{path or '<root>'}: saved {src.dtype} does not fit the DTensor's "
                    f"{target.dtype}"
                )
            src = local_part(held, src, path)
            if src is None:
                return target  # this rank holds none of it
            dst = target._local_tensor
        assert src is not None
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise LoadMismatchError(
                f"{path or '<root>'}: saved {src.dtype}{list(src.shape)} does not fit "
                f"{dst.dtype}{list(dst.shape)}"
            )
        self.dsts.append(dst)
        self.srcs.append(src)
        return target
