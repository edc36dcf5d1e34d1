"""The manifest written: its text spliced from parts encoded once (tensor entries, trees,
the table of distributed tensors), as the daemon commits it."""

from __future__ import annotations

import json
import re
from typing import Any

from ..dtable import BLOCK_BYTES
from ..tree import V2_TAGS
from .header import TensorSpec
from .names import DTENSOR_VERSION, FORMAT, VERSION


def manifest_json(
    *,
    step: int,
    created_at: float,
    world_size: int,
    shards: list[dict[str, Any]],
    tensors_json: str,
    trees_json: str,
    metrics: dict[str, Any],
    metadata: dict[str, Any],
    dtensors_json: str | None = None,
    version: int | None = None,
) -> bytes:
    """The manifest text. ``tensors_json``, ``trees_json`` and ``dtensors_json`` (the table
    of distributed tensors, None when there are none) come pre-encoded (large, cached)."""
    head = json.dumps(
        {
            "format": FORMAT,
            "version": version or (VERSION if dtensors_json is None else DTENSOR_VERSION),
            "step": step,
            "created_at": created_at,
            "world_size": world_size,
            "shards": shards,
            "metrics": metrics,
            "metadata": metadata,
        },
        separators=(",", ":"),
        allow_nan=False,
        ensure_ascii=False,
    )
    # Splice the big members in as text: json.dumps of 20k tensor entries each save is the cost.
    text = head[:-1] + ',"tensors":' + tensors_json + ',"trees":' + trees_json
    if dtensors_json is not None:
        text += f',"block_bytes":{BLOCK_BYTES},"dtensors":' + dtensors_json
    return (text + "}").encode()


def tree_version(tree_json: str) -> int:
    """The format version a tree's JSON text needs: 2 when it holds a node of tree.V2_TAGS."""
    return DTENSOR_VERSION if any(f'{{"{t}":' in tree_json for t in V2_TAGS) else VERSION


def tensors_json_parts(specs: list[TensorSpec], data_start: int) -> list[str]:
    """One shard's manifest tensor entries, each up to its crc, which is left to fill in.

    Encoded once per layout: at 20k tensors json.dumps of the entries on every save cost
    more than the commit itself.
    """
    parts = []
    for s in specs:
        entry = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "byte_range": [data_start + s.start, data_start + s.end],
            "crc32c": 0,
        }
        text = json.dumps({s.name: entry}, separators=(",", ":"), ensure_ascii=False)
        parts.append(text[1 : -len("0}}")])  # '"name":{..."crc32c":'
    return parts


def tensors_json(
    specs: list[TensorSpec], data_start: int, crcs: list[int], parts: list[str] | None = None
) -> str:
    """One shard's manifest tensor entries (byte ranges made absolute), with their crcs."""
    if parts is None:
        parts = tensors_json_parts(specs, data_start)
    return "{" + ",".join([f"{p}{c}}}" for p, c in zip(parts, crcs, strict=True)]) + "}"


def fragment_ref(fragment_id: int) -> str:
    """What stands for a fragment in a tree on the pipe (see encode_tree)."""
    return f"\x00{fragment_id}"


_FRAGMENT_MARK = re.compile(r'"\\u0000(\d+)"')


def encode_tree(tree: Any, fragments: dict[int, str]) -> str:
    """The JSON text of a state tree as the trainer sends it, where a fragment_ref(id) string
    stands for the fragment ``id`` whose JSON text the daemon holds in ``fragments``.

    A fragment is a large mapping sent once and reused by later saves (see
    _trainer.state.Flattener); its text is spliced in, never encoded again. A reference is a
    string holding a NUL, which JSON escapes as ``\\u0000``; no stored string holds a NUL
    (flatten refuses them), so nothing else can match, and a tree without references is
    encoded by json.dumps alone.
    """
    text = json.dumps(tree, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if "\\u0000" in text:
        text = _FRAGMENT_MARK.sub(lambda m: fragments[int(m.group(1))], text)
    return text
