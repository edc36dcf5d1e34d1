"""Saving the same state again reuses what the previous save learned about it.

A mapping of many tensors is flattened once and reused while its keys stay the same; each
tensor's dtype, shape, device and layout are checked against the cached layout as it is copied.
These tests change a state in every way that keeps its keys and check that the checkpoint
still holds exactly what the state held at the time of the call, or that the save is refused
as a fresh save would be.
"""

from __future__ import annotations

import json
import math
import os
import signal
import warnings

import anyio
import pytest
import safetensors.torch
import torch
from _support.roots import shard_name, shard_path
from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._trainer.staging import Slab
from aiockpt._trainer.state import FRAGMENT_MIN, Flattener, flatten
from aiockpt.errors import StateChangedError, UnsupportedValueError

pytestmark = pytest.mark.anyio

N = FRAGMENT_MIN * 3


def make_state(n: int = N, numel: int = 5) -> dict[str, torch.Tensor]:
    return {f"w{i:03d}": torch.arange(numel, dtype=torch.float32) + i for i in range(n)}


def assert_same(loaded: dict, state: dict) -> None:
    assert list(loaded) == list(state)
    for k, v in state.items():
        if isinstance(v, dict):
            assert_same(loaded[k], v)
        else:
            assert loaded[k].dtype == v.dtype, k
            assert loaded[k].shape == v.shape, k
            assert torch.equal(loaded[k], v), k


def manifest(root: str, step: int) -> dict:
    with open(os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)) as f:
        return json.load(f)


async def save_and_load(mgr: AsyncCheckpointManager, step: int, state: dict) -> dict:
    await (await mgr.save(step, state))
    return await mgr.load(step)


async def save_again_and_again(root: str, state: dict, saves: int) -> None:
    """Save ``state`` ``saves`` times, changing every value in place before each save, and
    check each checkpoint."""
    async with AsyncCheckpointManager(root) as mgr:
        for step in range(saves):
            for t in state.values():
                t.add_(1)
            assert_same(await save_and_load(mgr, step, state), state)


async def test_unchanged_state_saved_again_round_trips(root):
    await save_again_and_again(root, make_state(), 3)


async def test_shape_changed_in_place(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w007"].unsqueeze_(0)  # same object, same key, new shape
        state["w020"].resize_(2)
        assert_same(await save_and_load(mgr, 1, state), state)
    assert manifest(root, 1)["tensors"][shard_name(root, 1)]["w007"]["shape"] == [1, 5]


async def test_dtype_changed_through_data(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w003"].data = state["w003"].data.to(torch.float64)
        state["w004"].data = state["w004"].data.to(torch.int8)
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_same_sizes_shuffled_between_keys(root):
    """Total bytes and per-run sizes equal, shapes swapped: only a per-tensor check sees it."""
    state = make_state()
    state["w001"] = torch.zeros(2, 3)
    state["w002"] = torch.ones(3, 2)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w001"], state["w002"] = torch.ones(3, 2), torch.zeros(2, 3)
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_sizes_swapped_within_a_run_of_1d_tensors(root):
    """Back-to-back 1-D tensors are copied by one torch.cat: the same total in a different
    split must still be seen."""
    state = make_state()
    state["w001"], state["w002"] = torch.zeros(2), torch.ones(4)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w001"], state["w002"] = torch.ones(4), torch.zeros(2)
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_first_dimensions_swapped_within_a_run_of_matrices(root):
    """Matrices of one row shape back to back are one torch.cat along dim 0: the same number
    of rows split differently must still be seen."""
    state = {f"m{i:02d}": torch.full((2, 3), float(i)) for i in range(FRAGMENT_MIN)}
    state["m01"], state["m02"] = torch.zeros(1, 3), torch.ones(3, 3)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["m01"], state["m02"] = torch.ones(3, 3), torch.zeros(1, 3)
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_runs_with_empty_and_odd_shapes_round_trip(root):
    state = {f"m{i:02d}": torch.full((2, 3), float(i)) for i in range(FRAGMENT_MIN)}
    state["m03"] = torch.empty(0, 3)  # no rows: still part of the run
    state["m04"] = torch.empty(3, 0)  # rows of no bytes: never in a run
    state["m05"] = torch.arange(6.0).reshape(3, 2).t()  # (2, 3), not contiguous
    state["m06"] = torch.ones(2, 3, 1)  # another row shape
    await save_again_and_again(root, state, 2)


async def test_values_replaced_by_new_tensors(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state = {k: torch.full((3,), float(i)) for i, k in enumerate(state)}
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_non_contiguous_values_after_contiguous_ones(root):
    state = make_state(numel=6)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        for k in list(state)[::2]:
            state[k] = torch.arange(12, dtype=torch.float32)[::2] * 3
        assert_same(await save_and_load(mgr, 1, state), state)


def nested_tensor(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout is a prototype, and says so
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


@pytest.mark.parametrize(
    ("replacement", "message"),
    [
        (lambda: torch.empty(5, device="meta"), "tensors on meta are not supported"),
        (lambda: torch.ones(5).to_sparse(), "only dense tensors"),
        (lambda: nested_tensor(torch.strided), "nested tensors"),
        (lambda: nested_tensor(torch.jagged), "nested tensors"),
        (lambda: 3 + 4j, "values of type builtins.complex cannot be saved"),
    ],
)
async def test_unsavable_value_under_a_known_key_is_refused(root, replacement, message):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w011"] = replacement()
        with pytest.raises(UnsupportedValueError, match=message) as exc:
            await mgr.save(1, state)
        assert exc.value.path == "w011"
        assert await mgr.steps() == [0]
        assert not os.path.exists(os.path.join(root, fmt.step_dirname(1)))
        state["w011"] = torch.zeros(5)
        assert_same(await save_and_load(mgr, 1, state), state)  # and the manager goes on


async def test_dtype_without_safetensors_name_through_data_is_refused(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["w005"].data = torch.zeros(5, dtype=torch.complex128)
        with pytest.raises(UnsupportedValueError, match="complex128") as exc:
            await mgr.save(1, state)
        assert exc.value.path == "w005"


async def test_keys_added_removed_and_reordered(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["new"] = torch.ones(2)
        del state["w000"]
        assert_same(await save_and_load(mgr, 1, state), state)
        state = dict(reversed(list(state.items())))
        assert_same(await save_and_load(mgr, 2, state), state)


async def test_nested_mappings_and_plain_values_around_them(root):
    state = {"model": make_state(), "optim": {"lr": 0.1, "step": 0}, "head": make_state(n=3)}
    async with AsyncCheckpointManager(root) as mgr:
        for step in range(3):
            state["optim"]["step"] = step
            state["model"]["w001"].mul_(2)
            loaded = await save_and_load(mgr, step, state)
            assert loaded["optim"] == {"lr": 0.1, "step": step}
            assert_same(loaded["model"], state["model"])
            assert_same(loaded["head"], state["head"])


async def test_name_collision_with_a_cached_mapping_is_refused(root):
    state = {"a": make_state()}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        state["a/w001"] = torch.ones(1)  # flattens to the same name as state["a"]["w001"]
        with pytest.raises(UnsupportedValueError, match="two keys flatten to this tensor name"):
            await mgr.save(1, state)


async def test_state_changed_between_two_pending_saves(root):
    """The first save's mapping is replaced while it is still being written."""
    state = make_state(numel=1000)
    async with AsyncCheckpointManager(root, max_pending=2) as mgr:
        first = await mgr.save(0, state)
        changed = dict(state, extra=torch.ones(3))
        second = await mgr.save(1, changed)
        third = await mgr.save(2, state)
        await first, await second, await third
        assert_same(await mgr.load(0), state)
        assert_same(await mgr.load(1), changed)
        assert_same(await mgr.load(2), state)


async def test_daemon_restarted_between_saves_of_the_same_state(root):
    state = make_state()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(0, state))
        os.kill(mgr.daemon_pid, signal.SIGKILL)
        for _ in range(100):  # let the manager's reader see the pipe close
            if mgr.daemon_pid is None:
                break
            await anyio.sleep(0.01)
        assert_same(await save_and_load(mgr, 1, state), state)


async def test_state_changed_by_another_thread_during_the_copy(root, monkeypatch):
    """The flatten was exact, but the tensors changed before the copy got to them."""
    state = {"a": torch.ones(4), "b": torch.zeros(2)}  # too few tensors to be cached
    original = Slab.copy_in

    def meddling_copy_in(self, *args):  # what another thread could do meanwhile
        state["b"].resize_(3)
        return original(self, *args)

    async with AsyncCheckpointManager(root) as mgr:
        monkeypatch.setattr(Slab, "copy_in", meddling_copy_in)
        with pytest.raises(StateChangedError, match="changed while it was being copied"):
            await mgr.save(0, state)
        monkeypatch.setattr(Slab, "copy_in", original)
        assert await mgr.steps() == []
        assert_same(await save_and_load(mgr, 0, state), state)


async def test_daemon_forgets_layouts_and_fragments_no_save_needs(root):
    """A state whose keys change every save mints a layout and a fragment each time; the
    daemon is told to drop the old ones, and never one that a pending save still needs."""
    async with AsyncCheckpointManager(root, max_pending=2) as mgr:
        handles = []
        for step in range(30):
            state = {f"s{step}_{i}": torch.full((3,), float(step)) for i in range(FRAGMENT_MIN)}
            handles.append(await mgr.save(step, state))
        for h in handles:
            await h
        held = mgr._mirror  # what the daemon holds, as the manager has told it
        assert len(held.layouts_sent) <= 8 + 2  # the layout cache, and what saves in flight hold
        assert len(held.fragments_sent) <= 1 + 2
        loaded = await mgr.load(29)
        assert list(loaded) == [f"s29_{i}" for i in range(FRAGMENT_MIN)]
        assert torch.equal(loaded["s29_0"], torch.full((3,), 29.0))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int8, torch.bool]
CHANGES = st.lists(
    st.tuples(
        st.sampled_from(
            ["add", "unsqueeze", "resize", "dtype", "replace", "strided", "new_key", "del_key"]
        ),
        st.integers(0, 10**6),  # picks the key
        st.integers(0, 7),  # a size
        st.sampled_from(DTYPES),
    ),
    max_size=6,
)


def change(state: dict, what: str, pick: int, size: int, dtype: torch.dtype) -> None:
    """One change of the kind a training script can make between two saves."""
    keys = list(state)
    key = keys[pick % len(keys)]
    t = state[key]
    if what == "add":
        t.add_(1) if t.dtype is not torch.bool else t.logical_not_()
    elif what == "unsqueeze":
        t.unsqueeze_(0)
    elif what == "resize":
        t.resize_(size)
        t.zero_()  # resize_ leaves new elements uninitialized
    elif what == "dtype":
        t.data = torch.ones(t.shape).to(dtype)
    elif what == "replace":
        state[key] = torch.arange(size).to(dtype).reshape(1, size)
    elif what == "strided":
        state[key] = torch.arange(2 * size).reshape(size, 2).t().to(dtype)
    elif what == "new_key":
        state[f"k{pick}"] = torch.full((size,), 7).to(dtype)
    elif len(state) > 1:
        del state[key]


@settings(max_examples=25, deadline=None)
@given(rounds=st.lists(CHANGES, min_size=1, max_size=4))
def test_random_changes_between_saves_round_trip(tmp_path_factory, rounds):
    """Whatever changes under the same keys, each checkpoint holds the state at its save."""
    root = str(tmp_path_factory.mktemp("run"))

    async def run() -> None:
        state = {"m": make_state(n=FRAGMENT_MIN + 4, numel=3), "x": torch.ones(2)}
        async with AsyncCheckpointManager(root) as mgr:
            for step, changes in enumerate(rounds):
                for what, pick, size, dtype in changes:
                    change(state["m"], what, pick, size, dtype)
                expected = {"m": {k: v.clone() for k, v in state["m"].items()}, "x": state["x"]}
                assert_same(await save_and_load(mgr, step, state), expected)

    anyio.run(run)


# ---------------------------------------------------------------------------- units


def test_flattener_reuses_and_retires_mappings():
    memo = Flattener()
    state = {"model": make_state(), "other": make_state()}
    first = memo.flatten(state)
    again = memo.flatten(state)
    assert again.key == first.key
    assert again.tree == first.tree
    assert not again.trusted
    assert first.trusted
    assert set(again.fragments) == set(first.fragments)
    assert len(first.fragments) == 2
    del state["other"]
    third = memo.flatten(state)
    retired = set(first.fragments) - set(third.fragments)
    assert len(retired) == 1
    assert memo.take_retired() == sorted(retired)
    assert memo.take_retired() == []
    # A refused state leaves the cache as it was.
    state["bad"] = object()
    with pytest.raises(UnsupportedValueError):
        memo.flatten(state)
    del state["bad"]
    assert memo.flatten(state).key == third.key


def test_a_flatten_that_does_not_remember_leaves_the_cache_alone():
    memo = Flattener()
    state = {"model": make_state()}
    first = memo.flatten(state)
    memo.flatten({"other": make_state()}, remember=False)  # as load(into=...) does
    assert memo.take_retired() == []
    assert memo.flatten(state).key == first.key


def test_a_load_flatten_gives_the_next_save_its_mappings():
    # A resumed run loads into its state, then saves it: the save must find what the load
    # learned (the same key, hence the layout the load computed), and the load retires
    # nothing the training loop's saves still use.
    memo = Flattener()
    kept = {"model": make_state()}
    first = memo.flatten(kept)
    state = {"opt": make_state()}
    loaded = memo.flatten(state, remember=False)
    assert memo.take_retired() == []
    both = memo.flatten({**kept, **state})
    assert both.key == first.key + loaded.key
    assert not both.trusted  # both mappings taken from the cache


async def test_a_save_after_load_into_reuses_the_loads_layout(root, monkeypatch):
    import aiockpt._trainer.staging.layouts as staging

    state = {"model": make_state()}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
    made = []
    real = staging.make_layout
    monkeypatch.setattr(staging, "make_layout", lambda flat: made.append(1) or real(flat))
    async with AsyncCheckpointManager(root) as mgr:  # a resumed run
        await mgr.load(1, into=state)
        for t in state["model"].values():
            t.add_(1)
        await (await mgr.save(2, state))
        assert_same(await mgr.load(2), state)
    assert len(made) == 1  # the load's: a 20k-tensor layout took 0.2-0.4 s to make
    # The slab was new to the load, which made its views: the save wrote the header.
    shard = shard_path(root, 2)
    on_disk = safetensors.torch.load_file(shard)
    assert_same({"model": {k.split("/", 1)[1]: v for k, v in on_disk.items()}}, state)


def test_small_mappings_are_not_cached():
    memo = Flattener()
    flat = memo.flatten({"a": make_state(n=FRAGMENT_MIN - 1)})
    assert flat.fragments == {}


def test_wire_tree_expands_to_the_plain_tree():
    state = {"m": make_state(), "x": [1.5, {"y": "z"}], "n": {"k": make_state()}}
    plain = flatten(state)
    assert plain.fragments == {}
    wire = Flattener().flatten(state)
    texts = {i: fmt.encode_tree(node, {}) for i, node in wire.fragments.items()}
    assert json.loads(fmt.encode_tree(wire.tree, texts)) == plain.tree
    assert fmt.encode_tree(plain.tree, {}) == json.dumps(
        plain.tree, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


_CUT_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.int64]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(range(len(_CUT_DTYPES))),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_typed_views_are_the_views_a_slice_would_make(items) -> None:
    """Runs of one dtype cut by one split, with whole-element gaps between their tensors
    (padding) and without: each view has the dtype, shape and memory a slice of the bytes
    and two views would give it."""
    from aiockpt._trainer.staging import typed_views

    cuts, pos = [], 0
    for d, shape, gap in items:
        dtype = _CUT_DTYPES[d]
        size = dtype.itemsize
        pos = -(-pos // size) * size + gap * size  # aligned, then a gap of whole elements
        nbytes = math.prod(shape) * size
        cuts.append((dtype, tuple(shape), pos, nbytes))
        pos += nbytes
    u8 = torch.randint(0, 2, (pos + 8,), dtype=torch.uint8)  # 0/1: valid bools too
    got = typed_views(u8, cuts)
    assert len(got) == len(cuts)
    for view, (dtype, shape, start, nbytes) in zip(got, cuts, strict=True):
        want = u8[start : start + nbytes].view(dtype).view(shape)
        assert (view.dtype, view.shape) == (dtype, torch.Size(shape))
        assert view.is_contiguous()
        if nbytes:
            assert view.data_ptr() == want.data_ptr()
            assert torch.equal(view, want)
