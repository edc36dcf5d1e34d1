"""A trainer process for the fault tests: ``python _trainer.py MODE ROOT [BACKEND]``.

It reports on stdout, one line per fact, and the test kills or signals it at a chosen point.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import time

import anyio
import torch

from aiockpt import AsyncCheckpointManager
from aiockpt._trainer.staging import Slab
from aiockpt.errors import StorageError
from aiockpt.retention import LatestN

BIG = 32 << 20  # float32 elements: 128 MiB, long enough to still be writing when signalled


def say(*fields: object) -> None:
    print(*fields, flush=True)


async def staged(root: str) -> None:
    """Two large saves staged, then the test SIGKILLs us: the daemon must still commit both."""
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.arange(10)}))
        say("DAEMON", mgr.daemon_pid)
        await mgr.save(2, {"w": torch.full((BIG,), 2.0)})
        await mgr.save(3, {"w": torch.full((BIG,), 3.0)})
        say("STAGED")
        await anyio.sleep(120)


async def staging(root: str) -> None:
    """Killed while copying into the slab: the save never reached the daemon."""
    original = Slab.copy_in

    def slow_copy_in(self: Slab, *args) -> None:  # type: ignore[no-untyped-def]
        say("COPYING")
        time.sleep(120)  # hold the copy open: the test kills us inside it
        original(self, *args)

    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, {"w": torch.arange(10)}))
        say("DAEMON", mgr.daemon_pid)
        Slab.copy_in = slow_copy_in  # type: ignore[method-assign]
        await mgr.save(2, {"w": torch.ones(1 << 20)})
        say("NOT KILLED")


async def sigterm(root: str) -> None:
    """Preemption: SIGTERM arrives while two large saves are staged."""
    async with AsyncCheckpointManager(root, on_sigterm="flush") as mgr:
        say("DAEMON", mgr.daemon_pid)
        await mgr.save(1, {"w": torch.full((BIG,), 1.0)})
        await mgr.save(2, {"w": torch.full((BIG,), 2.0)})
        say("STAGED")
        await anyio.sleep(120)
    say("NOT KILLED")


def drop_dac_override() -> None:
    """Make permission bits bind processes we start, even when running as root.

    Root bypasses directory permissions through CAP_DAC_OVERRIDE. Dropping it (and its
    relatives) from the bounding set means the daemon, exec'd after this, never has it.
    """
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


async def readonly(root: str) -> None:
    """Saves into a read-only root and a read-only step directory fail with EACCES."""
    drop_dac_override()
    result: dict[str, object] = {}
    async with AsyncCheckpointManager(root, retention=LatestN(1)) as mgr:
        await (await mgr.save(1, {"w": torch.arange(10)}))
        os.chmod(root, 0o555)
        try:
            await (await mgr.save(2, {"w": torch.arange(20)}))
        except StorageError as e:
            result["root"] = [e.errno, str(e)]
        finally:
            os.chmod(root, 0o755)
        result["after_root"] = await mgr.steps()
        os.makedirs(os.path.join(root, "step_000000000003"), mode=0o555)
        try:
            await (await mgr.save(3, {"w": torch.arange(30)}))
        except StorageError as e:
            result["step_dir"] = [e.errno, str(e)]
        result["after_step_dir"] = await mgr.steps()
        result["partial_left"] = os.path.exists(os.path.join(root, "step_000000000003"))
        info = await (await mgr.save(4, {"w": torch.arange(40)}))  # keeps working
        result["after_recovery"] = await mgr.steps()
        result["loaded"] = (await mgr.load(4))["w"].tolist() == list(range(40))
        result["committed_4"] = info.step
    result["EACCES"] = errno.EACCES
    say("RESULT", json.dumps(result))


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    backend = sys.argv[3] if len(sys.argv) > 3 else "asyncio"
    anyio.run(globals()[mode], root, backend=backend)


if __name__ == "__main__":
    main()
