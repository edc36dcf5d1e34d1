"""Nothing aiockpt does kills the trainer, and every error names its cause.

Shared memory short of a save's or a load's needs is an error, not a SIGBUS; what a failed call
leaves reachable (its exception's frames, say) never points into memory that was unmapped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import anyio
import torch

from aiockpt import AsyncCheckpointManager

#: A child runs under a private /dev/shm of this size (a container's default is 64 MiB).
SMALL_SHM = "16m"


def run_child(code: str, *args: str, shm: str | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (with a private tmpfs of ``shm`` as /dev/shm when
    given); its output, once it exited 0 (a signal shows as a negative return code)."""
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
    if shm is not None:
        # A mount namespace of its own: the host's /dev/shm is never touched.
        assert shutil.which("unshare"), "this test needs unshare(1) (util-linux)"
        mount = f'mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the child exited {proc.returncode}:\n{out}"
    return out


SHORT_SHM_CHILD = """
    import os, sys
    import anyio, torch
    from aiockpt import AsyncCheckpointManager
    from aiockpt.errors import StagingMemoryError

    root = sys.argv[1]
    MiB = 1 << 20

    def state(value):
        return {"w": torch.full((10 * MiB // 4,), value, dtype=torch.float32)}

    def assert_says(e, what):
        text = str(e)
        for needle in (what, "/dev/shm", "free", "staging_memory", "max_pending"):
            assert needle in text, (needle, text)

    async def main():
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state(1.0)))
            try:  # a shard larger than the whole of /dev/shm
                await mgr.save(9, {"w": torch.ones(24 * MiB // 4)})
            except StagingMemoryError as e:
                assert_says(e, "24.0 MiB")
            else:
                raise AssertionError("a save larger than /dev/shm did not fail")
        # Another process takes most of what is left: 10 MiB do not fit now.
        with open("/dev/shm/filler", "wb") as f:
            f.write(b"x" * (8 * MiB))
        async with AsyncCheckpointManager(root) as mgr:
            try:
                await mgr.save(2, state(2.0))
            except StagingMemoryError as e:
                assert_says(e, "bytes")
                print("save:", e)
            else:
                raise AssertionError("the save did not fail")
            assert await mgr.steps() == [1]
            target = state(0.0)
            try:
                await mgr.load(into=target)
            except StagingMemoryError as e:
                assert_says(e, "bytes")
            else:
                raise AssertionError("load(into=) did not fail")
            assert torch.equal(target["w"], state(0.0)["w"])
            # load() of a local root reads straight into new tensors: no shared memory.
            loaded = await mgr.load()
            assert torch.equal(loaded["w"], state(1.0)["w"])
            del loaded
            os.unlink("/dev/shm/filler")
            # Space freed: the same manager saves and loads again.
            await (await mgr.save(3, state(3.0)))
            assert await mgr.steps() == [1, 3]
            await mgr.load(into=target)
            assert torch.equal(target["w"], state(3.0)["w"])
            await mgr.load(1, into=target)
            assert torch.equal(target["w"], state(1.0)["w"])
        async with AsyncCheckpointManager(root) as mgr:  # its slab gone: room for load()
            loaded = await mgr.load()
            assert torch.equal(loaded["w"], state(3.0)["w"])
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("aiockpt")]

    anyio.run(main)
    print("alive")
"""


def test_shared_memory_too_small_is_an_error_not_a_sigbus(tmp_path):
    out = run_child(SHORT_SHM_CHILD, str(tmp_path / "run"), shm=SMALL_SHM)
    assert "alive" in out


FORMAT_AFTER_CLOSE_CHILD = """
    import glob, sys, traceback
    import anyio, torch
    from aiockpt import AsyncCheckpointManager
    from aiockpt.errors import CorruptCheckpointError, LoadMismatchError, UnsupportedValueError

    root = sys.argv[1]

    def format_all(e):
        # Every exception of the chain, suppressed context included, with every frame's
        # locals: what error reporters (Sentry, rich, pytest) show.
        stack, seen, n = [e], set(), 0
        while stack:
            exc = stack.pop()
            if exc is None or id(exc) in seen:
                continue
            seen.add(id(exc))
            te = traceback.TracebackException.from_exception(exc, capture_locals=True)
            n += len("".join(te.format()))
            stack += [exc.__cause__, exc.__context__]
        return n

    async def failed_load_into():
        model = {f"w{i}": torch.full((1000,), float(i)) for i in range(20)}
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, {"model": model, "b": torch.ones(10)}))
            try:  # a strict key mismatch, found against views of the slab read into
                await mgr.load(into={"model": model, "c": torch.zeros(10)})
            except LoadMismatchError as e:
                return e

    async def failed_save():
        model = {f"w{i}": torch.full((1000,), float(i)) for i in range(20)}
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(2, {"model": model}))
            # The same keys, one value no longer savable: found by the copy into the slab.
            model["w3"] = model["w3"].to_sparse()
            try:
                await mgr.save(3, {"model": model})
            except UnsupportedValueError as e:
                return e

    async def failed_load():
        shard = glob.glob(f"{root}/*1/*.safetensors")[0]
        with open(shard, "r+b") as f:  # a corrupt shard: found once the views are built
            f.seek(-8, 2)
            byte = f.read(1)
            f.seek(-8, 2)
            f.write(bytes([byte[0] ^ 1]))
        async with AsyncCheckpointManager(root) as mgr:
            try:
                await mgr.load(1)
            except CorruptCheckpointError as e:
                return e

    # Each error is formatted as soon as its manager closed, before anything else is mapped
    # where its memory was.
    for call in (failed_load_into, failed_save, failed_load):
        error = anyio.run(call)
        assert error is not None, call
        assert format_all(error) > 0
        del error
    print("alive")
"""


def test_formatting_a_failed_calls_locals_after_close_does_not_crash(tmp_path):
    out = run_child(FORMAT_AFTER_CLOSE_CHILD, str(tmp_path / "run"))
    assert "alive" in out


def test_a_replaced_slab_is_unmapped_once_nothing_views_it(tmp_path):
    """Slabs let go of their memory rather than unmap it (see Slab.close): a slab replaced by
    a larger one, with no view of it left, is unmapped at once all the same."""

    def mapped() -> list[str]:
        with open("/proc/self/maps") as f:
            return [line for line in f if "/aiockpt-" in line]

    async def main() -> None:
        async with AsyncCheckpointManager(str(tmp_path / "run")) as mgr:
            for step in range(4):  # each state larger than the last: a new slab each time
                await (await mgr.save(step, {"w": torch.ones((step + 1) << 18)}))
                assert len(mapped()) == 1, mapped()
        assert mapped() == []

    anyio.run(main)
