"""The state tree: how a checkpoint records the nesting of a saved state, in JSON.

The tree keeps the state's exact nesting, one tagged node (a one-member object) per value:

    {"T": name}              TENSOR: a tensor, stored in the shard under ``name``
    {"X": name}              DTENSOR: a distributed tensor, the entry ``name`` of the
                             manifest's ``dtensors`` table (format version 2)
    {"G": [device, name]}    GENERATOR: a torch.Generator of ``device``, its get_state()
                             stored as the tensor ``name`` (format version 2)
    {"N": name}              NDARRAY: a numpy array, stored as the tensor ``name`` (version 2)
    {"n": [dtype, value]}    NPSCALAR: a numpy scalar of the numpy dtype name ``dtype``; its
                             value as a VALUE or FLOAT body holds it (version 2)
    {"D": [[key, node], …]}  DICT: a dict; keys are str or int (optimizers key state by int)
    {"L": [node, …]}         LIST: a list
    {"U": [node, …]}         TUPLE: a tuple
    {"S": node}              STATEFUL: an object with state_dict()/load_state_dict(); node is
                             its state dict
    {"V": value}             VALUE: int, str, bool, None or a finite float
    {"F": "nan"|"inf"|"-inf"} FLOAT: a non-finite float (JSON has no literal for it)

and, only on the pipe to the daemon, a reference string (``format.fragment_ref``) in place of
a mapping of tensors sent before (see ``_trainer.state.Flattener``); the daemon splices the
mapping back in, so a stored tree never holds one.

Tensor names are the key path joined by "/", so a checkpoint opened with safetensors reads as
``model/layer.weight``. Nothing is pickled: the trainer refuses any other value with its key
path.

The trainer builds and restores trees (``_trainer.state``); this module holds what the two
processes share, without torch: the tags, the encoding of non-finite floats (metrics use it
too), and one iterative walker, :func:`walk`, over which the daemon validates a tree read
from storage (:func:`check_tree`) and the CLI lists a tree's values (:func:`plain_values`).
"""

from __future__ import annotations

import collections
import json
import math
import reprlib
from collections.abc import Iterable, Iterator
from typing import Any, Final

from ..errors import CorruptCheckpointError
from .gc import no_gc

# The depth limit and the rules for plain values are values', which save() checks too.
from .values import MAX_TREE_DEPTH as MAX_TREE_DEPTH
from .values import NON_FINITE as NON_FINITE
from .values import key_problem, scalar_problem

#: The tags of the nodes, as the table above describes them.
TENSOR: Final = "T"
DTENSOR: Final = "X"
GENERATOR: Final = "G"
NDARRAY: Final = "N"
NPSCALAR: Final = "n"
#: The tags a version-1 reader does not know: a tree holding one makes a version-2 checkpoint.
#: In a tree's JSON text a tag appears as '{"G":' and nowhere else (a string holding those
#: characters escapes its quotes), so finding one needs no parse.
V2_TAGS: Final = (DTENSOR, GENERATOR, NDARRAY, NPSCALAR)
#: numpy dtypes a NPSCALAR may name.
NP_SCALAR_DTYPES: Final = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "float32", "float64"}
)
DICT: Final = "D"
LIST: Final = "L"
TUPLE: Final = "U"
STATEFUL: Final = "S"
VALUE: Final = "V"
FLOAT: Final = "F"


def encode_float(value: float) -> float | str:
    """``value`` as JSON can hold it: itself when finite, else "nan", "inf" or "-inf"."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def decode_float(text: str) -> float:
    """The float a NON_FINITE string stands for."""
    return float(text)


class MalformedTree(ValueError):
    """A tree that breaks the format; the message says how (bounded: no whole untrusted value)."""


#: What an empty container shows as in :func:`plain_values`.
_EMPTY = {DICT: "{}", LIST: "[]", TUPLE: "()"}


def walk(
    tree: Any,
    *,
    paths: bool = True,
    tensor_names: set[str] | None = None,
    dtensor_names: set[str] | None = None,
) -> Iterator[tuple[str, str, Any, int]]:
    """Every node of ``tree``, parents first, in tree order: (key path, tag, body, depth).

    Iterative, since an untrusted tree may nest deep enough to overflow a recursive walk. Each
    node is checked before it is yielded, and :class:`MalformedTree` raised at the first that
    is not a one-member object with a known tag, nests deeper than MAX_TREE_DEPTH, has a body
    its tag does not allow, or names a tensor not among ``tensor_names`` (when given; a
    distributed tensor: not among ``dtensor_names``, none when not given). A
    stateful object's node has the same path as its state dict. With ``paths`` False every
    path is "" (validation needs none, and at 20k tensors building them costs).
    """
    stack: list[tuple[str, Any, int]] = [("", tree, 0)]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        path, node, depth = pop()
        if depth > MAX_TREE_DEPTH:
            # Loading recurses over the tree and pickles it to the trainer: bound it here.
            raise MalformedTree(f"nested deeper than {MAX_TREE_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise MalformedTree(f"node {bounded_repr(node)}")
        ((tag, body),) = node.items()
        if tag == TENSOR:
            # isinstance first: a list or dict body is unhashable and `in` would raise.
            if tensor_names is not None and (not isinstance(body, str) or body not in tensor_names):
                raise MalformedTree(f"reference to unknown tensor {bounded_repr(body)}")
            yield path, tag, body, depth
            continue
        if tag in _V2_LEAVES:
            _check_v2_leaf(tag, body, tensor_names, dtensor_names)
            yield path, tag, body, depth
            continue
        # A container's children are pushed last first, so that they pop in tree order, and
        # before it is yielded: only a checked node is.
        below = depth + 1
        if tag == DICT:
            if not isinstance(body, list):
                raise MalformedTree("dict body is not a list")
            prefix = f"{path}/" if path else ""
            for item in reversed(body):
                if not isinstance(item, list) or len(item) != 2:
                    raise MalformedTree("dict item")
                key, child = item
                # An ASCII str key is the common case: tested first, in C.
                if (type(key) is not str or not key.isascii()) and (
                    why := key_problem(key)
                ) is not None:
                    raise MalformedTree(f"dict key {bounded_repr(key)}: {why}")
                push((f"{prefix}{key}" if paths else "", child, below))
            yield path, tag, body, depth
        elif tag in (LIST, TUPLE):
            if not isinstance(body, list):
                raise MalformedTree("list body is not a list")
            if paths:
                prefix = f"{path}/" if path else ""
                extend((f"{prefix}{i}", body[i], below) for i in range(len(body) - 1, -1, -1))
            else:
                extend(("", child, below) for child in reversed(body))
            yield path, tag, body, depth
        elif tag == STATEFUL:
            push((path, body, below))
            yield path, tag, body, depth
        elif tag == VALUE:
            why = scalar_problem(body)
            if why is not None:
                raise MalformedTree(f"value {bounded_repr(body)}: {why}")
            yield path, tag, body, depth
        elif tag == FLOAT:
            if body not in NON_FINITE:
                raise MalformedTree("bad float")
            yield path, tag, body, depth
        else:
            raise MalformedTree(f"unknown tag {bounded_repr(tag)}")


@no_gc
def check_tree(
    tree: Any, tensor_names: set[str], *, path: str, dtensor_names: set[str] | None = None
) -> None:
    """Validate an untrusted tree from a manifest; every tensor reference must exist (a
    distributed tensor's among ``dtensor_names``; without them the tree may hold none).

    Raises :class:`CorruptCheckpointError` naming ``path``.
    """
    try:
        # Drained in C: at 20k tensors a Python loop over the nodes cost a fifth more.
        nodes = walk(tree, paths=False, tensor_names=tensor_names, dtensor_names=dtensor_names)
        collections.deque(nodes, maxlen=0)
    except MalformedTree as e:
        raise CorruptCheckpointError(f"{path}: malformed tree: {e}", path=path) from None


def plain_values(tree: Any) -> Iterator[tuple[str, str]]:
    """(key path, value) of every non-tensor leaf of a checked tree, in tree order.

    A value shows as its JSON text, a non-finite float as its NON_FINITE string, an empty
    container below the root as ``{}``, ``[]`` or ``()``; the root's path shows as ``<root>``.
    """
    for path, tag, body, _ in walk(tree, dtensor_names=_ANY):
        if tag in (TENSOR, DTENSOR, GENERATOR, NDARRAY):
            continue
        if tag == NPSCALAR:
            value = body[1]
            text = value if value in NON_FINITE else json.dumps(value, ensure_ascii=False)
            yield path or "<root>", f"numpy.{body[0]}({text})"
        if tag == VALUE:
            yield path or "<root>", json.dumps(body, ensure_ascii=False)
        elif tag == FLOAT:
            yield path or "<root>", body
        elif tag in _EMPTY and not body and path:
            yield path, _EMPTY[tag]


class _Anything(set):
    """Contains every name: a checked tree's references need no second check."""

    def __contains__(self, item: object) -> bool:
        return True


_ANY = _Anything()


def tensor_references(tree: Any) -> tuple[set[str], set[str]]:
    """The names a checked tree refers to: (the shard's tensors, including those of numpy
    arrays and generator states; distributed tensors)."""
    tensors: set[str] = set()
    dtensors: set[str] = set()
    for _, tag, body, _ in walk(tree, paths=False, dtensor_names=_ANY):
        if tag in (TENSOR, NDARRAY):
            tensors.add(body)
        elif tag == GENERATOR:
            tensors.add(body[1])
        elif tag == DTENSOR:
            dtensors.add(body)
    return tensors, dtensors


class KeyPaths:
    """Key paths asked for (a load's ``keys``), asked about one path at a time in time that
    grows with the path's depth, not with the number of keys: a strict=False load into a
    model's state dict asks for every one of its key paths, and comparing each saved path
    with each key grows with the product of the two.

    A path is a key's, or lies under it, when the key is the path or the path's part before
    one of its "/"; a key lies below a path when the path is the key's part before one of
    its "/"."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = frozenset(keys)
        self._below: dict[str, list[str]] = {}
        for k in self.keys:
            i = k.find("/")
            while i != -1:
                self._below.setdefault(k[:i], []).append(k)
                i = k.find("/", i + 1)

    def selects(self, path: str) -> bool:
        """Whether ``path`` is one of the keys or lies under one."""
        return bool(self.above(path))

    def above(self, path: str) -> list[str]:
        """The keys ``path`` is or lies under."""
        found = [path] if path in self.keys else []
        i = path.find("/")
        while i != -1:
            if path[:i] in self.keys:
                found.append(path[:i])
            i = path.find("/", i + 1)
        return found

    def below(self, path: str) -> list[str]:
        """The keys that lie under ``path`` (every key, under the root's empty path)."""
        return list(self.keys) if not path else self._below.get(path, [])


def select_paths(
    tree: Any, keys: tuple[str, ...], dropped: list[str] | None = None
) -> tuple[Any, set[str]]:
    """``tree`` cut down to what lies at or under the key paths ``keys`` (``"model"``,
    ``"model/layers.3"``), with the dicts (and stateful objects) that lead there; and the keys
    that named nothing; ``dropped`` gets the key path of each dict item left out. A list or
    tuple on the way is kept whole: keys select by dict key, and a key under a list counts
    as found. A key under another key asked for is found when something lies at it.
    The root is kept even when nothing is selected (an empty dict). ``tree`` is a checked
    tree (bounded depth), so this may recurse.
    """
    paths = KeyPaths(keys)
    matched: set[str] = set()

    def cut(node: Any, path: str) -> Any:
        above = paths.above(path)
        if above:
            matched.update(above)
            find_below(node, path)
            return node
        if not paths.below(path):
            return None
        ((tag, body),) = node.items()
        if tag == STATEFUL:
            inner = cut(body, path)
            return None if inner is None else {STATEFUL: inner}
        if tag == DICT:
            items = []
            for key, child in body:
                child_path = f"{path}/{key}" if path else str(key)
                kept = cut(child, child_path)
                if kept is not None:
                    items.append([key, kept])
                elif dropped is not None:
                    dropped.append(child_path)
            return {DICT: items} if items else None
        if tag in (LIST, TUPLE):
            matched.update(paths.below(path))  # kept whole
            return node
        return None

    def find_below(node: Any, path: str) -> None:
        """Mark the keys under ``path`` that something in ``node``, kept whole, lies at."""
        below = paths.below(path)
        if not below:
            return
        ((tag, body),) = node.items()
        if tag == STATEFUL:
            find_below(body, path)
        elif tag == DICT:
            for key, child in body:
                child_path = f"{path}/{key}" if path else str(key)
                if child_path in paths.keys:
                    matched.add(child_path)
                find_below(child, child_path)
        elif tag in (LIST, TUPLE):
            matched.update(below)

    pruned = cut(tree, "")
    if pruned is None:
        ((tag, _),) = tree.items()
        pruned = {STATEFUL: {DICT: []}} if tag == STATEFUL else {DICT: []}
    return pruned, set(keys) - matched


_V2_LEAVES = frozenset({DTENSOR, NDARRAY, GENERATOR, NPSCALAR})


def _check_v2_leaf(
    tag: str, body: Any, tensor_names: set[str] | None, dtensor_names: set[str] | None
) -> None:
    """Raise MalformedTree unless ``body`` is a valid body of the version-2 leaf ``tag``."""
    if tag == DTENSOR:
        if dtensor_names is None or not isinstance(body, str) or body not in dtensor_names:
            raise MalformedTree(f"reference to unknown distributed tensor {bounded_repr(body)}")
    elif tag == NPSCALAR:
        if (
            not isinstance(body, list)
            or len(body) != 2
            or body[0] not in NP_SCALAR_DTYPES
            or not _scalar_value(body[1])
        ):
            raise MalformedTree(f"numpy scalar {bounded_repr(body)}")
    else:
        name = body
        if tag == GENERATOR:
            if not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], str):
                raise MalformedTree("generator body")
            name = body[1]
        if tensor_names is not None and (not isinstance(name, str) or name not in tensor_names):
            raise MalformedTree(f"reference to unknown tensor {bounded_repr(name)}")


def _scalar_value(value: Any) -> bool:
    """A NPSCALAR's value: a JSON number or bool (an int of 64 bits, the widest numpy scalar
    aiockpt saves), or a non-finite float's string."""
    if isinstance(value, str):
        return value in NON_FINITE
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**64
    return isinstance(value, (bool, float)) and scalar_problem(value) is None


def bounded_repr(value: Any) -> str:
    """A bounded repr of an untrusted value for an error message (never the whole of it)."""
    if isinstance(value, int) and value.bit_length() > 14_000:
        return f"<an int of {value.bit_length()} bits>"  # repr() of it raises past 4300 digits
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
