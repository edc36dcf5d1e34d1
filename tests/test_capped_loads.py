"""load(into=...) under staging_memory: a shard larger than the cap is read through two window
slabs of the pool, checked whole before anything is copied, and restored bit-exact."""

from __future__ import annotations

import copy
import itertools
import json
import os
import struct

import anyio
import pytest
import torch
from _support.roots import flip_byte, manifest_of
from test_staging_cap import assert_equal, mixed_state

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.protocol import StreamReq, StreamWindowReq
from aiockpt._daemon.load.windows import cut_output
from aiockpt.errors import CheckpointError, CorruptCheckpointError, StagingMemoryError

MiB = 1 << 20


def zeroed(value):
    """``value`` with every tensor zeroed, strides kept (a transposed tensor stays one)."""
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return value


def record_parts(mgr) -> list:
    """Wrap the manager's loads' daemon requests: the list gets each one's (window, part);
    a streamed load's window is its start's."""
    loader = mgr._loader
    real = loader._read
    seen: list = []
    streams: dict = {}

    async def read(kind, **fields):
        if kind is StreamReq:
            streams[fields["name"]] = fields["window"]
        window = streams.get(fields["name"]) if kind is StreamWindowReq else None
        window = fields.get("window", window or 0)
        seen.append((window, fields.get("part")))
        return await real(kind, **fields)

    loader._read = read
    return seen


def cap_of(root: str, fraction: float) -> int:
    return int(fraction * manifest_of(root, 1)["shards"][0]["nbytes"])


def test_a_capped_load_into_restores_bit_exact_and_stays_under_the_cap(tmp_path) -> None:
    """A plain state, a module and an optimizer (restored through load_state_dict, so handed
    their own tensors), a non-contiguous target, a scalar: all restored, and the pool's own
    accounting never holds more than the cap."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.Linear(700, 500))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 600)).sum().backward()
    opt.step()
    state = {**mixed_state(), "net": model, "opt": opt}
    want = {"net": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    root = str(tmp_path / "r")

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
        cap = cap_of(root, 0.25)
        fresh_model = torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.Linear(700, 500))
        fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
        into = {**zeroed(mixed_state()), "net": fresh_model, "opt": fresh_opt}
        into["step"] = 0
        assert not into["model"]["t"].is_contiguous()
        async with AsyncCheckpointManager(root, staging_memory=cap, read_only=True) as mgr:
            parts = record_parts(mgr)
            await mgr.load(1, into=into)
            assert 0 < mgr._pool.peak <= cap
            assert mgr._pool.busy == 0
        windows = [p for _, p in parts if p is not None]
        assert len(windows) >= 4
        assert windows == list(range(len(windows)))
        assert parts[0] == (cap // 2 // 4096 * 4096, None)  # the checking pass first
        assert_equal({k: into[k] for k in mixed_state()}, mixed_state())
        assert_equal(fresh_model.state_dict(), want["net"])
        got = fresh_opt.state_dict()
        assert got["param_groups"] == want["opt"]["param_groups"]
        for i, s in want["opt"]["state"].items():
            assert_equal(got["state"][i], s)

    anyio.run(main)


@pytest.mark.parametrize("where", ["end of the shard", "middle of a tensor cut by windows"])
def test_a_capped_load_that_fails_a_checksum_leaves_the_target_untouched(tmp_path, where) -> None:
    """Every window is checked before the first is copied: a flipped byte fails the load,
    naming its tensor, and no target has changed: in the shard's last tensor, or in the
    middle of one whose bytes lie in several windows (checked by its running crc32c)."""
    state = mixed_state()
    root = str(tmp_path / "r")

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))

    anyio.run(save)
    shard = manifest_of(root, 1)["shards"][0]
    path = os.path.join(root, fmt.step_dirname(1), shard["file"])
    if where == "end of the shard":
        offset, name = shard["nbytes"] - 3, ""
    else:
        with open(path, "rb") as f:  # the shard's own safetensors header
            (n,) = struct.unpack("<Q", f.read(8))
            a, b = json.loads(f.read(n))["model/w0"]["data_offsets"]
        data_start = 8 + n
        assert b - a > 3 * cap_of(root, 0.25) // 8  # more than a window: cut by two at least
        offset, name = data_start + (a + b) // 2, "model/w0"
    flip_byte(path, offset)
    into = zeroed(mixed_state())

    async def load() -> None:
        async with AsyncCheckpointManager(
            root, staging_memory=cap_of(root, 0.25), read_only=True
        ) as mgr:
            parts = record_parts(mgr)
            with pytest.raises(CorruptCheckpointError, match=f"{name}.*crc32c"):
                await mgr.load(1, into=into)
            # It failed in the checking pass (answered, then collected): no window read again.
            assert [p for _, p in parts] == [None, None]
            assert mgr._pool.busy == 0

    anyio.run(load)
    assert_equal(into, zeroed(mixed_state()))


def test_a_capped_load_of_a_subset_reads_what_the_target_holds(tmp_path) -> None:
    state = mixed_state()
    root = str(tmp_path / "r")

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
        into = {"model": zeroed(state["model"])}
        async with AsyncCheckpointManager(
            root, staging_memory=cap_of(root, 0.25), read_only=True
        ) as mgr:
            await mgr.load(1, into=into, strict=False)
            assert mgr._pool.peak <= cap_of(root, 0.25)
        assert_equal(into["model"], state["model"])

    anyio.run(main)


def test_a_tensor_copied_in_place_and_handed_over_loads_in_windows(tmp_path) -> None:
    """One saved tensor restored twice, copied into a plain target and handed over inside a
    module's state dict: its bytes go to both, the window copies cutting them twice."""
    root = str(tmp_path / "r")
    net = torch.nn.Linear(3000, 1000)
    state = {"w": net.weight.detach(), "net": net, "small": mixed_state()["small"]}

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
        fresh = torch.nn.Linear(3000, 1000)
        into = {"w": torch.zeros(1000, 3000), "net": fresh, "small": zeroed(state["small"])}
        async with AsyncCheckpointManager(root, staging_memory=4 * MiB, read_only=True) as mgr:
            parts = record_parts(mgr)
            await mgr.load(1, into=into)
            assert len([p for _, p in parts if p is not None]) >= 4
        assert torch.equal(into["w"], net.weight)
        assert torch.equal(fresh.weight, net.weight)
        assert torch.equal(fresh.bias, net.bias)
        assert_equal(into["small"], state["small"])

    anyio.run(main)


def test_placeholders_name_the_tensor_a_source_is_cut_from() -> None:
    """A plan against placeholders gets back views of them: each is named by where its bytes
    lie, an empty tensor sharing its start with the next never taken for it."""
    from aiockpt._trainer.load.views import views
    from aiockpt._trainer.load.windows import _Placeholders

    specs = {
        "a": ("F32", (4, 6), 0),
        "e": ("F32", (0,), 96),
        "b": ("F32", (10,), 96),
        "c": ("I64", (3,), 136),
        "r": ("U8", (16,), 160),  # a generator's state, likely: a placeholder of its own
    }
    whole = torch.empty(176, dtype=torch.uint8, device="meta")
    meta = views(whole, specs)
    names = _Placeholders(meta, whole, specs)
    assert [names.exactly(meta[k]) for k in specs] == list(specs)
    assert names.exactly(meta["a"][1]) is None
    cut = {
        "a": [meta["a"][1:3, 2:], meta["a"].t(), meta["a"][3]],
        "b": [meta["b"][3:], meta["b"][:0], meta["b"].view(2, 5)],
        "c": [meta["c"][2:]],
        "r": [meta["r"][2:]],
    }
    for name, srcs in cut.items():
        assert [names.under(src) for src in srcs] == [name] * len(srcs)
    assert names.under(meta["e"]) == "e"
    with pytest.raises(AssertionError, match="not a view of its placeholders"):
        names.under(torch.empty(3, device="meta"))


def test_load_windows_tile_the_output_and_never_cut_a_box() -> None:
    from aiockpt._core.chunks import Chunk

    boxes = [("a", "F32", Chunk((0,), (3000,))), ("b", "F32", Chunk((0, 0), (10, 1000)))]
    out_at = {"a": 10_000, "b": 30_016}
    size = 30_016 + 40_000 + 5
    for window in (4096, 12_288, 40_000, 50_000, size + 1):
        if window < 40_000:
            with pytest.raises(StagingMemoryError, match=r"its \d+ bytes are read whole"):
                cut_output(size, window, boxes, out_at)
            continue
        cut = cut_output(size, window, boxes, out_at)
        assert cut[0][0] == 0
        assert cut[-1][1] == size
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(cut))
        assert all(0 < b - a <= window for a, b in cut)
        for name, _, box in boxes:
            o, e = out_at[name], out_at[name] + box.numel * 4
            assert any(a <= o and e <= b for a, b in cut), (window, name, cut)
        # Ends: multiples of 4096, or where a box starts or ends, or the output's end.
        assert all(b % 4096 == 0 or b in (size, 10_000, 22_000, 30_016, 70_016) for _, b in cut)
    with pytest.raises(StagingMemoryError, match="too small"):
        cut_output(size, 1000, [], {})
    assert cut_output(0, 4096, [], {}) == ((0, 0),)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streamed"])
def test_distributed_tensors_load_in_windows_and_a_box_too_big_is_refused(tmp_path, atomic) -> None:
    """DTensors restored into DTensors have their boxes assembled whole, each in one window;
    a box larger than a window is a StagingMemoryError before anything changes, streamed
    (atomic=False) or not."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(2)
    full = {f"d{i}": torch.randn(300 + i, 2001, generator=g) for i in range(6)}
    full["big"] = torch.randn(2000, 2000, generator=g)  # 16 MB: more than a 5 MiB window
    root = str(tmp_path / "r")

    async def main() -> None:
        mesh = init_device_mesh("cpu", (1,))

        def state(values):
            return {
                "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in values.items()},
                "plain": torch.arange(1000) if values is full else torch.zeros(1000, dtype=int),
            }

        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state(full)))
        zeros = {k: torch.zeros_like(v) for k, v in full.items()}
        small = {k: v for k, v in zeros.items() if k != "big"}
        async with AsyncCheckpointManager(root, staging_memory=10 * MiB, read_only=True) as mgr:
            parts = record_parts(mgr)
            into = state(zeros)
            with pytest.raises(StagingMemoryError, match="big: its 16000000 bytes"):
                await mgr.load(1, into=into, atomic=atomic)
            assert_equal({k: v.full_tensor() for k, v in into["model"].items()}, zeros)
            into = state(small)
            await mgr.load(1, into=into, strict=False, atomic=atomic)
            assert len([p for _, p in parts if p is not None]) >= 2
            assert mgr._pool.peak <= 10 * MiB
        assert_equal(
            {k: v.full_tensor() for k, v in into["model"].items()},
            {k: v for k, v in full.items() if k != "big"},
        )
        assert torch.equal(into["plain"], torch.arange(1000))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        anyio.run(main)
    finally:
        dist.destroy_process_group()


class _WithGenerator:
    """A Stateful object whose state dict holds a generator and a tensor."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(3_000_000, generator=self.g)

    def state_dict(self) -> dict:
        return {"g": self.g, "w": self.w}

    def load_state_dict(self, d: dict) -> None:
        self.g = d["g"]
        self.w.copy_(d["w"])


def test_a_capped_load_restores_generators_in_stateful_objects_and_in_place(tmp_path) -> None:
    """A generator handed over inside a state dict gets its state once its bytes are in (the
    restore is planned before they are); a generator in the target is set in place."""
    root = str(tmp_path / "r")
    saved = _WithGenerator(5)
    torch.randn(7, generator=saved.g)
    state = {"s": saved, "t": torch.randn(2_000_000), "gen": torch.Generator().manual_seed(3)}

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
        target = _WithGenerator(0)
        into = {"s": target, "t": torch.zeros(2_000_000), "gen": torch.Generator()}
        async with AsyncCheckpointManager(root, staging_memory=8 * MiB, read_only=True) as mgr:
            parts = record_parts(mgr)
            await mgr.load(1, into=into)
            assert len([p for _, p in parts if p is not None]) >= 4
        assert torch.equal(target.w, saved.w)
        assert torch.equal(target.g.get_state(), saved.g.get_state())
        assert torch.equal(into["t"], state["t"])
        assert torch.equal(into["gen"].get_state(), state["gen"].get_state())

    anyio.run(main)


def test_fsdp2_model_and_optimizer_load_in_windows(tmp_path) -> None:
    """FSDP2 (one rank): the optimizer's DTensor moments are handed over through its
    load_state_dict, the parameters copied in place; both equal what was saved."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = str(tmp_path / "r")

    def make(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(900, 1000), torch.nn.Linear(1000, 700))
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def full(value):
        if isinstance(value, dict):
            return {k: full(v) for k, v in value.items()}
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    async def main() -> None:
        model, opt = make(0)
        model(torch.randn(4, 900)).sum().backward()
        opt.step()
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, {"model": model, "optim": opt}))
        model2, opt2 = make(1)
        async with AsyncCheckpointManager(root, staging_memory=12 * MiB, read_only=True) as mgr:
            parts = record_parts(mgr)
            await mgr.load(1, into={"model": model2, "optim": opt2})
            assert len([p for _, p in parts if p is not None]) >= 3
            assert mgr._pool.peak <= 12 * MiB
        assert_equal(full(model2.state_dict()), full(model.state_dict()))
        want, got = opt.state_dict(), opt2.state_dict()
        assert got["param_groups"] == want["param_groups"]
        assert_equal(full(got["state"]), full(want["state"]))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        anyio.run(main)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cap", [None, 0.25])
def test_a_cancelled_load_into_gives_its_slab_back_only_once_the_daemon_is_done(
    tmp_path, cap
) -> None:
    """The daemon fills a lent slab while the trainer waits: a load cancelled then still waits
    for the daemon's answer before the slab can go to a save (which would copy into it while
    the daemon still writes there)."""
    state = {f"w{i}": torch.randn(4 * MiB) for i in range(16)}  # 256 MiB
    root = str(tmp_path / "r")

    async def main() -> None:
        async with AsyncCheckpointManager(root, staging_memory=cap) as mgr:
            await (await mgr.save(1, state))
            answered: list[int] = []
            loader = mgr._loader
            real = loader._read

            async def read(kind, **fields):
                reply = await real(kind, **fields)
                answered.append(1)
                return reply

            loader._read = read
            with anyio.move_on_after(0.01) as scope:
                await mgr.load(1, into=state)
            assert scope.cancelled_caught
            assert answered  # the request in flight was waited for
            assert mgr._pool.busy == 0
            loader._read = real
            await (await mgr.save(2, state))
            assert_equal(await mgr.load(2), state)

    anyio.run(main)


@pytest.mark.parametrize("gone_at", [0, 2])
def test_a_capped_load_whose_shard_goes_while_copying_windows_says_so(
    tmp_path, caplog, gone_at
) -> None:
    """Every checksum passed, then the shard is gone before window 2 is read again: the load
    raises the storage's error itself (not wrapped in a group), says the target may be partly
    restored, and gives both window slabs back. Gone before window 0, nothing was copied:
    the target is as it was, and the log says nothing of a partial restore."""
    state = mixed_state()
    root = str(tmp_path / "r")
    into = zeroed(mixed_state())

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
        shard = os.path.join(root, fmt.step_dirname(1), manifest_of(root, 1)["shards"][0]["file"])
        async with AsyncCheckpointManager(
            root, staging_memory=cap_of(root, 0.25), read_only=True
        ) as mgr:
            loader = mgr._loader
            real = loader._read

            async def read(kind, **fields):
                if fields.get("part") == gone_at:
                    os.remove(shard)
                return await real(kind, **fields)

            loader._read = read
            with pytest.raises(CheckpointError):  # not a group of one
                await mgr.load(1, into=into)
            assert mgr._pool.busy == 0

    with caplog.at_level("ERROR", logger="aiockpt"):
        anyio.run(main)
    if gone_at:
        assert "the target may be partly restored" in caplog.text
    else:
        assert "partly restored" not in caplog.text
        assert_equal(into, zeroed(mixed_state()))
