"""A shard's crc32c folded from its tensors' equals the crc32c of its bytes."""

from __future__ import annotations

import os

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt._core import format as fmt
from aiockpt._core.crc import combine
from aiockpt._core.protocol import LayoutMsg
from aiockpt._daemon.writer import FOLD_MIN_AVERAGE, Layout, checksums, shard_checksum


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.binary(max_size=5000))
def test_combining_two_crcs_is_the_crc_of_both(a, b):
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combining_across_large_lengths():
    a, b = os.urandom(1000), bytes(3 << 20)  # a length whose shift takes many squarings
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    with pytest.raises(ValueError, match="negative"):
        combine(1, 2, -1)


def layout_of(sizes: list[int], pad_before: int | None = None, header: int = 4096) -> Layout:
    """A layout of tensors of these byte sizes back to back, with a padding entry of 8 bytes
    before tensor ``pad_before`` if given (as before a DTensor chunk)."""
    specs, pos = [], 0
    for i, n in enumerate(sizes):
        if i == pad_before:
            specs.append((fmt.PAD_NAME, "U8", (8,), pos, pos + 8))
            pos += 8
        specs.append((f"t{i}", "U8", (n,), pos, pos + n))
        pos += n
    return Layout(LayoutMsg(1, header, header + pos, tuple(specs)))


@pytest.mark.parametrize(
    ("sizes", "pad_before"),
    [
        ([1 << 20, 3 << 18, 100_000], None),  # folded
        ([1 << 20, 1 << 20, 70_000], 2),  # folded, with the padding read
        ([10] * 500, None),  # tiny tensors: read again instead
        ([1 << 20, 0, 1 << 19], None),  # an empty tensor folds as nothing
    ],
)
def test_the_shard_crc_is_the_crc_of_the_shard(sizes, pad_before):
    layout = layout_of(sizes, pad_before)
    data = memoryview(os.urandom(layout.msg.file_size))
    tensor_crcs = [
        crc32c.crc32c(data[layout.msg.data_start + s.start : layout.msg.data_start + s.end])
        for s in layout.specs
    ]
    assert shard_checksum(data, layout, tensor_crcs) == crc32c.crc32c(data)
    assert checksums(data, layout)[1] == crc32c.crc32c(data)
    folded = len(layout.msg.specs) * FOLD_MIN_AVERAGE <= len(data)
    assert folded == (sizes[0] >= 1 << 20)
