"""Hugging Face safetensors sources, read as untrusted input: a file's header, a folder's
``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``name: {"dtype", "shape", "data_offsets": [begin, end]}``, offsets relative to the data
section, and an optional ``__metadata__`` str -> str map), then the data section. It carries
no checksums: what can be checked is checked here, before a byte of tensor data is read:

- the header length (at most :data:`MAX_HEADER`, as the safetensors library caps it, and
  inside the file) and its JSON (an object);
- every entry's dtype (from aiockpt's list), shape (non-negative ints) and byte range (inside
  the data section, exactly ``prod(shape) × itemsize`` bytes), and that no two ranges overlap
  (:func:`aiockpt._core.format.parse_header` does all of it);
- that the product of every shape's dims, taken from the first dim on, never leaves int64 (as
  torch counts a tensor's elements, and as the safetensors library checks it): a shape such as
  ``[2**40, 2**40, 0]`` holds no bytes, yet no tensor can have it;
- an index's ``weight_map``: str -> a plain file name in the folder (no ``/``, ``\\``,
  ``..``), and every tensor it names is in its file.

Shared, pure code: the daemon reads with it, and it imports neither torch nor either side.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from . import format as fmt

__all__ = [
    "INDEX",
    "MAX_HEADER",
    "SINGLE",
    "STEntry",
    "check_counts",
    "header_end",
    "parse_file_header",
    "parse_index",
]

#: The files of a Hugging Face model folder.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: The largest header accepted: the safetensors library refuses more than 100 MB.
MAX_HEADER = 100_000_000
#: The largest index accepted (a 100k-tensor index is about 10 MB).
MAX_INDEX = 64 * 1024 * 1024

#: The largest element count torch can hold (its sizes and counts are int64).
MAX_NUMEL = 2**63 - 1

#: One tensor of a source: (file, safetensors dtype, shape, start, end), offsets absolute.
STEntry = tuple[str, str, tuple[int, ...], int, int]


def header_end(first: bytes, file_size: int, *, path: str) -> int:
    """Where the header of a file of ``file_size`` bytes ends (its data section starts),
    from its first bytes; a length over :data:`MAX_HEADER` or past the file is refused."""
    if len(first) < 8:
        raise CorruptCheckpointError(f"{path}: not a safetensors file (under 8 bytes)", path=path)
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER or 8 + n > file_size:
        raise CorruptCheckpointError(
            f"{path}: safetensors header length {n} is out of range (the file holds "
            f"{file_size} bytes, a header at most {MAX_HEADER})",
            path=path,
        )
    return 8 + n


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A checked header: where the data section starts, the tensors (offsets absolute) and
    the ``__metadata__`` map."""

    data_start: int
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]
    metadata: dict[str, str]


def parse_file_header(head: bytes, file_size: int, *, path: str) -> FileHeader:
    """Check a whole header (``head``: its length and JSON) of a file of ``file_size`` bytes."""
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    try:
        raw = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raw = None  # parse_header says what is wrong with it
    if isinstance(raw, dict):
        check_counts(raw, path=path)
    data_start, specs = fmt.parse_header(head, file_size, path=path)
    assert isinstance(raw, dict)  # parse_header checked it is a JSON object
    meta = raw.get("__metadata__") or {}
    tensors = {
        name: (s.dtype, s.shape, data_start + s.start, data_start + s.end)
        for name, s in specs.items()
    }
    return FileHeader(data_start, tensors, dict(meta))


def check_counts(header: Mapping[str, Any], *, path: str) -> None:
    """Refuse an entry whose shape's running product (dims multiplied from the first on, as
    torch counts elements) passes :data:`MAX_NUMEL`, whether or not a later dim is 0. Only
    shapes that are lists of non-negative ints are looked at: :func:`parse_header` refuses
    the others."""
    for name, entry in header.items():
        shape = entry.get("shape") if name != "__metadata__" and isinstance(entry, dict) else None
        if not isinstance(shape, list) or len(shape) > fmt.MAX_NDIM:
            continue
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                break
            count *= d
            if count > MAX_NUMEL:
                raise CorruptCheckpointError(
                    f"{path}: tensor {name!r}: shape {shape} counts more elements than an "
                    "int64 holds",
                    path=path,
                    key=name,
                )


def parse_index(data: bytes, *, path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """An index's ``weight_map`` (tensor name -> shard file name in the same folder) and its
    ``metadata``, checked: a shard name that is not a plain file name is refused."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: bad safetensors index: {why}", path=path)

    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise bad("no weight_map object")
    weight_map: Mapping[Any, Any] = raw["weight_map"]
    out: dict[str, str] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not plain_name(file):
            raise CorruptCheckpointError(
                f"{path}: bad safetensors index: tensor {name!r} is in {file!r}, which is not "
                "a file of the folder",
                path=path,
                key=name,
            )
        out[name] = file
    meta = raw.get("metadata")
    return out, dict(meta) if isinstance(meta, dict) else {}


def plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly in its folder: no separator, not . or .., no
    NUL, not empty."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
