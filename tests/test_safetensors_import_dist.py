"""load_safetensors on 2 and 4 real gloo ranks: FSDP2 (uneven rows) and tensor parallel
targets filled in place, each rank reading only the bytes of its own pieces."""

from __future__ import annotations

import math

import pytest
import torch
from _support.ranks import run_ranks
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 5)
    )
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "w.safetensors")
    )
    return tmp, tmp / "w.safetensors"


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_and_tp_targets_get_the_file_and_read_their_share(weights, tmp_path, world):
    _, path = weights
    logs = tmp_path / "logs"
    logs.mkdir()
    args = {"source": f"counted://{path}", "log": str(logs)}
    ranks = run_ranks(
        "_hfimport_worker.py", "load_all", world, tmp_path, str(tmp_path / "root"), args=args
    )
    want = {k: v.tolist() for k, v in load_file(str(path)).items()}
    data = sum(v.nbytes for v in load_file(str(path)).values())
    for rank, got in enumerate(ranks):
        for layout in ("fsdp", "tp"):
            assert got[layout]["full"] == want, (rank, layout)
        assert got["plain"] == want, rank
        # FSDP2's pieces are dim-0 boxes: one range each, exactly the bytes the rank holds.
        fsdp = got["fsdp"]
        assert fsdp["read"]["data"] == fsdp["needed"], rank
        assert fsdp["needed"] <= math.ceil(data / world * 1.05), rank  # uneven rows
        assert fsdp["read"]["head"] <= 64 * 1024, rank  # the header, peeked at once
        # Tensor parallel: the column-wise layer's pieces are dim-0 boxes too; the row-wise
        # layer's weight piece is strided (5 rows of 4096 / world columns), read as the one
        # range that spans its runs.
        tp = got["tp"]
        assert tp["needed"] <= tp["read"]["data"] <= tp["needed"] + 5 * 4096 * 4, rank
