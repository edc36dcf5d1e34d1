"""Incremental checkpoints: blocks a kept checkpoint holds are referred to, not written again;
every checkpoint still loads on its own, and retention never removes a referenced file."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import crc32c
import pytest
import torch
from _support.daemon import daemon_in_process
from _support.ranks import run_ranks
from _support.roots import flip_byte, manifest_of, shard_name, shard_path, step_numbers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt._core import format as fmt
from aiockpt._core.blocks import BLOCK_BYTES, SMALL_BYTES, cut_blocks
from aiockpt.errors import CorruptCheckpointError
from aiockpt.storage import LocalStorage

SCRIPT = str(Path(sys.executable).parent / "aiockpt")
MiB = 1 << 20


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120)


def disk_bytes(root: str) -> int:
    """Every byte under ``root``: shards, manifests, retired files."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def lora_model() -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A frozen base (4 linear layers of 1 MiB each) with small trainable adapters."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, bias=False) for _ in range(4))
    model = torch.nn.Module()
    model.base = layers
    model.lora_a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8, 512)) for _ in range(4))
    model.lora_b = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(512, 8)) for _ in range(4))
    for p in model.base.parameters():
        p.requires_grad_(False)
    return model, [*model.lora_a, *model.lora_b]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    h = x
    for layer, a, b in zip(model.base, model.lora_a, model.lora_b, strict=True):
        h = layer(h) + h @ a.T @ b.T
    loss = h.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim": state["optim"].state_dict()["state"],
    }


@pytest.mark.slow
def test_lora_saves_write_only_what_changed_and_outlive_the_first(root):
    """20 saves of a frozen base + adapters + AdamW: storage holds about the base once plus
    what changed per save, and every kept step loads bit-exact after retention removed step 1,
    whose shard holds the base."""
    model, trainable = lora_model()
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    state = {"model": model, "optim": opt}
    x = torch.randn(4, 512)
    written, saved = {}, {}

    def on_event(event) -> None:
        if event.name == "save.written":
            written[event.step] = event.written_nbytes

    async def main() -> list[int]:
        async with AsyncCheckpointManager(
            root, retention=LatestN(19), event_handlers=[on_event]
        ) as mgr:
            for step in range(1, 21):
                train_step(model, opt, x)
                await (await mgr.save(step, state))
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            return await mgr.steps()

    steps = anyio.run(main)
    assert steps == list(range(2, 21))
    base = sum(p.numel() * 4 for p in model.base.parameters())
    changed = sum(p.numel() * 4 * 3 for p in trainable)  # the adapters and their two moments
    assert disk_bytes(root) <= 1.1 * (base + 20 * changed) + 20 * 16 * 1024  # + manifests
    assert written[1] > base
    assert all(written[s] < base / 8 for s in range(2, 21))
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(1), fmt.MANIFEST))
    assert any(
        n.startswith("shard_r00000.") for n in os.listdir(os.path.join(root, fmt.step_dirname(1)))
    )
    assert manifest_of(root, 20)["version"] == fmt.NAMES_VERSION

    async def load_all() -> None:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            for step in steps:
                got = await mgr.load(step)
                for k, v in saved[step].items():
                    assert torch.equal(got["model"][k], v), (step, k)

    anyio.run(load_all)
    assert cli("verify", root).returncode == 0


def test_the_first_save_is_its_own_file_and_dedup_false_writes_everything(root, tmp_path):
    """Nothing to refer to: the shard is the whole safetensors file, as safetensors reads it.
    With dedup=False nothing is ever referred to."""
    from safetensors import safe_open

    state = {"w": torch.randn(512, 1024), "b": torch.arange(10)}
    off = str(tmp_path / "off")

    async def main() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
            await (await mgr.save(2, state))
        async with AsyncCheckpointManager(off, dedup=False) as mgr:
            await (await mgr.save(1, state))
            await (await mgr.save(2, state))

    anyio.run(main)
    first = manifest_of(root, 1)
    assert first["version"] == fmt.NAMES_VERSION
    assert first["shards"][0]["stored"] == first["shards"][0]["nbytes"]
    with safe_open(shard_path(root, 1), "pt") as f:
        assert torch.equal(f.get_tensor("w"), state["w"])
    second = manifest_of(root, 2)
    assert second["version"] == fmt.NAMES_VERSION
    assert second["shards"][0]["stored"] < 8192  # the header
    for step in (1, 2):
        m = manifest_of(off, step)
        assert m["version"] == fmt.NAMES_VERSION
        assert "blocks" not in m["shards"][0]
        shard = shard_path(off, step)
        assert os.path.getsize(shard) == m["shards"][0]["nbytes"]
    with pytest.raises(TypeError, match="dedup"):
        AsyncCheckpointManager(root, dedup="yes")  # type: ignore[arg-type]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.sampled_from([3, 700, 40_000, 300_000, 600_000]), min_size=2, max_size=6),
    changes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=2, max_size=5),
    keep=st.integers(1, 3),
)
def test_random_changes_between_saves_load_back_exactly(tmp_path_factory, sizes, changes, keep):
    """Random tensors changed in place between saves, retention deleting as it goes: every
    kept step loads exactly what was saved, and verify passes."""
    root = str(tmp_path_factory.mktemp("inc") / "run")
    torch.manual_seed(len(sizes) * 31 + keep)
    state = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    saved = {}

    async def main() -> list[int]:
        async with AsyncCheckpointManager(root, retention=LatestN(keep)) as mgr:
            for step, changed in enumerate(changes, start=1):
                for i in changed:
                    t = state[f"t{i % len(sizes)}"]
                    t[torch.randint(0, t.numel(), (1,))] += 1.0
                await (await mgr.save(step, state))
                saved[step] = {k: v.clone() for k, v in state.items()}
            steps = await mgr.steps()
            for step in steps:
                got = await mgr.load(step)
                for k, v in saved[step].items():
                    assert torch.equal(got[k], v), (step, k)
            return steps

    steps = anyio.run(main)
    assert steps == list(range(len(changes) - min(keep, len(changes)) + 1, len(changes) + 1))
    assert cli("verify", root).returncode == 0


def test_a_referenced_file_corrupt_or_missing_is_named_with_its_step(root):
    state = {"w": torch.randn(1024, 1024), "small": torch.ones(3)}

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
            state["small"] += 1
            await (await mgr.save(2, state))

    async def load(step: int) -> dict:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            return await mgr.load(step)

    anyio.run(save)
    shard1 = shard_path(root, 1)
    flip_byte(shard1, manifest_of(root, 1)["tensors"][shard_name(root, 1)]["w"]["byte_range"][0])
    with pytest.raises(CorruptCheckpointError, match=r"step_000000000001.*written by step 1"):
        anyio.run(load, 2)
    verify = cli("verify", root, "2")
    assert verify.returncode == 1
    assert f"step_000000000001/{shard_name(root, 1)} (written by step 1)" in verify.stdout
    os.unlink(shard1)
    with pytest.raises(CorruptCheckpointError, match=r"written by step 1 and referenced by"):
        anyio.run(load, 2)
    assert "written by step 1" in cli("verify", root, "2").stdout


def test_copy_makes_a_self_contained_checkpoint(root, tmp_path):
    """`aiockpt copy` writes every referenced byte into the copy's own shard: it loads with
    the source gone, and has no block table."""
    state = {"w": torch.randn(1024, 1024), "step": 0}
    dest = str(tmp_path / "copy")

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            for step in (1, 2, 3):
                state["step"] = step
                await (await mgr.save(step, state))

    anyio.run(save)
    assert manifest_of(root, 3)["version"] == fmt.NAMES_VERSION
    done = cli("copy", root, "3", dest)
    assert done.returncode == 0, done.stderr
    assert cli("copy", root, "3", dest).returncode == 1  # already there: refused
    exported = str(tmp_path / "w.safetensors")
    assert cli("export", root, exported, "--step", "3").returncode == 0  # through the table
    from safetensors.torch import load_file

    assert torch.equal(load_file(exported)["w"], state["w"])
    shutil.rmtree(root)
    m = manifest_of(dest, 3)
    assert m["version"] == fmt.NAMES_VERSION
    assert "blocks" not in m["shards"][0]
    assert step_numbers(dest) == [3]

    async def load() -> dict:
        async with AsyncCheckpointManager(dest, read_only=True) as mgr:
            return await mgr.load()

    got = anyio.run(load)
    assert torch.equal(got["w"], state["w"])
    assert got["step"] == 3
    assert cli("verify", dest).returncode == 0


def test_show_and_ls_tell_written_and_referenced_bytes(root):
    state = {"w": torch.randn(1024, 1024)}

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
            await (await mgr.save(2, state))

    anyio.run(save)
    ls = cli("ls", root)
    assert ls.returncode == 0
    header, first, second = ls.stdout.splitlines()
    assert header.split()[3:5] == ["WRITTEN", "REFERENCED"]
    assert first.split()[3:9] == ["4.0", "MiB", "4.0", "MiB", "0", "B"]  # refers to nothing
    assert second.split()[3:5] == ["4.0", "MiB"]
    assert second.split()[6] == "KiB"  # the header
    assert second.split()[7:9] == ["4.0", "MiB"]
    show = cli("show", root, "2")
    assert "read from 1 file of step 1" in show.stdout

    record = json.loads(cli("show", root, "2", "--json").stdout)
    assert record["referenced_files"] == [f"step_000000000001/{shard_name(root, 1)}"]
    assert record["referenced_nbytes"] == 4 * MiB
    assert record["written_nbytes"] + record["referenced_nbytes"] == record["nbytes"]


def test_blocks_tile_the_data_section():
    """Large tensors cut into BLOCK_BYTES pieces, small ones grouped, nothing left out."""
    spans, at = [], 4096
    for n in (10, 3 * BLOCK_BYTES + 5, 100, SMALL_BYTES, 7):
        spans.append((at, at + n))
        at += n
    blocks = cut_blocks(spans, 4096, at)
    assert blocks[0][0] == 4096
    assert blocks[-1][1] == at
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    big_lo = spans[1][0]
    assert (big_lo, big_lo + BLOCK_BYTES) in blocks  # the big tensor starts a block
    assert all(hi - lo <= BLOCK_BYTES for lo, hi in blocks)


class Dies(LocalStorage):
    """A local root whose process dies (a BaseException nothing catches) at its
    ``at``-th deletion: the deletions before it happened, none after."""

    def __init__(self, root: str, at: int) -> None:
        super().__init__(root)
        self.at, self.deletes = at, 0

    def delete(self, path: str, *, recursive: bool = False) -> None:
        if self.deletes == self.at:
            raise Died(path)
        self.deletes += 1
        super().delete(path, recursive=recursive)


class Died(BaseException):
    pass


@pytest.mark.slow
def test_retention_killed_between_any_two_deletions_keeps_every_kept_step(tmp_path):
    """Five saves, each referring to the first's big tensor; a retention pass keeping one is
    stopped before each of its deletions in turn. Every step still committed loads exactly
    and verifies, and a later open cleans up what nothing refers to."""
    template = str(tmp_path / "template")
    big, small = torch.randn(512, 1024), torch.zeros(16)
    saved = {}

    async def save() -> None:
        async with AsyncCheckpointManager(template) as mgr:
            for step in range(1, 6):
                small[step] = step
                await (await mgr.save(step, {"big": big, "small": small, "step": step}))
                saved[step] = small.clone()

    anyio.run(save)
    total = None
    at = 0
    while total is None or at <= total:
        root = str(tmp_path / f"cut{at}")
        shutil.copytree(template, root)
        storage = Dies(root, at)
        with daemon_in_process(root, LatestN(1), storage) as daemon:
            try:
                daemon.pruner.apply("uuid", 5)
            except Died:
                pass
            else:
                total = storage.deletes  # the whole pass: the cuts to try
        committed = [
            s
            for s in step_numbers(root)
            if os.path.exists(manifest := os.path.join(root, fmt.step_dirname(s), fmt.MANIFEST))
        ]
        assert 5 in committed, manifest

        async def check(root: str = root, committed: list[int] = committed) -> list[int]:
            async with AsyncCheckpointManager(root) as mgr:  # collects what is dead
                for step in committed:
                    got = await mgr.load(step)
                    assert torch.equal(got["big"], big)
                    assert torch.equal(got["small"], saved[step])
                return await mgr.steps()

        assert anyio.run(check) == committed
        assert cli("verify", root).returncode == 0
        at += 1
    assert total is not None
    assert total >= 4  # four manifests at least, and then the files


def hostile(mutate) -> str:
    """The message parse_manifest refuses a v3 manifest with once ``mutate`` changed it."""
    fixture = Path(__file__).parent / "fixtures" / "format_v3" / "step_000000000004"
    raw = json.loads((fixture / fmt.MANIFEST).read_text())
    mutate(raw, raw["shards"][0])
    with pytest.raises(CorruptCheckpointError) as e:
        fmt.parse_manifest(json.dumps(raw).encode(), path="m.json", step=4)
    return str(e.value)


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (
            lambda m, s: s["blocks"][0].__setitem__(
                2, "step_000000000004/shard_r00000.safetensors"
            ),
            "not another shard file",
        ),
        (lambda m, s: s["blocks"][0].__setitem__(2, "../etc/passwd"), "not another shard"),
        (lambda m, s: s["blocks"][1].__setitem__(3, 0), "overlap"),  # over the header
        (lambda m, s: s["blocks"][1].__setitem__(3, 4100), "outside its file"),
        (lambda m, s: s["blocks"][0].__setitem__(0, 1 << 30), "more bytes than the shard"),
        (lambda m, s: s["blocks"][0].__setitem__(1, "xyz"), "32 hex digits"),
        (lambda m, s: s["blocks"].append([8, "0" * 32, "", 0, 1]), "malformed block"),
        (lambda m, s: s.__setitem__("stored", 1 << 40), "bad stored size"),
        (lambda m, s: s.__setitem__("blocks", []), "not a non-empty list"),
        (lambda m, s: m.__setitem__("version", 1), "is its own file, in order"),
    ],
)
def test_hostile_block_tables_are_refused(mutate, why):
    assert why in hostile(mutate)


@pytest.mark.slow
def test_ranks_refer_to_their_unchanged_chunks(tmp_path, root):
    """Two real gloo ranks: after the first save neither rank writes its chunk of a frozen
    sharded table nor the replicated table again; the last step loads back equal on both
    ranks, and whole in one plain process."""
    out = run_ranks("_dtensor_worker.py", "dedup_saves", 2, tmp_path, root, timeout=240)
    for rank in out:
        assert all(rank["equal"].values()), rank["equal"]
        assert rank["written"]["1"] > 1 << 20  # its 1 MiB chunk of the frozen table, at least
        assert rank["written"]["2"] < 64 << 10
        assert rank["written"]["3"] < 64 << 10
        assert rank["requests"]["3"]["write_file"] == 1  # the shard, however many its parts
    assert out[0]["requests"]["3"]["put_if_absent"] == 1  # rank 0 commits the manifest
    assert "put_atomic" not in out[1]["requests"]["3"]  # its part went through the job's store
    assert manifest_of(root, 3)["version"] == fmt.NAMES_VERSION

    async def load() -> dict:
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            return await mgr.load(3)

    whole = anyio.run(load)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(whole["frozen"], torch.randn(1024, 512, generator=g))
    assert torch.equal(whole["shared"], torch.randn(512, 512, generator=g))
    assert torch.equal(whole["small"], torch.full((8, 16), 6.0))


def test_a_base_deleted_behind_the_runs_back_is_not_referred_to(root):
    """`aiockpt prune --force` (or a hand) deleted the step the next save would refer to: that
    save writes everything, and loads."""
    state = {"w": torch.randn(512, 1024)}

    async def main() -> dict:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))
            shutil.rmtree(os.path.join(root, fmt.step_dirname(1)))
            await (await mgr.save(2, state))
            return await mgr.load(2)

    assert torch.equal(anyio.run(main)["w"], state["w"])
    assert "blocks" not in manifest_of(root, 2)["shards"][0] or all(
        b[2] == "" for b in manifest_of(root, 2)["shards"][0]["blocks"]
    )


def test_a_file_is_not_kept_alive_for_a_small_part_of_it(root):
    """Everything changes but a small constant tensor: referring to it would keep each old
    shard whole, so it is written again and retention frees the old steps entirely."""
    state = {"w": torch.randn(1024, 1024), "ids": torch.arange(7)}

    async def main() -> list[int]:
        async with AsyncCheckpointManager(root, retention=LatestN(2)) as mgr:
            for step in (1, 2, 3, 4):
                state["w"] += 1
                await (await mgr.save(step, state))
            return await mgr.steps()

    assert anyio.run(main) == [3, 4]
    assert step_numbers(root) == [3, 4]  # no retired directory
    for step in (3, 4):
        (shard,) = manifest_of(root, step)["shards"]
        assert [b[2] for b in shard["blocks"]] == ["", ""]  # nothing referred to


def test_prune_keeps_what_kept_steps_read(root):
    """`aiockpt prune --yes` deletes steps and partials but never a file a kept step reads."""
    state = {"w": torch.randn(1024, 1024), "s": torch.zeros(4)}

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            for step in (1, 2, 3):
                state["s"] += 1
                await (await mgr.save(step, state))

    anyio.run(save)
    dry = cli("prune", root, "--keep-last", "1")
    assert "would delete step 1" in dry.stdout
    done = cli("prune", root, "--keep-last", "1", "--yes")
    assert done.returncode == 0, done.stderr
    assert step_numbers(root) == [1, 3]  # step 1 retired: step 3 reads its big tensor
    again = cli("prune", root, "--keep-last", "1", "--yes")
    assert "keeping retired step directory step_000000000001" in again.stdout
    assert step_numbers(root) == [1, 3]
    assert cli("verify", root).returncode == 0


def test_two_saves_in_flight_refer_only_to_committed_bytes(root):
    """Saves staged back to back (max_pending=2): the second is written after the first
    commits and may refer to it; each loads exactly what it saved."""
    big, small = torch.randn(1024, 1024), torch.zeros(8)

    async def main() -> dict[int, dict]:
        async with AsyncCheckpointManager(root, max_pending=2) as mgr:
            small[0] = 1
            first = await mgr.save(1, {"big": big, "small": small})
            small[0] = 2  # the first save's bytes were staged already
            second = await mgr.save(2, {"big": big, "small": small})
            await first
            await second
            return {step: await mgr.load(step) for step in (1, 2)}

    got = anyio.run(main)
    for step in (1, 2):
        assert torch.equal(got[step]["big"], big)
        assert got[step]["small"][0] == step
    (shard,) = manifest_of(root, 2)["shards"]
    assert {b[2] for b in shard["blocks"]} == {"", f"step_000000000001/{shard_name(root, 1)}"}


def test_crcs_of_unchanged_blocks_come_from_the_base_and_stay_right(root):
    """A tensor of three blocks, one changed per save: its crc is folded from the blocks'
    crcs (the unchanged ones remembered, or after a restart computed with their hashes), and
    every manifest's crcs are those of the bytes."""
    big = torch.randn(40 << 18)  # 40 MiB: blocks of 16, 16 and 8 MiB
    state = {"big": big, "small": torch.randn(10)}
    quarter = BLOCK_BYTES // 4  # elements in one block

    async def saves(steps: list[int]) -> None:
        async with AsyncCheckpointManager(root) as mgr:
            for step in steps:
                big[(step % 3) * quarter + 7] += 1.0  # one element of one block
                state["small"] += 1.0
                await (await mgr.save(step, state))

    crcs = {}

    async def saves_noting_crcs(steps: list[int]) -> None:
        await saves(steps)
        crcs[steps[-1]] = crc32c.crc32c(big.numpy().tobytes())

    anyio.run(saves_noting_crcs, [1, 2, 3])
    # A restart: the base comes from the manifest, without crcs.
    anyio.run(saves_noting_crcs, [4, 5])
    for step, crc in crcs.items():
        entry = manifest_of(root, step)["tensors"][shard_name(root, step)]["big"]
        assert entry["crc32c"] == crc, step
    assert manifest_of(root, 5)["version"] == fmt.NAMES_VERSION
    assert cli("verify", root).returncode == 0  # every tensor's crc and the shards'
