"""The invariants, checked in each crash state rebuilt as a directory.

Two levels, both through aiockpt's own code:

- :func:`inspect`, in this process, on every state: the catalog's listing (committed = has a
  manifest), each committed step's manifest and shards byte for byte against what the
  recorded run wrote, ``aiockpt verify ROOT`` finding nothing wrong with any step, and a lease
  file that is one aiockpt wrote (so a later writer can take a dead writer's lease over).
- :func:`open_and_check`, a fresh :class:`AsyncCheckpointManager` and its daemon, on one state
  of each class of states that differ only in leftover temporary files (``*.new``,
  ``*.tmp``): it opens the root (``takeover=True``: the lease there is the dead writer's,
  unexpired), its ``steps()`` load bit-exact against what was saved, the partials below the
  newest commit are gone after the open, and once a newer step commits the next open removes
  every partial. A crash state of a local tier is opened as a tier, with its root as the
  crash found it (:class:`TierOpen`).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aiockpt import AsyncCheckpointManager, LocalTier
from aiockpt._core.catalog import Catalog
from aiockpt._core.lease import read_current
from aiockpt.cli.common import scan
from aiockpt.cli.output import Progress
from aiockpt.cli.verify import entry_problems
from aiockpt.errors import CheckpointError
from aiockpt.storage import LocalStorage

TEMPORARY = re.compile(r".*\.(new|tmp)$")
_STEP = re.compile(r"step_(\d{12})/")


def materialize(tree: Mapping[str, bytes | None], root: str) -> str:
    """Write ``tree`` (path -> bytes, or None for a directory) under ``root``."""
    os.makedirs(root)
    for path, data in sorted(tree.items()):
        full = os.path.join(root, path)
        if data is None:
            os.makedirs(full, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
    return root


class Scratch:
    """A directory turned into one tree after another, changing only what differs: removing a
    directory is slow on some file systems, and consecutive crash states differ little. For
    in-process checks, which only read; a manager's open gets a fresh directory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.tree: dict[str, bytes | None] = {}
        os.makedirs(root)

    def become(self, tree: Mapping[str, bytes | None]) -> str:
        """Make the directory hold exactly ``tree``; its path."""
        old = self.tree
        for path in sorted(old, reverse=True):  # what a directory holds goes before it
            if path not in tree or (tree[path] is None) != (old[path] is None):
                full = os.path.join(self.root, path)
                if old[path] is None:
                    os.rmdir(full)
                else:
                    os.unlink(full)
                del old[path]
        for path, data in sorted(tree.items()):
            if path in old and old[path] == data:
                continue
            full = os.path.join(self.root, path)
            if data is None:
                os.mkdir(full)
            else:
                with open(full, "wb") as f:
                    f.write(data)
        self.tree = dict(tree)
        return self.root


def coarse(tree: Mapping[str, bytes | None]) -> dict[str, bytes | None]:
    """The tree without its temporary files."""
    return {p: v for p, v in tree.items() if not TEMPORARY.match(p)}


def verify(root: str) -> dict[int, list[str]]:
    """What ``aiockpt verify ROOT`` finds wrong with each committed step: the command's own
    scan and checks, run in this process on a local root (its argument parsing and storage
    lookup, the same every time, left out)."""
    scanned = scan(Catalog(LocalStorage(root)), root)
    progress = Progress(0, io.StringIO())
    return {e.step: entry_problems(scanned, e, progress) for e in scanned.committed}


def written_files(records: list[dict[str, Any]]) -> dict[str, bytes]:
    """What the recorded run wrote into step directories, by path: the reference."""
    out = {}
    writes = ("write_file", "put_atomic", "put_if_absent", "receive")
    for r in records:
        if (
            r["op"] == "api"
            and r["call"] in writes
            and _STEP.match(r["path"])
            and r.get("result", True)
        ):
            out[r["path"]] = r["data"]
    return out


def inspect(root: str, reference: Mapping[str, bytes]) -> tuple[set[int], list[str]]:
    """The committed steps of ``root`` and what is wrong with it (see the module doc)."""
    storage = LocalStorage(root)
    catalog = Catalog(storage)
    problems = []
    lease = read_current(storage)
    if lease.problem is not None:
        problems.append(f"the lease is not one aiockpt wrote: {lease.problem}")
    committed = set(catalog.committed_steps())
    verified = verify(root) if committed else {}
    for step in sorted(committed):
        step_dir = f"step_{step:012d}"
        names = [f"{step_dir}/manifest.json"]
        try:
            m = catalog.read_manifest(step)
            names += [f"{step_dir}/{s.file}" for s in m.shards]
            names += sorted(m.referenced_files())  # other steps' files it reads from
        except CheckpointError as e:
            problems.append(f"step {step} is committed but its manifest is refused: {e}")
        for name in names:
            full = os.path.join(root, name)
            data = None
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    data = f.read()
            if data != reference.get(name):
                got = "missing" if data is None else f"{len(data)} bytes"
                problems.append(f"step {step} is committed but {name} is not as written ({got})")
        if verified.get(step):
            found = "; ".join(verified[step])
            problems.append(f"step {step} is committed but aiockpt verify finds: {found}")
    return committed, problems


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two saved states."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def partials(root: str) -> dict[int, bool]:
    """Each step directory's step -> whether it has a manifest."""
    return Catalog(LocalStorage(root)).step_dirs()


def collectable(root: str) -> dict[int, bool]:
    """As :func:`partials`, but a directory without a manifest that holds only files which
    committed steps read from (a retired one, of incremental checkpoints) counts as kept."""
    catalog = Catalog(LocalStorage(root))
    dirs = catalog.step_dirs()
    refs = catalog.referenced() or frozenset()
    for step, committed in dirs.items():
        name = f"step_{step:012d}"
        files = [] if committed else os.listdir(os.path.join(root, name))
        if files and all(f"{name}/{f}" in refs for f in files):
            dirs[step] = True
    return dirs


@dataclass(frozen=True)
class TierOpen:
    """A crash state of a local tier, opened with its root: the root as the crash found it
    (another machine's storage: a copy of it) and the run's ``persist_every`` and ``keep``."""

    root: str
    every: int
    keep: int


def _manager(where: str, tier: TierOpen | None, lease_ttl: float, takeover: bool) -> Any:
    if tier is None:
        return AsyncCheckpointManager(where, takeover=takeover, lease_ttl=lease_ttl)
    return AsyncCheckpointManager(
        tier.root,
        local=LocalTier(where, keep=tier.keep),
        persist_every=tier.every,
        takeover=takeover,
        lease_ttl=lease_ttl,
    )


async def open_and_check(
    root: str, expected: Callable[[int], Any], lease_ttl: float, tier: TierOpen | None = None
) -> tuple[set[int], list[str]]:
    """What a fresh manager lists in ``root``, and what is wrong (see the module doc). With
    ``tier``, ``root`` is a local tier's directory, opened with ``tier.root`` as the root: a
    step may be listed from either, and the partials checked are the tier's."""
    problems: list[str] = []
    before = partials(root)
    held = {s for s, c in before.items() if c}
    if tier is not None:
        held |= {s for s, c in partials(tier.root).items() if c}
    try:
        async with _manager(root, tier, lease_ttl, True) as mgr:
            listed = set(await mgr.steps())
            for step in sorted(listed):
                if step not in held:
                    problems.append(f"step {step} is listed without a manifest")
                try:
                    loaded = await mgr.load(step)
                except CheckpointError as e:
                    problems.append(f"step {step} is listed but does not load: {e}")
                    continue
                if not same(loaded, expected(step)):
                    problems.append(f"step {step} loads, but not what was saved")
            after = collectable(root)
            newest = max((s for s, c in after.items() if c), default=-1)
            stale = [s for s, c in after.items() if not c and s < newest]
            if stale:
                problems.append(f"partials {stale} below the newest commit survived the open")
            kept = [s for s, c in after.items() if not c]
            if kept:  # may be saves in flight: collectable once a newer step commits
                newer = max([*after, *listed]) + 1
                await (await mgr.save(newer, expected(newer)))
        if kept:
            async with _manager(root, tier, lease_ttl, False):
                pass
            left = [s for s, c in collectable(root).items() if not c]
            if left:
                problems.append(f"partials {left} survived the open after a newer commit")
    except Exception as e:  # any failure to open or save a crash state is a finding
        problems.append(f"a fresh manager failed on it: {type(e).__name__}: {e}")
        listed = set()
    return listed, problems
