"""A load(into=)'s restore plans a large dict of plain tensors in a few passes over it
(_Restorer.tensor_dict) instead of a walk per key; whatever the dict holds, the plan and any
error are the walk's."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt._trainer.load import restore
from aiockpt._trainer.load.restore import Target, plan_restore
from aiockpt.errors import LoadMismatchError

#: What a test may do to one key of the target before it is restored into.
CHANGES = ("none", "shape", "dtype", "missing", "extra", "int value", "parameter", "saved value")


def saved_and_target(n: int, changes: dict[int, str], int_keys: bool) -> tuple[Any, dict, dict]:
    """A saved dict of ``n`` tensors as (its tree, its tensors by name) and a target dict of
    the same keys, each changed as ``changes`` says (by key index)."""
    keys: list[Any] = list(range(n)) if int_keys else [f"w{i}" for i in range(n)]
    body: list[Any] = []
    tensors: dict[str, torch.Tensor] = {}
    target: dict[Any, Any] = {}
    for i, k in enumerate(keys):
        name = f"p/{k}"
        change = changes.get(i, "none")
        if change == "saved value":
            body.append([k, {"V": i}])
        else:
            body.append([k, {"T": name}])
            tensors[name] = torch.full((2, i % 3 + 1), float(i))
        shape = (2, i % 3 + 1) if change != "shape" else (3, i % 3 + 1)
        dtype = torch.float64 if change == "dtype" else torch.float32
        value: Any = torch.zeros(shape, dtype=dtype)
        if change == "int value":
            value = i
        elif change == "parameter":
            value = torch.nn.Parameter(value, requires_grad=False)
        if change != "missing":
            target[k] = value
        if change == "extra":
            target[f"extra{i}"] = torch.zeros(1)
    return {"D": body}, tensors, target


def plan(target: dict, tree: Any, tensors: dict, strict: bool) -> Any:
    """The plan's observable outcome: the error, or what it copies, sets and left out."""
    try:
        into = Target({"p": target}, {}, strict, None)
        r = plan_restore(into, {"D": [["p", tree]]}, tensors, tensors)
    except LoadMismatchError as e:
        return ("error", str(e))
    return (
        [id(t) for t in r.dsts],
        [id(t) for t in r.srcs],
        [(id(c), k, type(v)) for c, k, v in r.sets],
        r.only_saved,
        r.only_target,
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(restore.BATCH_MIN, restore.BATCH_MIN + 8),
    changes=st.dictionaries(st.integers(0, restore.BATCH_MIN - 1), st.sampled_from(CHANGES)),
    int_keys=st.booleans(),
    strict=st.booleans(),
)
def test_a_large_dict_is_planned_as_the_walk_plans_it(n, changes, int_keys, strict):
    tree, tensors, target = saved_and_target(n, changes, int_keys)
    whole = plan(target, tree, tensors, strict)
    walked = restore.BATCH_MIN
    try:
        restore.BATCH_MIN = 10**9  # every dict walked key by key
        assert whole == plan(target, tree, tensors, strict)
    finally:
        restore.BATCH_MIN = walked


def test_a_dict_of_matching_tensors_is_planned_as_a_whole(monkeypatch):
    """The fast path is taken (a walk that would be refused is not reached) and copies
    every tensor into its target, in the saved order."""
    tree, tensors, target = saved_and_target(restore.BATCH_MIN, {3: "parameter"}, False)

    def no_walk(*args: Any) -> Any:
        raise AssertionError("walked key by key")

    monkeypatch.setattr(restore._Restorer, "tensor", no_walk)
    r = plan_restore(Target(target, {}, True, None), tree, tensors, tensors)
    assert [id(t) for t in r.dsts] == [id(t) for t in target.values()]
    assert [id(t) for t in r.srcs] == [id(t) for t in tensors.values()]
    r.finish(torch._foreach_copy_)
    for t, src in zip(target.values(), tensors.values(), strict=True):
        assert torch.equal(t, src)


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_mismatch_in_a_large_dict_names_its_key(change):
    tree, tensors, target = saved_and_target(40, {7: change}, False)
    with pytest.raises(LoadMismatchError, match="^w7: saved torch.float32"):
        plan_restore(Target(target, {}, True, None), tree, tensors, tensors)


def test_planning_adds_no_key_to_a_defaultdict():
    """A defaultdict target missing a saved key is walked, not indexed: planning changes
    nothing."""
    tree, tensors, plain = saved_and_target(40, {5: "missing"}, False)
    target = collections.defaultdict(lambda: torch.zeros(1), plain)
    r = plan_restore(Target(target, {}, False, None), tree, tensors, tensors)
    assert sorted(target) == sorted(plain)
    assert r.only_saved == ["w5"]
