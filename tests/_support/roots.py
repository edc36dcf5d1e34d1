"""Checkpoint roots as tests see them on disk, and the processes aiockpt leaves running."""

from __future__ import annotations

import json
import os

import psutil

from aiockpt._core import format as fmt

SHM = "/dev/shm"


def manifest_of(root: str, step: int) -> dict:
    """The manifest of ``step`` in ``root``, as JSON."""
    with open(os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)) as f:
        return json.load(f)


def shard_name(root: str, step: int, rank: int = 0) -> str:
    """The file name of rank ``rank``'s shard of ``step``, as its manifest names it (every
    attempt names its files its own way: format.shard_filename)."""
    return next(s["file"] for s in manifest_of(root, step)["shards"] if s["rank"] == rank)


def shard_path(root: str, step: int, rank: int = 0) -> str:
    """The path of rank ``rank``'s shard file of ``step``."""
    return os.path.join(root, fmt.step_dirname(step), shard_name(root, step, rank))


def flip_byte(path: str, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of ``path``: corruption, the smallest kind."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def step_numbers(root: str) -> list[int]:
    """The steps of every step directory under ``root``, committed or not, ascending."""
    return sorted(s for n in os.listdir(root) if (s := fmt.parse_step_dirname(n)) is not None)


def make_partial(root: str, step: int) -> str:
    """A step directory as a crash mid-save leaves it: a shard cut short, no manifest."""
    path = os.path.join(root, fmt.step_dirname(step))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, fmt.shard_filename(0)), "wb") as f:
        f.write(b"\0" * 100)
    return path


def shm_segments(pid: int | None = None) -> set[str]:
    """aiockpt's shared-memory segments, or only those created by process ``pid``."""
    prefix = "aiockpt-" if pid is None else f"aiockpt-{pid}-"
    try:
        return {n for n in os.listdir(SHM) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def is_daemon(proc: psutil.Process) -> bool:
    """Whether ``proc`` is an aiockpt daemon (false for one that is gone or a zombie)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "aiockpt._daemon" in " ".join(
            proc.cmdline()
        )
    except psutil.Error:
        return False


def live_daemons() -> list[psutil.Process]:
    """The aiockpt daemons among this process's descendants."""
    return [p for p in psutil.Process().children(recursive=True) if is_daemon(p)]
