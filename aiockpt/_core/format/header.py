"""A shard's safetensors header: built for a save, validated (as untrusted) for a load."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptCheckpointError
from ..dtypes import DTYPE_SIZES
from ..tree import bounded_repr as _short
from .names import MAX_HEADER_BYTES, MAX_NDIM, align_up


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a shard: its name, dtype, shape and byte range inside the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return self.end - self.start


def build_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header, padded with spaces so the data starts aligned."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    for s in specs:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [s.start, s.end],
        }
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    total = align_up(8 + len(text))
    text += b" " * (total - 8 - len(text))
    return struct.pack("<Q", len(text)) + text


def parse_header(head: bytes, file_size: int, *, path: str) -> tuple[int, dict[str, TensorSpec]]:
    """Validate a shard's header; return (data start, specs by name). ``head`` holds it whole."""
    if len(head) < 8:
        raise CorruptCheckpointError(f"{path}: shard shorter than its header length", path=path)
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size or 8 + n > len(head):
        raise CorruptCheckpointError(f"{path}: shard header length {n} is out of range", path=path)
    try:
        raw = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: shard header is not JSON: {e}", path=path) from None
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{path}: shard header is not an object", path=path)
    data_start = 8 + n
    limit = file_size - data_start
    specs: dict[str, TensorSpec] = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            # safetensors defines it as a flat str -> str map.
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CorruptCheckpointError(
                    f"{path}: shard header __metadata__ is not a str -> str map", path=path
                )
            continue
        specs[name] = TensorSpec(
            name, *_tensor_spec(name, entry, limit, path, offsets_key="data_offsets")
        )
    _check_disjoint([(s.start, s.end, s.name) for s in specs.values()], path)
    return data_start, specs


def header_length(first: bytes, nbytes: int, *, path: str) -> int:
    """The size of a shard's header (its 8-byte length and the JSON), from its first bytes;
    a length the shard cannot hold is refused."""
    if len(first) < 8:
        raise CorruptCheckpointError(f"{path}: shard shorter than its header length", path=path)
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER_BYTES or 8 + n > nbytes:
        raise CorruptCheckpointError(f"{path}: shard header length {n} is out of range", path=path)
    return 8 + n


def header_json(head: bytes, *, path: str) -> dict[str, Any]:
    """A shard's header (``head``: all of it, its length included) as JSON, unchecked."""
    try:
        header = json.loads(head[8:])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: shard header is not JSON: {e}", path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: shard header is not an object", path=path)
    return header


def _check_disjoint(ranges: list[tuple[int, int, str]], path: str) -> None:
    """Refuse tensors whose byte ranges (start, end, name) overlap: loaded views of them would
    alias each other."""
    last_end, last_name = 0, None
    for start, end, name in sorted(ranges):
        if start < last_end:
            raise CorruptCheckpointError(
                f"{path}: tensors {last_name!r} and {name!r} overlap", path=path, key=name
            )
        if end > last_end:
            last_end, last_name = end, name


#: torch sizes are int64; the bound also keeps prod() off multi-thousand-digit ints.
_MAX_DIM = 2**63


def _tensor_spec(
    name: Any, entry: Any, limit: int, path: str, *, offsets_key: str
) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one untrusted tensor entry; return (dtype, shape, start, end).

    The hot loop of a 20k-tensor load: plain loops and no closures on the good path.
    """
    if not isinstance(name, str) or not isinstance(entry, dict):
        raise _bad_tensor(path, name, "malformed entry")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _bad_tensor(path, name, f"unknown dtype {_short(dtype)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _bad_tensor(path, name, f"bad shape {_short(shape)}")
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_DIM:
            raise _bad_tensor(path, name, f"bad shape {_short(shape)}")
        numel *= d
    offsets = entry.get(offsets_key)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
        or not 0 <= offsets[0] <= offsets[1] <= limit
    ):
        raise _bad_tensor(path, name, f"byte range {_short(offsets)} lies outside the file")
    start, end = offsets
    if numel * DTYPE_SIZES[dtype] != end - start:
        raise _bad_tensor(
            path, name, f"shape {shape} of {dtype} does not match its {end - start} bytes"
        )
    return dtype, tuple(shape), start, end


def _bad_tensor(path: str, name: Any, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: tensor {_short(name)}: {why}",
        path=path,
        key=name if isinstance(name, str) else None,
    )
