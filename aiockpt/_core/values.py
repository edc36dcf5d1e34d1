"""What a checkpoint keeps besides tensors: the rules for the JSON values of a state tree, its
metrics and its metadata.

Both sides apply the same rules: ``save()`` refuses a value that breaks one, naming its key
path, before anything is staged (``_trainer.checks``, ``_trainer.state``), and the reader
refuses a manifest that breaks one as corrupt (``tree.walk``, the manifest's checks in
``format``). So a save never commits a checkpoint that aiockpt itself refuses to read, which
retention could prefer to a good one.

Each ``*_problem`` function returns why a value cannot be kept, or None when it can.
"""

from __future__ import annotations

import math
from typing import Any, Final

#: Deepest nesting of a state tree. Saving and loading recurse (and pickle the tree across the
#: pipe), so a deeper tree would end in RecursionError; 128 levels round-trip with room to spare.
MAX_TREE_DEPTH: Final = 128

#: Deepest nesting of the metadata, counting its own dict as 1: it is pickled to the trainer on
#: load, so it is bounded like a state tree.
MAX_METADATA_DEPTH: Final = 64

#: The strings that stand for non-finite floats, in FLOAT nodes and in a manifest's metrics.
#: A tuple, not a set: ``in`` on it compares, so an unhashable untrusted value cannot raise.
NON_FINITE: Final = ("nan", "inf", "-inf")


#: The most decimal digits of an int that JSON text carries here: Python refuses to write or
#: parse a longer one (``sys.get_int_max_str_digits()``, 4300 by default), so a manifest
#: holding one could not be read. Every earlier aiockpt read ints up to this size back.
MAX_INT_DIGITS: Final = 4300
_INT_LIMIT: Final = 10**MAX_INT_DIGITS


def int_problem(value: int) -> str | None:
    """Why int ``value`` cannot be kept in a state tree or the metadata: it has more than
    MAX_INT_DIGITS decimal digits. (A 128-bit RNG state, or 10**400, is kept exactly.)"""
    if -_INT_LIMIT < value < _INT_LIMIT:
        return None
    # Its size by its bits: str() of an int past the limit raises.
    return (
        f"integers are kept up to {MAX_INT_DIGITS} decimal digits (what JSON text holds "
        f"here); this one is about 10**{int(abs(value).bit_length() * math.log10(2))}"
    )


def metric_int_problem(value: int) -> str | None:
    """Why int ``value`` cannot be a metric: retention compares metrics as floats, so a
    metric is kept when a float can hold its magnitude (up to about 1.8e308)."""
    try:
        float(value)
    except OverflowError:
        return (
            "a metric is compared as a float, which holds up to about 1.8e308; this one is "
            f"about 10**{int(abs(value).bit_length() * math.log10(2))}"
        )
    return None


def text_problem(text: str) -> str | None:
    """Why str ``text`` cannot be kept: the manifest is UTF-8, which cannot encode a lone
    surrogate (what os.fsdecode makes of a name that is not UTF-8, such as b"bad\\xff")."""
    if text.isascii():  # the common case, in C
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"the string {text[:40]!r} holds the lone surrogate {text[e.start]!r} (a non-UTF-8 "
            "name decoded by os.fsdecode, say), which UTF-8 cannot encode: store "
            "os.fsencode(name) as bytes in a tensor, or the name with errors='replace'"
        )
    return None


def scalar_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a JSON scalar of a checkpoint (a state tree's plain value, a
    metadata leaf): None, a bool, a kept int, a finite float or a kept str."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int_problem(value)
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a JSON number"
    if isinstance(value, str):
        return text_problem(value)
    return f"{type(value).__name__} is not a JSON value"


def key_problem(key: Any) -> str | None:
    """Why ``key`` cannot be a key of a state tree's dict: a kept str or int (not a bool)."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        return f"dict keys must be str or int, not {type(key).__name__}"
    return text_problem(key) if isinstance(key, str) else int_problem(key)


def metric_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a metric as the manifest stores it: an int a float can hold, a
    finite float, or one of NON_FINITE for a float that is not finite."""
    if isinstance(value, str):
        return None if value in NON_FINITE else "a metric is a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"a metric is a number, not {type(value).__name__}"
    if isinstance(value, int):
        return metric_int_problem(value)
    return None if math.isfinite(value) else f"{value} is stored as {NON_FINITE}"


def json_problem(value: Any, max_depth: int = MAX_METADATA_DEPTH) -> tuple[str, str] | None:
    """The first (key path, why) in JSON value ``value`` (the metadata) that a checkpoint
    cannot keep: a str key that is not kept, a leaf that breaks scalar_problem, a value of
    another type, or nesting deeper than ``max_depth`` (``value`` itself at depth 1 when it is
    a container). Iterative: an untrusted value may nest too deep for recursion. Tuples count
    as lists (json.dumps writes them so)."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, node, depth = stack.pop()
        if isinstance(node, dict):
            items: list[tuple[Any, Any]] = list(node.items())
        elif isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        else:
            why = scalar_problem(node)
            if why is not None:
                return path, why
            continue
        if depth + 1 > max_depth:
            return path, f"nested deeper than {max_depth} levels"
        prefix = f"{path}/" if path else ""
        for key, child in reversed(items):
            # Keys of other types are json.dumps's to turn into str (or refuse).
            why = text_problem(key) if isinstance(key, str) else None
            if why is not None:
                return prefix + key, why
            stack.append((f"{prefix}{key}", child, depth + 1))
    return None
