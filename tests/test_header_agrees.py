"""What a shard's bytes mean is checked: its safetensors header and the manifest must say the
same dtype, shape and place of every tensor, so a change of either that keeps every byte
(F32 to I32, a 2x3 shape to 3x2) is refused as corrupt, not loaded as other numbers."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import anyio
import pytest
import torch
from _support.roots import manifest_of, shard_path
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt.errors import CorruptCheckpointError

#: Same item size, other meaning.
SAME_SIZE = {"F32": ["I32", "U32"], "I64": ["F64", "U64"], "F16": ["BF16", "I16"]}
STATE = {
    "w": torch.arange(6.0).view(2, 3),
    "ids": torch.arange(4, dtype=torch.int64).view(4, 1),
    "h": torch.ones(2, 2, dtype=torch.float16),
}
#: Shapes of the same number of elements.
RESHAPED = {"w": [[3, 2], [6], [1, 6]], "ids": [[1, 4], [4], [2, 2]], "h": [[4], [1, 4]]}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pristine") / "run")

    async def main() -> None:
        async with AsyncCheckpointManager(root, dedup=False) as mgr:
            await (await mgr.save(1, STATE))

    anyio.run(main)
    return root


def load(root: str) -> dict:
    async def main() -> dict:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            return await mgr.load(1)

    return anyio.run(main)


def edit_header(path: str, change) -> bool:
    """Change the shard's header in place, keeping its length; False when it cannot."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        change(header)
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:
            return False
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
    return True


def edit_manifest(root: str, change) -> None:
    path = os.path.join(root, fmt.step_dirname(1), fmt.MANIFEST)
    m = manifest_of(root, 1)
    change(m["tensors"][m["shards"][0]["file"]])
    Path(path).write_text(json.dumps(m))


def test_the_pristine_checkpoint_loads(pristine):
    got = load(pristine)
    for k, v in STATE.items():
        assert torch.equal(got[k], v)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(STATE)),
    field=st.sampled_from(["dtype", "shape", "offsets"]),
    where=st.sampled_from(["header", "manifest"]),
    data=st.data(),
)
def test_a_header_or_record_changed_in_meaning_is_refused(
    pristine, tmp_path_factory, name, field, where, data
):
    root = str(tmp_path_factory.mktemp("mutated") / "run")
    shutil.copytree(pristine, root)
    dtype = manifest_of(root, 1)["tensors"][manifest_of(root, 1)["shards"][0]["file"]][name][
        "dtype"
    ]
    if field == "dtype":
        value = data.draw(st.sampled_from(SAME_SIZE[dtype]))
    elif field == "shape":
        value = data.draw(st.sampled_from(RESHAPED[name]))
    else:
        value = data.draw(st.integers(1, 16))  # bytes the range moves by
    if where == "header":

        def change(h: dict) -> None:
            entry = h[name]
            if field == "offsets":
                entry["data_offsets"] = [o + value for o in entry["data_offsets"]]
            else:
                entry[field] = value

        assume(edit_header(shard_path(root, 1), change))
    else:

        def change(records: dict) -> None:
            entry = records[name]
            if field == "offsets":
                entry["byte_range"] = [o + value for o in entry["byte_range"]]
            else:
                entry[field] = value

        edit_manifest(root, change)
    with pytest.raises(CorruptCheckpointError):
        load(root)
