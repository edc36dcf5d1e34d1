"""The one table of safetensors dtypes, and the torch mapping built from it."""

from __future__ import annotations

import pytest
import torch

from aiockpt._core import dtypes as core
from aiockpt._core import format as fmt
from aiockpt._trainer import dtypes, state


def test_every_format_dtype_is_one_torch_dtype_of_its_size():
    assert set(dtypes.ST_TO_TORCH) == set(core.DTYPE_SIZES)
    for name, size in core.DTYPE_SIZES.items():
        dtype = dtypes.ST_TO_TORCH[name]
        assert isinstance(dtype, torch.dtype)
        assert dtype.itemsize == size, name
        assert torch.empty(3, dtype=dtype).untyped_storage().nbytes() == 3 * size, name


def test_each_torch_dtype_maps_back_to_its_name():
    assert len(set(dtypes.ST_TO_TORCH.values())) == len(dtypes.ST_TO_TORCH)  # one to one
    assert {d: name for name, d in dtypes.ST_TO_TORCH.items()} == dtypes.TORCH_TO_ST
    for dtype, name in dtypes.TORCH_TO_ST.items():
        assert dtypes.ST_TO_TORCH[name] is dtype
        assert core.DTYPE_SIZES[name] == dtype.itemsize


def test_the_names_are_safetensors_own():
    st = pytest.importorskip("safetensors.torch")
    for name, dtype in dtypes.ST_TO_TORCH.items():
        assert st._TYPES[name] is dtype, name


def test_the_tables_are_reachable_where_they_were():
    assert fmt.DTYPE_SIZES is core.DTYPE_SIZES
    assert state.TORCH_TO_ST is dtypes.TORCH_TO_ST
    assert state.ST_TO_TORCH is dtypes.ST_TO_TORCH
