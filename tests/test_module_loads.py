"""Loading into modules as their own load_state_dict would: a buffer the module resizes as it
loads, and ``strict=False`` all the way down (modules included), ``strict=True`` unchanged.
Also torchsnapshot's strict=False and RNG-state scenarios, in aiockpt's terms."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LoadMismatchError

pytestmark = pytest.mark.anyio


class Seen(torch.nn.Module):
    """A module whose buffer grows with what it has seen (as metrics and caches do), and that
    resizes it to the saved size as it loads: its own load_state_dict takes any length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("ids", torch.zeros(0, dtype=torch.int64))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + "ids")
        if saved is not None:
            self.ids = torch.empty_like(saved)
        super()._load_from_state_dict(state_dict, prefix, *args)


def mlp(layers: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


async def test_a_buffer_the_module_resizes_as_it_loads_is_loaded(root: str) -> None:
    saved = Seen()
    saved.ids = torch.arange(12)
    target = Seen()
    assert target.ids.shape == (0,)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"model": saved}))
        await mgr.load(1, into={"model": target})
        # Nested too, as a model holding it is loaded.
        outer_saved, outer = torch.nn.Sequential(saved), torch.nn.Sequential(Seen())
        await (await mgr.save(2, {"model": outer_saved}))
        await mgr.load(2, into={"model": outer})
    assert torch.equal(target.ids, torch.arange(12))
    assert torch.equal(target.lin.weight, saved.lin.weight)
    assert torch.equal(outer[0].ids, torch.arange(12))


async def test_a_module_that_does_not_resize_still_refuses_another_shape(root: str) -> None:
    saved, target = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5)
    before = target.weight.detach().clone()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"model": saved}))
        for strict in (True, False):
            with pytest.raises(LoadMismatchError, match=r"weight: saved torch.float32\[3, 4\]"):
                await mgr.load(1, into={"model": target}, strict=strict)
    assert torch.equal(target.weight, before)


async def test_strict_false_loads_a_3_layer_checkpoint_into_a_4_layer_model(root: str) -> None:
    three, four = mlp(3, seed=1), mlp(4, seed=2)
    fourth = four[3].weight.detach().clone()
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"model": three}))
        with pytest.raises(LoadMismatchError, match="3.weight"):
            await mgr.load(1, into={"model": four})  # strict=True keeps its meaning
        assert not torch.equal(four[0].weight, three[0].weight)  # nothing changed
        await mgr.load(1, into={"model": four}, strict=False)
    for i in range(3):
        assert torch.equal(four[i].weight, three[i].weight)
        assert torch.equal(four[i].bias, three[i].bias)
    assert torch.equal(four[3].weight, fourth)  # what the checkpoint lacks stays


async def test_strict_false_loads_a_4_layer_checkpoint_into_a_3_layer_model(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    four, three = mlp(4, seed=3), mlp(3, seed=4)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"model": four}))
        with pytest.raises(LoadMismatchError):
            await mgr.load(1, into={"model": three})
        with caplog.at_level("WARNING", logger="aiockpt"):
            await mgr.load(1, into={"model": three}, strict=False)
    for i in range(3):
        assert torch.equal(three[i].weight, four[i].weight)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "model/3.weight" in warned  # what was not restored is said


async def test_strict_false_as_torchsnapshot_means_it(root: str) -> None:
    """torchsnapshot's test_strict_false: the app state at restore has a key the snapshot
    lacks and lacks one it holds. Strict refuses and changes nothing; non-strict restores
    what both hold and leaves the rest."""
    torch.manual_seed(0)
    foo = {"a": torch.rand(40, 40), "b": torch.rand(40, 40)}
    model = torch.nn.Linear(8, 8)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"foo": foo, "model": model}))
        bar = {"a": torch.rand(40, 40), "c": torch.rand(40, 40)}
        c_before, a_before = bar["c"].clone(), bar["a"].clone()
        other = torch.nn.Linear(8, 8)
        target = {"foo": bar, "model": other, "extra": torch.zeros(3)}
        with pytest.raises(LoadMismatchError):
            await mgr.load(1, into=target)
        assert torch.equal(bar["a"], a_before)
        await mgr.load(1, into=target, strict=False)
    assert torch.equal(bar["a"], foo["a"])
    assert torch.equal(bar["c"], c_before)
    assert "b" not in bar
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(target["extra"], torch.zeros(3))


async def test_the_global_rng_state_comes_back(root: str) -> None:
    """torchsnapshot's test_rng_state: the numbers drawn after a restore are those drawn
    after the save."""
    torch.manual_seed(42)
    torch.rand(5)
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"rng": torch.default_generator}))
        after_save = torch.rand(5)
        torch.rand(100)  # the generator moves on
        await mgr.load(1, into={"rng": torch.default_generator})
        after_restore = torch.rand(5)
        # The state as a tensor works the same way, restored by the caller.
        await (await mgr.save(2, {"cpu": torch.random.get_rng_state()}))
        expected = torch.rand(3)
        torch.random.set_rng_state((await mgr.load(2))["cpu"].clone())
        again = torch.rand(3)
    assert torch.equal(after_save, after_restore)
    assert torch.equal(expected, again)
