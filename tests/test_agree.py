"""The per-save agreement of the ranks (``_trainer/dist.py``: agree), on a gloo group of one in
this process; what it decides on several ranks is tested with real ones in test_dist.py and
test_dtensor.py."""

from __future__ import annotations

import uuid as uuid_mod

import pytest
import torch.distributed as dist

from aiockpt._trainer import dist as _dist
from aiockpt.errors import InvalidStepError


@pytest.fixture
def group(tmp_path, monkeypatch):
    """A gloo group of one, with every collective agree may run counted by name."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    calls: list[str] = []
    for name in ("all_gather", "all_gather_object"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    try:
        yield _dist.resolve_group(None), calls
    finally:
        dist.destroy_process_group()


def test_a_save_agreed_on_is_one_all_gather_of_bytes(group):
    g, calls = group
    mine = uuid_mod.uuid4().hex
    assert _dist.agree(g, 10**12 - 1, mine, None) == mine
    assert calls == ["all_gather"]


def test_a_refusal_is_told_in_later_gathers_and_raised_as_itself(group):
    g, calls = group
    error = InvalidStepError("step must be >= 0, not -3")
    with pytest.raises(InvalidStepError, match="not -3") as exc:
        _dist.agree(g, -3, uuid_mod.uuid4().hex, error)
    assert exc.value is error
    # what the ranks say next: their sizes, then their pickles, each gather bounded
    assert calls == ["all_gather", "all_gather", "all_gather"]


def test_what_a_rank_says_packs_into_41_bytes():
    said = _dist._SAY.pack(7, False, bytes(16), _dist._signature([]))
    assert len(said) == _dist._SAY.size == 41
    assert _dist._SAY.unpack(said)[:2] == (7, False)
