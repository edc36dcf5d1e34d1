"""Trainer state beyond tensors: torch generators, numpy arrays and scalars, RNG states."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _support.roots import manifest_of

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LoadMismatchError, UnsupportedValueError

pytestmark = pytest.mark.anyio

NUMERIC = [
    np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
    np.uint64, np.uint32, np.uint16, np.uint8, np.bool_, np.complex64,
]  # fmt: skip


def version(root: str, step: int) -> int:
    return json.loads((Path(root) / f"step_{step:012d}" / "manifest.json").read_text())["version"]


async def test_numpy_arrays_scalars_and_rng_states_round_trip(root):
    arrays = {np.dtype(d).name: (np.arange(6) % 2).astype(d).reshape(2, 3) for d in NUMERIC}
    state = {
        "arrays": arrays,
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64("nan")],
        "np_random": np.random.RandomState(7).get_state(),
        "bitgen": np.random.default_rng(7).bit_generator.state,
        "python": random.Random(7).getstate(),
        "view": np.arange(10.0)[::2],  # not contiguous
    }
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        out = await mgr.load(1)
    assert version(root, 1) == 4  # numpy values need version 2's nodes; every save writes 4
    for name, a in arrays.items():
        got = out["arrays"][name]
        assert isinstance(got, np.ndarray)
        assert got.dtype == a.dtype
        assert np.array_equal(got, a)
    f32, i64, b, nan = out["scalars"]
    assert type(f32) is np.float32
    assert f32 == 1.5
    assert type(i64) is np.int64
    assert i64 == -3
    assert type(b) is np.bool_
    assert b
    assert np.isnan(nan)
    rs = np.random.RandomState()
    rs.set_state(out["np_random"])
    assert rs.random() == np.random.RandomState(7).random()
    gen = np.random.default_rng()
    gen.bit_generator.state = out["bitgen"]
    assert gen.random() == np.random.default_rng(7).random()
    r = random.Random()
    r.setstate(out["python"])
    assert r.random() == random.Random(7).random()
    assert np.array_equal(out["view"], np.arange(10.0)[::2])


async def test_torch_generators_round_trip_and_restore_in_place(root):
    gen = torch.Generator().manual_seed(3)
    torch.rand(5, generator=gen)
    expect = torch.rand(4, generator=torch.Generator().set_state(gen.get_state()))
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"gen": gen, "step": 1}))
        out = await mgr.load(1)
        target_gen = torch.Generator().manual_seed(99)
        target = {"gen": target_gen, "step": 0}
        await mgr.load(1, into=target)
    assert isinstance(out["gen"], torch.Generator)
    assert torch.equal(torch.rand(4, generator=out["gen"]), expect)
    assert target["gen"] is target_gen
    assert torch.equal(torch.rand(4, generator=target_gen), expect)


async def test_a_generator_stored_after_other_tensors_restores(root):
    # Its state then lies at an offset in the loaded buffer, which Generator.set_state ignores
    # (it reads the storage from its start): it must get a tensor of its own.
    gen = torch.Generator().manual_seed(7)
    expect = torch.rand(3, generator=torch.Generator().manual_seed(7))
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"a": torch.arange(10.0), "rng": gen}))
        out = await mgr.load(1)
        target = {"a": torch.zeros(10), "rng": torch.Generator().manual_seed(1)}
        await mgr.load(1, into=target)
    assert torch.equal(torch.rand(3, generator=out["rng"]), expect)
    assert torch.equal(torch.rand(3, generator=target["rng"]), expect)


async def test_a_loaded_rng_state_tensor_can_be_set_directly(root):
    # torch.set_rng_state reads its tensor's storage from the start: a loaded RNG state must
    # not be a view at an offset of the buffer the daemon read (it was: Invalid mt19937 state).
    torch.manual_seed(11)
    saved = torch.get_rng_state()
    expect = torch.rand(3)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"a": torch.arange(10.0), "rng": saved}))
        out = await mgr.load(1)
    torch.set_rng_state(out["rng"])
    assert torch.equal(torch.rand(3), expect)


async def test_numpy_arrays_restore_in_place_and_refuse_misfits(root):
    saved = {"a": np.arange(4.0), "b": np.ones(3, dtype=np.int32)}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, saved))
        a = np.zeros(4)
        target = {"a": a, "b": np.zeros(3, dtype=np.int32)}
        await mgr.load(1, into=target)
        assert target["a"] is a
        assert np.array_equal(a, saved["a"])
        bad = {"a": np.zeros(4), "b": np.zeros(3, dtype=np.int64)}
        with pytest.raises(LoadMismatchError, match="b: saved numpy int32"):
            await mgr.load(1, into=bad)
        assert not bad["a"].any()  # checked before anything changed


def test_unsavable_numpy_values_are_refused_with_their_key():
    from aiockpt._trainer.state import flatten

    with pytest.raises(UnsupportedValueError) as info:
        flatten({"o": np.array([object()]), "c": np.complex128(1j), "s": np.array(["x"])})
    assert [p for p, _ in info.value.problems] == ["o", "c", "s"]


async def test_a_checkpoint_of_plain_tensors_holds_no_version_2_node(root):
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.ones(2), "rng": torch.get_rng_state()}))
    assert version(root, 1) == 4
    tree = json.dumps(manifest_of(root, 1)["trees"])
    assert not any(f'"{tag}":' in tree for tag in ("X", "G", "N", "n"))


class Drawing:
    """torchsnapshot's ``test_rng_state`` object: its state_dict() draws random numbers from
    the global torch RNG, as a sampler or an augmentation may (and so does its load)."""

    def state_dict(self) -> dict:
        return {"foo": torch.rand(1).item()}

    def load_state_dict(self, sd: dict) -> None:
        torch.rand(1)


@pytest.mark.parametrize("order", ["rng_first", "rng_last"])
async def test_rng_state(root, order):
    """Ported from torchsnapshot: the global RNG is captured after every other state_dict()
    and restored after every other load_state_dict(), so the resumed run draws what the
    uninterrupted one does, wherever the generator lies in the state."""
    torch.manual_seed(0)
    items = [("rng_state", torch.default_generator), ("foo", Drawing())]
    state = dict(items if order == "rng_first" else items[::-1])
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        after_take = torch.rand(8)
        await mgr.load(into=state)
        after_restore = torch.rand(8)
    assert torch.equal(after_take, after_restore)


async def test_a_generator_nested_before_the_object_that_draws_from_it(root):
    gen = torch.Generator().manual_seed(3)

    class Sampler:
        def state_dict(self) -> dict:
            return {"epoch_seed": int(torch.randint(0, 2**31, (1,), generator=gen))}

        def load_state_dict(self, sd: dict) -> None:
            torch.randint(0, 2**31, (1,), generator=gen)

    state = {"rngs": {"data": gen}, "trainer": {"sampler": Sampler()}}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        uninterrupted = torch.rand(8, generator=gen)
    async with AsyncCheckpointManager(root) as mgr:
        await mgr.load(into=state)
        resumed = torch.rand(8, generator=gen)
    assert torch.equal(uninterrupted, resumed)
