"""save() refuses, naming the key path, every value the manifest reader would refuse, before
anything is staged; what it accepts, the reader accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from _support.roots import step_numbers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt._core import format as fmt
from aiockpt._core import values
from aiockpt._core.tree import check_tree
from aiockpt._trainer.checks import clean_metadata, clean_metrics
from aiockpt._trainer.state import flatten
from aiockpt.errors import CheckpointError, StateDictError, UnsupportedValueError

BAD = "bad\udcff"  # what os.fsdecode makes of the name b"bad\xff"
HUGE = 10**400  # an int no float holds: a metric of it reads as "not a number"
HUGER = 10**5000  # an int past what JSON text holds here (4300 digits)


def save_refused(root: str, **save: Any) -> UnsupportedValueError | StateDictError:
    """Save step 1, then step 2 with ``save``'s arguments, which must be refused; the error,
    once it is checked that step 2 left nothing behind and step 1 is kept (LatestN(1) would
    have deleted it, had step 2 committed)."""
    caught: list[Exception] = []

    async def main() -> None:
        async with AsyncCheckpointManager(root, retention=LatestN(1)) as mgr:
            await (await mgr.save(1, {"w": torch.ones(3)}, metrics={"loss": 1.0}))
            try:
                handle = await mgr.save(2, save.pop("state", {"w": torch.ones(3)}), **save)
                await handle
            except CheckpointError as e:
                caught.append(e)
            assert await mgr.steps() == [1]
            assert torch.equal((await mgr.load())["w"], torch.ones(3))

    anyio.run(main)
    assert step_numbers(root) == [1]
    assert len(caught) == 1, "the save was not refused"
    assert isinstance(caught[0], (UnsupportedValueError, StateDictError)), repr(caught[0])
    return caught[0]


@pytest.mark.parametrize(
    ("save", "path"),
    [
        ({"state": {"w": torch.ones(3), "name": BAD}}, "name"),
        ({"state": {"w": torch.ones(3), "files": {BAD: 1}}}, "files/"),
        (
            {"state": {"w": torch.ones(3), "m": {f"{BAD}{i}": torch.ones(1) for i in range(20)}}},
            "m/",
        ),
        ({"metadata": {"run": {"dir": BAD}}}, "metadata/run/dir"),
        ({"metadata": {BAD: 1}}, "metadata/"),
        ({"metrics": {BAD: 1.0}}, "metrics/"),
    ],
    ids=["value", "key", "tensor-key", "metadata-value", "metadata-key", "metric-name"],
)
def test_a_lone_surrogate_is_refused_naming_its_key(root, save, path):
    e = save_refused(root, **save)
    assert isinstance(e, UnsupportedValueError)
    assert e.path.startswith(path), e.path
    assert "surrogate" in str(e)
    assert "UTF-8" in str(e)


@pytest.mark.parametrize(
    ("save", "path"),
    [
        ({"metrics": {"loss": HUGE}}, "metrics/loss"),
        ({"metrics": {"loss": torch.tensor(2**70, dtype=torch.float64) * 1e300}}, None),
        ({"state": {"w": torch.ones(3), "opt": {"count": HUGER}}}, "opt/count"),
        ({"state": {"w": torch.ones(3), "xs": [1, -HUGER]}}, "xs/1"),
        ({"metadata": {"seed": [HUGER]}}, "metadata/seed/0"),
        ({"metadata": {"deep": json.loads("[" * 70 + "]" * 70)}}, "metadata/deep"),
        ({"metrics": {"loss": 10**5000}}, "metrics/loss"),
        ({"state": {"w": torch.ones(3), "d": {10**5000: 1}}}, "d/<an int of 16610 bits>"),
        ({"state": {"w": torch.ones(3), "v": -(10**5000)}}, "v"),
        ({"metadata": {"big": 10**5000}}, "metadata/big"),
    ],
    ids=[
        "metric",
        "inf-tensor-metric",
        "value",
        "list-item",
        "metadata",
        "metadata-depth",
        "metric-past-str",
        "key-past-str",
        "value-past-str",
        "metadata-past-str",
    ],
)
def test_what_the_reader_refuses_is_refused_by_save(root, save, path):
    if path is None:  # a non-finite float metric is stored as such: not refused

        async def main() -> None:
            async with AsyncCheckpointManager(root) as mgr:
                await (await mgr.save(1, {"w": torch.ones(3)}, **save))
                info = await mgr.load()
                assert torch.equal(info["w"], torch.ones(3))

        anyio.run(main)
        return
    e = save_refused(root, **save)
    assert isinstance(e, UnsupportedValueError)
    assert e.path.startswith(path), (e.path, str(e))


class Failing(torch.nn.Module):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise KeyError("no such buffer")


def test_a_failing_state_dict_is_named_by_its_key_path(root):
    e = save_refused(root, state={"w": torch.ones(3), "model": {"inner": Failing()}})
    assert isinstance(e, StateDictError)
    assert isinstance(e, RuntimeError)
    assert "model/inner" in str(e)
    assert "Failing" in str(e)
    assert isinstance(e.__cause__, KeyError)
    assert e.path == "model/inner"


SHARDED_CHILD = """
    import torch, torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from aiockpt._trainer.state import flatten
    from aiockpt.errors import UnsupportedValueError

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
    st = sharded_tensor.zeros(spec, 4, 4)
    for model in ({"w": st}, {f"w{i}": st if i == 7 else torch.ones(1) for i in range(20)}):
        try:
            flatten({"model": model})
        except UnsupportedValueError as e:
            text = str(e)
            assert e.path.startswith("model/w"), text
            assert "ShardedTensor" in text and "get_state_dict" in text and "DTensor" in text
            print(text)
        else:
            raise AssertionError("a ShardedTensor was flattened")
    dist.destroy_process_group()
    print("refused")
"""


def test_a_sharded_tensor_is_refused_by_name():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHARDED_CHILD)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused" in proc.stdout


# --------------------------------------------------------------------------- one definition

_text = st.text(max_size=6) | st.sampled_from([BAD, "\ud800x", "ok"])


def _past_json(sign: int) -> int:
    """The smallest magnitude past what JSON text holds here, with ``sign``."""
    return sign * 10**values.MAX_INT_DIGITS


_ints = (
    st.integers()
    | st.sampled_from([HUGE, -HUGE, 2**1023, 2**1024, -(2**1024), 10**308, 10**309])
    | st.sampled_from([1, -1]).map(_past_json)
)
_floats = st.floats(allow_nan=True, allow_infinity=True)
_scalars = st.none() | st.booleans() | _ints | _floats | _text


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


_json = st.recursive(
    _scalars | st.integers(60, 70).map(_nested),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=12,
)


def reader_accepts(tree: Any, metrics: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Parse a manifest holding what a save of these would write, as a load does."""
    tree_json = fmt.encode_tree(tree, {})
    shard = fmt.shard_filename(0)
    data = fmt.manifest_json(
        step=1,
        created_at=1.0,
        world_size=1,
        shards=[{"file": shard, "rank": 0, "nbytes": 8, "crc32c": 0}],
        tensors_json=json.dumps({shard: {}}),
        trees_json=json.dumps({"0": json.loads(tree_json)}, ensure_ascii=False),
        metrics=metrics,
        metadata=metadata,
    )
    manifest = fmt.parse_manifest(data, path="manifest.json", step=1)
    fmt.parse_manifest_record(data, path="manifest.json", step=1)
    check_tree(manifest.trees[0], set(), path="manifest.json")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=_json,
    metrics=st.dictionaries(_text, _ints | _floats | _text, max_size=3),
    metadata=st.dictionaries(_text, _json, max_size=3),
)
def test_what_save_accepts_the_reader_accepts(value, metrics, metadata):
    try:
        tree = flatten({"v": value}).tree
        clean = clean_metrics(metrics), clean_metadata(metadata)
    except UnsupportedValueError:
        return  # refused before anything is staged
    reader_accepts(tree, *clean)


def test_the_reader_keeps_to_the_same_limits():
    """format.py's own limits, until it reads them from values."""
    assert fmt.MAX_METADATA_DEPTH == values.MAX_METADATA_DEPTH
    assert fmt.MAX_TREE_DEPTH == values.MAX_TREE_DEPTH


def test_the_tree_reader_refuses_what_save_refuses():
    for body in (HUGER, float("nan"), BAD):
        with pytest.raises(CheckpointError, match="malformed tree"):
            check_tree({"D": [["k", {"V": body}]]}, set(), path="m")
    with pytest.raises(CheckpointError, match="malformed tree"):
        check_tree({"D": [[BAD, {"V": 1}]]}, set(), path="m")
    with pytest.raises(CheckpointError, match="malformed tree"):
        check_tree({"n": ["uint64", HUGE]}, set(), path="m")
    check_tree(
        {"D": [["k", {"V": 2**1000}], [-(2**70), {"n": ["uint64", 2**64 - 1]}]]}, set(), path="m"
    )


def test_values_rules():
    assert values.int_problem(2**1024) is None  # a tree value or metadata: JSON holds it
    assert values.int_problem(10**4300 - 1) is None
    assert values.int_problem(-(10**4300)) is not None
    assert values.metric_problem(2**1023) is None
    assert values.metric_problem(2**1024) is not None  # a metric: compared as a float
    assert values.text_problem("héllo") is None
    assert "surrogate" in (values.text_problem(BAD) or "")
    assert values.json_problem({"a": [1, 2.5, None, True, "x"]}) is None
    assert values.json_problem({"a": {"b": float("inf")}})[0] == "a/b"
    assert values.json_problem(_nested(values.MAX_METADATA_DEPTH)) is None
    assert values.json_problem(_nested(values.MAX_METADATA_DEPTH + 1)) is not None
    assert values.metric_problem("nan") is None
    assert values.metric_problem(float("nan")) is not None
    assert os.fsdecode(b"bad\xff") == BAD


def test_an_int_json_holds_round_trips_as_a_value_and_in_metadata(root):
    """10**400 is no metric (a float cannot hold it) but a value and metadata keep it exactly,
    as every earlier aiockpt wrote and read it."""

    async def main() -> dict:
        async with AsyncCheckpointManager(root) as mgr:
            state = {"w": torch.ones(3), "count": HUGE, "xs": [1, -HUGE]}
            await (await mgr.save(1, state, metadata={"seed": [HUGE]}))
            return await mgr.load(1)

    out = anyio.run(main)
    assert out["count"] == HUGE
    assert out["xs"] == [1, -HUGE]
    manifest = json.loads((Path(root) / fmt.step_dirname(1) / fmt.MANIFEST).read_text())
    assert manifest["metadata"] == {"seed": [HUGE]}
