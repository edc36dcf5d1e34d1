"""Shared helpers of the fault suite: processes, shared memory, and an independent verifier."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import crc32c
import psutil

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trainer.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its parent counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


class Trainer:
    """A trainer in its own process (tests/faults/_trainer.py), driven through its stdout."""

    def __init__(self, mode: str, root: str, *args: str, new_session: bool = False) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, TRAINER, mode, root, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=new_session,
        )
        self.lines: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, word: str, timeout: float = 60) -> list[str]:
        """Read lines until one starts with ``word``; return its fields after the word."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise AssertionError(f"trainer did not print {word!r}; it printed {self.lines}")
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise AssertionError(f"trainer exited ({code}) before {word!r}: {self.lines}")
            self.lines.append(line.rstrip("\n"))
            fields = line.split()
            if fields and fields[0] == word:
                return fields[1:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        assert self.proc.stdout is not None
        self.lines += self.proc.stdout.read().splitlines()
        self.proc.stdout.close()
        return code

    def close(self) -> None:
        """Kill the trainer if it still runs (a failed test must not leave it behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()


def reap_daemon(pid: int, timeout: float = 10) -> None:
    """Wait for an orphaned daemon to exit; kill it if it does not (then fail the test)."""
    try:
        wait_until(lambda: not alive(pid), timeout, f"daemon {pid} exits")
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        raise


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:012d}")


def verify_checkpoint(root: str, step: int) -> dict[str, Any]:
    """Check a committed checkpoint without aiockpt: every crc32c in its manifest, recomputed."""
    d = step_dir(root, step)
    with open(os.path.join(d, "manifest.json"), "rb") as f:
        manifest = json.loads(f.read())
    assert manifest["step"] == step
    for shard in manifest["shards"]:
        with open(os.path.join(d, shard["file"]), "rb") as f:
            data = f.read()
        assert len(data) == shard["nbytes"], shard["file"]
        assert crc32c.crc32c(data) == shard["crc32c"], shard["file"]
        for name, t in manifest["tensors"][shard["file"]].items():
            start, end = t["byte_range"]
            assert crc32c.crc32c(data[start:end]) == t["crc32c"], (shard["file"], name)
    return manifest


def committed(root: str) -> list[int]:
    """Steps whose manifest exists, read straight from the directory."""
    if not os.path.isdir(root):
        return []
    return sorted(
        int(n[5:])
        for n in os.listdir(root)
        if n.startswith("step_") and os.path.exists(os.path.join(root, n, "manifest.json"))
    )
