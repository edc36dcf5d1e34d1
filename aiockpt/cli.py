"""The ``aiockpt`` command: list, inspect, verify, prune and export a checkpoint root.

``aiockpt ls ROOT [--json]``, ``aiockpt show ROOT STEP|latest [--all] [--json]``, ``aiockpt
verify ROOT [STEP] [--json]``, ``aiockpt prune ROOT [--keep-…] [--yes]`` and ``aiockpt export
ROOT OUT --step N`` (whole tensors as plain safetensors, see :mod:`aiockpt._export`); ``aiockpt
--version``. ROOT is a local path or any URL the storage registry serves. Exit codes: 0 done
(and intact), 1 corruption found or the storage failed, 2 a mistake in the command line, a root
that does not exist or (except for ``ls``) one without checkpoints. It imports neither torch
nor the manager: manifests are read (and validated as untrusted) and bytes checked through the
storage layer the daemon uses, so it starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from . import __version__, _copy, _export
from ._core import format as fmt
from ._core.catalog import Catalog
from ._core.lease import GONE, Claimant, read_current, supersedes
from ._core.tree import plain_values
from .errors import CheckpointError, StorageError
from .retention import (
    AnyOf,
    BestN,
    CheckpointRecord,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
    RetentionPolicy,
    collectable_partials,
    select_deletions,
)
from .storage import open_storage
from .storage._registry import PLUGIN_HINTS, registered_protocols, split_protocol

__all__ = ["main"]

#: The step argument that names the newest committed step.
LATEST = "latest"
#: ``export --dtype``: the dtypes floating tensors may be written in.
EXPORT_DTYPES = {"bf16": "BF16", "fp16": "F16"}


class UsageError(Exception):
    """A mistake of the user's: reported in one line on stderr, exit code 2."""


class Failure(Exception):
    """The storage failed (an outage, missing credentials) or a checkpoint is unreadable:
    reported in one line on stderr, exit code 1."""


# --------------------------------------------------------------------------- reading a root


@dataclass(slots=True)
class Entry:
    """A committed step directory: its manifest, or why it could not be read."""

    step: int
    manifest: fmt.Manifest | None = None
    error: str | None = None

    @property
    def dirname(self) -> str:
        """The step directory's name."""
        return fmt.step_dirname(self.step)


@dataclass(slots=True)
class Root:
    """What a scan found in a root, named by ``url`` as the user gave it."""

    catalog: Catalog
    url: str
    committed: list[Entry]
    partials: list[int]

    def where(self, path: str = "") -> str:
        """The URL of ``path`` under the root as the user named it (the root when empty)."""
        base = self.url.rstrip("/")
        return f"{base}/{path}" if path else base


def open_root(url: str, options: dict[str, Any]) -> Catalog:
    """The catalog of the root at ``url``; a root that cannot be opened is a usage error."""
    try:
        return Catalog(open_storage(url, options))
    except CheckpointError as e:
        if served(url):  # the storage failed, or found no credentials
            raise Failure(f"cannot open {url}: {e}") from None
        raise UsageError(f"cannot open {url}: {e}") from None  # no storage for the URL
    except (ValueError, TypeError, ImportError) as e:
        raise UsageError(f"cannot open {url}: {e}") from None


def served(url: str) -> bool:
    """Whether a storage serves ``url``'s protocol: local paths, a registered storage or an
    installed plugin, and fsspec's protocols but those that need an aiockpt plugin."""
    protocol = split_protocol(url)[0]
    if protocol == "file" or protocol in registered_protocols():
        return True
    import fsspec

    return protocol not in PLUGIN_HINTS and protocol in fsspec.available_protocols()


def scan(
    catalog: Catalog, url: str, *, steps: Sequence[int] | None = None, heads: bool = False
) -> Root:
    """The step directories of a root; manifests are read for ``steps`` (all when None),
    only their heads with ``heads`` (a listing: see Catalog.read_head)."""
    try:
        listed = catalog.listed_steps()
    except CheckpointError as e:
        if isinstance(e, StorageError) and e.errno == errno.ENOTDIR:  # a file, not a root
            raise UsageError(f"cannot list {url}: {e}") from None
        raise Failure(f"cannot list {url}: {e}") from None
    committed: list[Entry] = []
    partials: list[int] = []
    for step in listed:
        if not catalog.is_committed(step):
            partials.append(step)
            continue
        entry = Entry(step)
        if steps is None or step in steps:
            read_entry(catalog, entry, head=heads)
        committed.append(entry)
    return Root(catalog, url, committed, partials)


def read_entry(catalog: Catalog, entry: Entry, *, head: bool = False) -> None:
    """Read the entry's manifest (its head alone with ``head``), or why it cannot be read."""
    try:
        entry.manifest = (
            catalog.read_head(entry.step) if head else catalog.read_manifest(entry.step)
        )
    except CheckpointError as e:  # corrupt, or gone since it was listed
        entry.error = str(e)


def no_checkpoints(root: Root) -> str:
    """The line that says a root holds no committed checkpoint (and how many partials)."""
    extra = f" ({plural(len(root.partials), 'partial step dir')})" if root.partials else ""
    return f"no checkpoints in {root.url}{extra}"


def require_checkpoints(root: Root) -> None:
    """A usage error unless the root holds a committed checkpoint."""
    if not root.committed:
        raise UsageError(no_checkpoints(root))


def require_step(root: Root, step: int) -> Entry:
    """The entry of ``step``; a usage error, naming what is committed, when it is not."""
    for entry in root.committed:
        if entry.step == step:
            return entry
    steps = [e.step for e in root.committed]
    shown = ", ".join(map(str, steps[-10:]))
    partial = " (its directory is a partial save)" if step in root.partials else ""
    raise UsageError(
        f"step {step} is not a committed checkpoint in {root.url}{partial}; committed: "
        f"{shown if len(steps) <= 10 else '…, ' + shown}"
    )


# --------------------------------------------------------------------------- formatting


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 MiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(n: int, word: str) -> str:
    """``n word``, with an s when ``n`` is not 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_time(t: float) -> str:
    """Seconds since the epoch as local date and time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def format_value(v: Any) -> str:
    """A metric or value for a table: floats short, strings bare, the rest as JSON."""
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v


def format_metrics(metrics: dict[str, Any]) -> str:
    """``key=value`` pairs, sorted by key."""
    return " ".join(f"{k}={format_value(v)}" for k, v in sorted(metrics.items()))


def table(rows: list[list[str]], out: TextIO, *, right: Sequence[int] = ()) -> None:
    """Rows as aligned columns; the first row is the header; ``right`` columns align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.write("  ".join(cells).rstrip() + "\n")


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = stream.isatty()
        self.done = 0
        self.last = 0.0
        self.width = 0

    def advance(self, n: int, label: str) -> None:
        """Count ``n`` more bytes done and redraw, at most ten times a second."""
        self.done += n
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and self.done < self.total):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        line = (
            f"{label} [{bar:<30}] {frac * 100:3.0f}% "
            f"{human_bytes(self.done)}/{human_bytes(self.total)}"
        )
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def close(self) -> None:
        """Erase the bar, leaving the line for what comes next."""
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    """``aiockpt ls``: the committed checkpoints, as a table or JSON lines."""
    root = scan(open_root(args.root, args.storage_options), args.root, heads=True)
    if not root.committed:
        # A root that is not there is most likely a typo; an empty one is a fresh run.
        if not root.partials and not root.catalog.storage.exists(""):
            raise UsageError(f"{root.url} does not exist")
        print(no_checkpoints(root), file=sys.stderr)
        return 0
    out: TextIO = sys.stdout
    if args.json:
        for e in root.committed:
            m = e.manifest
            record: dict[str, Any] = {"step": e.step, "url": root.where(e.dirname)}
            if m is None:
                record["error"] = e.error
            else:
                record.update(
                    created_at=m.created_at,
                    nbytes=m.nbytes,
                    written_nbytes=m.stored_nbytes,
                    referenced_nbytes=m.referenced_nbytes,
                    metrics=m.metrics,
                )
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return 0
    rows = [["STEP", "COMMITTED", "SIZE", "WRITTEN", "REFERENCED", "METRICS"]]
    for e in root.committed:
        m = e.manifest
        if m is None:
            unreadable = "unreadable manifest (aiockpt verify says why)"
            rows.append([str(e.step), "?", "?", "?", "?", unreadable])
        else:
            rows.append(
                [
                    str(e.step),
                    format_time(m.created_at),
                    human_bytes(m.nbytes),
                    human_bytes(m.stored_nbytes),
                    human_bytes(m.referenced_nbytes),
                    format_metrics(m.metrics),
                ]
            )
    table(rows, out, right=(0, 2, 3, 4))
    print(ls_note(root), file=sys.stderr)
    return 0


def ls_note(root: Root) -> str:
    """What ``ls`` says below its table: the sizes, and the step directories it did not list
    (retired ones, kept for the bytes later steps read from them, and partial saves)."""
    manifests = [e.manifest for e in root.committed if e.manifest is not None]
    total = sum(m.nbytes for m in manifests)
    written = sum(m.stored_nbytes for m in manifests)
    note = f"{plural(len(root.committed), 'checkpoint')}, {human_bytes(total)}"
    if written != total:
        note += f" ({human_bytes(written)} written by them)"
    refs = {path.split("/", 1)[0] for m in manifests for path in m.referenced_files()}
    retired = [s for s in root.partials if fmt.step_dirname(s) in refs]
    partials = [s for s in root.partials if s not in retired]
    if retired:
        note += (
            f"; {plural(len(retired), 'retired step dir')} kept for the bytes later steps "
            f"read from them ({', '.join(map(str, retired))})"
        )
    if partials:
        note += (
            f"; {plural(len(partials), 'partial step dir')} not listed "
            f"({', '.join(map(str, partials))}; aiockpt prune removes them)"
        )
    return note


#: Without ``--all``, ``show`` lists this many rows of each table ...
SUMMARY_ROWS = 20
#: ... and this many characters of each value (``--json`` is always complete).
SUMMARY_CHARS = 80


@dataclass(slots=True)
class RankView:
    """What ``show`` says of one rank: its shard, its plain tensors by name (sorted), its plain
    values by key path, and how many chunks of distributed tensors its shard holds besides."""

    shard: fmt.ShardRecord
    tensors: dict[str, fmt.TensorRecord]
    values: list[tuple[str, str]]
    chunks: int


def show_entry(args: argparse.Namespace) -> tuple[Root, Entry]:
    """The root and the entry a command of one step (``show``, ``export``, ``copy``, and
    ``verify`` of one) asks for, its manifest read (``latest``: the newest committed step)."""
    catalog = open_root(args.root, args.storage_options)
    if args.step != LATEST:
        root = scan(catalog, args.root, steps=[args.step])
        require_checkpoints(root)
        return root, require_step(root, args.step)
    root = scan(catalog, args.root, steps=[])  # one manifest is read, once the newest is known
    require_checkpoints(root)
    entry = root.committed[-1]
    read_entry(catalog, entry)
    return root, entry


def rank_views(root: Root, entry: Entry, m: fmt.Manifest) -> list[RankView]:
    """Each rank's view, in rank order, its tree checked against its shard's tensors."""
    views = []
    for shard in sorted(m.shards, key=lambda s: s.rank):
        tree = m.trees[shard.rank]
        fmt.check_tree(
            tree,
            set(m.tensors[shard.file]),
            path=root.where(f"{entry.dirname}/{fmt.MANIFEST}"),
            dtensor_names=set(m.dtensors),
        )
        # The shard's chunks of distributed tensors are in the distributed tensors' table.
        tensors = {
            name: r
            for name, r in sorted(m.tensors[shard.file].items())
            if name not in m.dtensors and name != fmt.PAD_NAME
        }
        chunks = sum(c.shard == shard.file for d in m.dtensors.values() for c in d.chunks)
        views.append(RankView(shard, tensors, list(plain_values(tree)), chunks))
    return views


def cmd_show(args: argparse.Namespace) -> int:
    """``aiockpt show``: one checkpoint's tensors and values, summarised, in full (``--all``),
    or as one JSON object (``--json``)."""
    root, entry = show_entry(args)
    m = entry.manifest
    if m is None:
        print(f"aiockpt: {entry.error}", file=sys.stderr)
        return 1
    views = rank_views(root, entry, m)
    out = sys.stdout
    if args.json:
        record = show_record(root.where(entry.dirname), m, views)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        return 0
    out.write(
        f"step {m.step}  committed {format_time(m.created_at)}  {human_bytes(m.nbytes)}  "
        f"world size {m.world_size}\n"
    )
    out.write(f"url       {root.where(entry.dirname)}\n")
    refs = m.referenced_files()
    if refs:
        steps = sorted({int(path[5:17]) for path in refs})
        out.write(
            f"stored    {human_bytes(m.stored_nbytes)} written by this step, "
            f"{human_bytes(m.referenced_nbytes)} read from {plural(len(refs), 'file')} of "
            f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}\n"
        )
    if m.metrics:
        out.write(f"metrics   {format_metrics(m.metrics)}\n")
    if m.metadata:
        out.write(f"metadata  {json.dumps(m.metadata, ensure_ascii=False, sort_keys=True)}\n")
    if m.dtensors:
        show_dtensors(m, out, full=args.all)
    for view in views:
        show_rank(view, m.world_size, out, full=args.all)
    return 0


def show_record(url: str, m: fmt.Manifest, views: Sequence[RankView]) -> dict[str, Any]:
    """The whole of ``show`` as one JSON object (its keys are documented in docs/cli.md)."""
    return {
        "step": m.step,
        "created_at": m.created_at,
        "world_size": m.world_size,
        "nbytes": m.nbytes,
        "written_nbytes": m.stored_nbytes,
        "referenced_nbytes": m.referenced_nbytes,
        "referenced_files": sorted(m.referenced_files()),
        "url": url,
        "metrics": m.metrics,
        "metadata": m.metadata,
        "tensors": {
            str(v.shard.rank): {
                name: {"dtype": r.dtype, "shape": list(r.shape), "nbytes": r.end - r.start}
                for name, r in v.tensors.items()
            }
            for v in views
        },
        "dtensors": {
            name: {
                "dtype": d.dtype,
                "shape": list(d.shape),
                "placements": list(d.placements),
                "mesh": list(d.mesh),
                "chunks": len(d.chunks),
                "nbytes": d.nbytes,
            }
            for name, d in sorted(m.dtensors.items())
        },
        "values": {str(v.shard.rank): dict(v.values) for v in views},
    }


def head(rows: list[list[str]], *, full: bool) -> tuple[list[list[str]], int]:
    """The rows a table shows, and how many it leaves out (none with ``full``)."""
    if full or len(rows) <= SUMMARY_ROWS:
        return rows, 0
    return rows[:SUMMARY_ROWS], len(rows) - SUMMARY_ROWS


def clip(text: str, *, full: bool) -> str:
    """``text``, cut to SUMMARY_CHARS characters (the last one an ellipsis) unless ``full``."""
    if full or len(text) <= SUMMARY_CHARS:
        return text
    return text[: SUMMARY_CHARS - 1] + "…"


def more_line(left_out: int, out: TextIO) -> None:
    """The line that says how many rows a summarised table left out."""
    if left_out:
        out.write(f"… and {left_out} more (--all lists them all)\n")


def dtype_bytes(tensors: Iterable[fmt.TensorRecord]) -> str:
    """``8.2 KiB in 3 tensors: F32 8.1 KiB (2), I64 80 B (1)``: the tensors' bytes in all
    and by dtype (most bytes first), with how many tensors of each."""
    by_dtype: dict[str, list[int]] = {}
    for r in tensors:
        tally = by_dtype.setdefault(r.dtype, [0, 0])  # bytes, tensors
        tally[0] += r.end - r.start
        tally[1] += 1
    total = sum(nbytes for nbytes, _ in by_dtype.values())
    count = sum(n for _, n in by_dtype.values())
    parts = sorted(by_dtype.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return f"{human_bytes(total)} in {plural(count, 'tensor')}: " + ", ".join(
        f"{dtype} {human_bytes(nbytes)} ({n})" for dtype, (nbytes, n) in parts
    )


def show_rank(view: RankView, world_size: int, out: TextIO, *, full: bool) -> None:
    """One rank's tables of plain tensors and plain values. Summarised (unless ``full``):
    the bytes by dtype, the first SUMMARY_ROWS tensors, and every value cut short."""
    label = "" if world_size == 1 else f"rank {view.shard.rank}: "
    extra = f", and {plural(view.chunks, 'chunk')} of distributed tensors" if view.chunks else ""
    out.write(
        f"\n{label}tensors ({len(view.tensors)}, {human_bytes(view.shard.nbytes)} in "
        f"{view.shard.file}{extra})\n"
    )
    if view.tensors:
        if not full:
            out.write(f"bytes     {dtype_bytes(view.tensors.values())}\n")
        rows = [
            [n, r.dtype, str(list(r.shape)), str(r.end - r.start)] for n, r in view.tensors.items()
        ]
        rows, left_out = head(rows, full=full)
        table([["KEY", "DTYPE", "SHAPE", "BYTES"], *rows], out, right=(3,))
        more_line(left_out, out)
    if view.values:
        out.write(f"\n{label}values\n")
        table([["KEY", "VALUE"], *([k, clip(v, full=full)] for k, v in view.values)], out)


def show_dtensors(m: fmt.Manifest, out: TextIO, *, full: bool) -> None:
    """The table of a checkpoint's distributed tensors: global dtype and shape, how they were
    placed on which mesh, and how many chunks hold them (the first SUMMARY_ROWS unless
    ``full``)."""
    total = sum(d.nbytes for d in m.dtensors.values())
    out.write(f"\ndistributed tensors ({len(m.dtensors)}, {human_bytes(total)})\n")
    rows = [
        [
            name,
            d.dtype,
            str(list(d.shape)),
            f"[{', '.join(d.placements)}]",
            str(list(d.mesh)),
            str(len(d.chunks)),
            str(d.nbytes),
        ]
        for name, d in sorted(m.dtensors.items())
    ]
    rows, left_out = head(rows, full=full)
    header = ["KEY", "DTYPE", "SHAPE", "PLACEMENTS", "MESH", "CHUNKS", "BYTES"]
    table([header, *rows], out, right=(5, 6))
    more_line(left_out, out)


def entry_problems(root: Root, e: Entry, progress: Progress) -> list[str]:
    """What is wrong with one committed step: its manifest, or every byte of its shards."""
    if e.manifest is None:
        return [f"{e.dirname}/{fmt.MANIFEST}: {e.error}"]
    problems: list[str] = []
    advance = functools.partial(progress.advance, label=f"step {e.step}")
    for shard in e.manifest.shards:
        problems += _export.verify_shard(root.catalog, e.manifest, shard, advance)
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    """``aiockpt verify``: re-read every shard and check every checksum; 1 when any fails."""
    if args.step is None:
        root = scan(open_root(args.root, args.storage_options), args.root)
        require_checkpoints(root)
        entries = root.committed
    else:
        root, entry = show_entry(args)
        entries = [entry]
    total = sum(e.manifest.nbytes for e in entries if e.manifest is not None)
    progress = Progress(total, sys.stderr)
    bad = 0
    try:
        for e in entries:
            problems = entry_problems(root, e, progress)
            progress.close()
            bad += bool(problems)
            if args.json:
                record = {"step": e.step, "ok": not problems, "problems": problems}
                print(json.dumps(record, ensure_ascii=False), flush=True)
            elif problems:
                print(f"step {e.step}: CORRUPT")
                for p in problems:
                    print(f"  {p}")
            else:
                size = human_bytes(e.manifest.nbytes) if e.manifest else ""
                print(f"step {e.step}: ok ({size})")
    finally:
        progress.close()
    n = len(entries)
    if bad:
        print(f"{bad} of {plural(n, 'checkpoint')} corrupt", file=sys.stderr)
        return 1
    print(f"{'all ' if n > 1 else ''}{plural(n, 'checkpoint')} intact", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``aiockpt export``: one step's tensors, whole, as plain safetensors (see _export)."""
    root, entry = show_entry(args)
    if entry.manifest is None:
        print(f"aiockpt: {entry.error}", file=sys.stderr)
        return 1
    progress = Progress(entry.manifest.nbytes, sys.stderr)

    def advance(n: int, total: int) -> None:
        progress.total = max(total, 1)  # what is written, not the whole checkpoint
        progress.advance(n, f"export step {entry.step}")

    try:
        done = _export.export(
            root.catalog,
            entry.manifest,
            args.out,
            prefix=args.prefix,
            max_shard_size=args.max_shard_size,
            progress=advance,
            dtype=EXPORT_DTYPES[args.dtype] if args.dtype else None,
        )
    except _export.ExportError as e:
        raise UsageError(str(e)) from None
    finally:
        progress.close()
    files = f" in {plural(len(done.files), 'file')}" if done.index else ""
    print(
        f"wrote {plural(done.tensors, 'tensor')} ({human_bytes(done.nbytes)}){files} to {args.out}"
    )
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    """``aiockpt copy``: one checkpoint, self-contained (no block refers to another step), into
    another root (see _copy)."""
    root, entry = show_entry(args)
    if entry.manifest is None:
        print(f"aiockpt: {entry.error}", file=sys.stderr)
        return 1
    dest = open_root(args.dest, dict(args.dest_options))
    progress = Progress(entry.manifest.nbytes, sys.stderr)
    try:
        nbytes = _copy.copy_step(
            root.catalog, entry.manifest, dest, lambda n: progress.advance(n, "copy")
        )
    finally:
        progress.close()
    print(f"copied step {entry.step} ({human_bytes(nbytes)}) to {args.dest}")
    return 0


def keep_policy(args: argparse.Namespace) -> RetentionPolicy | None:
    """The policy of prune's ``--keep`` options: any of them keeps; None without any."""
    parts: list[RetentionPolicy] = []
    if args.keep_last is not None:
        parts.append(LatestN(args.keep_last))
    if args.keep_every is not None:
        parts.append(EveryNSteps(args.keep_every))
    if args.keep_every_seconds is not None:
        parts.append(EveryNSeconds(args.keep_every_seconds))
    parts.extend(args.keep_best)
    return AnyOf(*parts) if parts else None


def require_metrics(best: Sequence[BestN], records: Sequence[CheckpointRecord]) -> None:
    """A --keep-best metric that no checkpoint has is a mistake (a typo would otherwise plan
    to delete all but the newest checkpoint). Checkpoints that lack a metric some others have
    are never counted as best by it."""
    present = {name for r in records for name in r.metrics}
    for policy in best:
        if policy.metric not in present:
            there = ", ".join(sorted(present)) or "none"
            raise UsageError(
                f"no checkpoint has the metric {policy.metric!r} of --keep-best "
                f"(metrics there: {there})"
            )


def refuse_if_leased(root: Root) -> None:
    """A usage error while a writer holds the root's lease: its manager may be saving and
    applying its own retention, and deleting under it is how checkpoints get lost."""
    lease = read_current(root.catalog.storage)
    holder = lease.holder(time.time())
    # A holder proven gone (its processes dead, on this host) saves nothing any more.
    if holder is not None and supersedes(Claimant.here(), holder)[0] != GONE:
        raise UsageError(
            f"{root.url} is leased by a running writer ({holder.describe()}); deleting "
            "while it saves can remove what it is writing. Stop it first, or pass --force"
        )


def cmd_prune(args: argparse.Namespace) -> int:
    """``aiockpt prune``: what the policy would delete, and partial saves; deleted with --yes
    (a checkpoint's manifest first, so a deletion cut short never leaves a broken step)."""
    policy = keep_policy(args)
    root = scan(open_root(args.root, args.storage_options), args.root)
    if args.yes and not args.force:
        refuse_if_leased(root)
    if not root.committed and not (args.all_partials and root.partials):
        require_checkpoints(root)
    records = []
    for e in root.committed:
        if e.manifest is None:  # never deleted on a guess; verify says what is wrong
            print(f"keeping step {e.step}: its manifest is unreadable ({e.error})", file=sys.stderr)
        else:
            records.append(CheckpointRecord(e.step, e.manifest.created_at, e.manifest.metrics))
    require_metrics(args.keep_best, records)
    readable = [e for e in root.committed if e.manifest is not None]
    doomed = set(select_deletions(policy, records))
    step_dirs = {e.step: True for e in root.committed} | dict.fromkeys(root.partials, False)
    partials = collectable_partials(step_dirs, everything=args.all_partials)
    spared = sorted(set(root.partials) - set(partials))

    out = sys.stdout
    verb = "deleting" if args.yes else "would delete"
    for e in readable:
        if e.step in doomed:
            m = e.manifest
            assert m is not None
            out.write(
                f"{verb} step {e.step} (committed {format_time(m.created_at)}, "
                f"{human_bytes(m.nbytes)})\n"
            )
            if args.yes:
                root.catalog.delete_step(e.step)
    # Files that the kept steps read from (incremental checkpoints) stay, whatever their
    # directory; None: a kept manifest is unreadable, so no file is known to be unread.
    survivors = [e for e in root.committed if e.step not in doomed]
    kept_refs = (
        None
        if any(e.manifest is None for e in survivors)
        else frozenset(p for e in survivors if e.manifest for p in e.manifest.referenced_files())
    )
    for step in partials:
        dirname = fmt.step_dirname(step)
        held = None if kept_refs is None else [p for p in kept_refs if p.startswith(dirname + "/")]
        if held is None:
            out.write(f"keeping step directory {dirname}: a kept manifest is unreadable\n")
            continue
        if held:
            out.write(
                f"keeping retired step directory {dirname}: kept steps read from "
                f"{plural(len(held), 'file')} of it\n"
            )
        else:
            out.write(f"{verb} partial step directory {dirname}\n")
        if args.yes:
            root.catalog.sweep(step, kept_refs)
    if spared:
        print(
            f"left partial step directories at or above the newest commit (a save may still be "
            f"writing them; --all-partials removes them too): {', '.join(map(str, spared))}",
            file=sys.stderr,
        )
    kept = [e.step for e in root.committed if e.step not in doomed]
    out.write(f"keeping {plural(len(kept), 'checkpoint')}: {', '.join(map(str, kept)) or '-'}\n")
    if not doomed and not partials:
        print("nothing to delete", file=sys.stderr)
    elif not args.yes:
        print("dry run: nothing was deleted; pass --yes to delete", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- arguments


class Parser(argparse.ArgumentParser):
    """argparse with its errors raised as one-line :class:`UsageError` (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        """Raise the error as a :class:`UsageError`."""
        raise UsageError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """An argument that is an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def step_arg(text: str) -> int:
    """A step argument: a non-negative integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a step is a non-negative integer, not {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, not {value}")
    return value


def step_or_latest(text: str) -> int | str:
    """A step argument that may also be ``latest``, the newest committed step."""
    if text == LATEST:
        return LATEST
    try:
        return step_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"a step is a non-negative integer or {LATEST}, not {text!r}"
        ) from None


def positive_seconds(text: str) -> float:
    """An argument that is a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def best_spec(text: str) -> BestN:
    """``METRIC:MODE:N``, e.g. ``loss:min:2`` (the metric name may itself contain colons)."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected METRIC:MODE:N such as loss:min:2, not {text!r}")
    metric, mode, n = parts
    if mode not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"MODE must be min or max, not {mode!r} (in {text!r})")
    return BestN(positive_int(n), metric, mode)  # type: ignore[arg-type]


def size_arg(text: str) -> int:
    """A size such as ``5GB``, ``500MB`` or ``10KiB`` (see _export.parse_size)."""
    try:
        return _export.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def storage_option(text: str) -> tuple[str, Any]:
    """A ``KEY=VALUE`` storage option, VALUE parsed as JSON when it can be."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        value = json.loads(raw)  # numbers, booleans, objects; anything else is a string
    except ValueError:
        value = raw
    return key, value


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser and each command's parser, by name."""
    common = Parser(add_help=False)
    common.add_argument("root", metavar="ROOT", help="checkpoint root: a path or a URL")
    common.add_argument(
        "-o",
        "--storage-option",
        dest="options",
        metavar="KEY=VALUE",
        type=storage_option,
        action="append",
        default=[],
        help="a storage option (VALUE is parsed as JSON when it can be); repeatable",
    )
    parser = Parser(
        prog="aiockpt",
        description="Inspect, verify, export, copy and prune aiockpt checkpoint roots.",
        epilog="Exit codes: 0 ok, 1 corruption or a storage failure, 2 a usage mistake.",
    )
    parser.add_argument("--version", action="version", version=f"aiockpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", parents=[common], help="list committed checkpoints")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=cmd_ls)

    add_show(sub.add_parser("show", parents=[common], help="tensors and values of one checkpoint"))

    p = sub.add_parser("verify", parents=[common], help="re-read and check every checksum")
    add_step(p, required=False, latest=True)
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint checked")
    p.set_defaults(func=cmd_verify)

    add_export(
        sub.add_parser(
            "export",
            parents=[common],
            help="write one checkpoint's tensors, whole, as plain safetensors",
            description="Write the tensors of step N (the newest by default; distributed "
            "tensors assembled whole) as a safetensors file OUT; with --max-shard-size, as the "
            "directory OUT in the Hugging Face layout.",
        )
    )

    p = sub.add_parser(
        "copy",
        parents=[common],
        help="copy one checkpoint to another root, self-contained",
        description="Copy step STEP of ROOT to the root DEST (any URL) as a self-contained "
        "checkpoint: every byte it refers to in earlier steps is copied into its own shards, "
        "every checksum checked on the way.",
    )
    p.add_argument(
        "step", metavar="STEP", type=step_or_latest, help=f"the step to copy, or {LATEST}"
    )
    p.add_argument("dest", metavar="DEST", help="the root to copy into: a path or a URL")
    p.add_argument(
        "--dest-option",
        dest="dest_options",
        metavar="KEY=VALUE",
        type=storage_option,
        action="append",
        default=[],
        help="a storage option of DEST (as -o is of ROOT); repeatable",
    )
    p.set_defaults(func=cmd_copy)

    add_prune(
        sub.add_parser(
            "prune",
            parents=[common],
            help="delete checkpoints a policy does not keep, and partial saves",
            description="Show what a retention policy would delete (kept: any checkpoint one of "
            "the --keep options keeps, and always the newest); delete it with --yes. Without "
            "--keep options every checkpoint is kept and only partial step directories go.",
        )
    )
    return parser, dict(sub.choices)


def add_prune(p: Parser) -> None:
    """The arguments of ``prune``."""
    p.add_argument("--keep-last", metavar="N", type=positive_int, help="keep the N newest")
    p.add_argument("--keep-every", metavar="K", type=positive_int, help="keep steps divisible by K")
    p.add_argument(
        "--keep-every-seconds",
        metavar="S",
        type=positive_seconds,
        help="keep the first checkpoint committed in each S-second window",
    )
    p.add_argument(
        "--keep-best",
        metavar="METRIC:MODE:N",
        type=best_spec,
        action="append",
        default=[],
        help="keep the N best by METRIC, MODE min or max; repeatable",
    )
    p.add_argument(
        "--all-partials",
        action="store_true",
        help="also remove partial step directories at or above the newest commit "
        "(only when no save is running)",
    )
    p.add_argument("--yes", action="store_true", help="delete; without it, only show")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete even while a writer holds the root's lease (it may be saving into it)",
    )
    p.set_defaults(func=cmd_prune)


def add_show(p: Parser) -> None:
    """The arguments of ``show``."""
    p.description = (
        "Show one checkpoint (STEP, or latest for the newest): a summary of its tensors and "
        f"values (the first {SUMMARY_ROWS} tensors of each table, each value cut to "
        f"{SUMMARY_CHARS} characters), all of them with --all, or one JSON object with --json."
    )
    add_step(p, required=True, latest=True)
    p.add_argument("--all", action="store_true", help="every tensor and every value in full")
    p.add_argument("--json", action="store_true", help="the whole checkpoint as one JSON object")
    p.set_defaults(func=cmd_show)


def add_export(p: Parser) -> None:
    """The arguments of ``export``."""
    p.add_argument(
        "out", metavar="OUT", help="the file to write (a directory with --max-shard-size)"
    )
    p.add_argument(
        "--step",
        metavar="N",
        type=step_or_latest,
        default=LATEST,
        help=f"the step to export, or {LATEST} (the default) for the newest committed one",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(EXPORT_DTYPES),
        help="write floating tensors (fp64, fp32, fp16, bf16) in this dtype; integers, "
        "booleans and fp8 as they are",
    )
    p.add_argument(
        "--prefix",
        metavar="P",
        help="only the tensors under key path P (e.g. model), named by the rest of their path",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=size_arg,
        help="OUT is a directory of files of at most SIZE tensor bytes each (5GB, 500MiB)",
    )
    p.set_defaults(func=cmd_export)


def add_step(p: Parser, *, required: bool, latest: bool = False) -> None:
    """A step given as STEP or as --step N (as export takes it), one of them; with ``latest``,
    either may be ``latest``."""
    kind = step_or_latest if latest else step_arg
    what = f"the step{f', or {LATEST} for the newest committed one' if latest else ''}"
    p.add_argument("step", metavar="STEP", type=kind, nargs="?", help=what)
    p.add_argument("--step", dest="step_option", metavar="N", type=kind, help=what)
    p.set_defaults(step_required=required)


def resolve_step(args: argparse.Namespace) -> None:
    """One step from STEP or --step, when the command takes it so."""
    option = getattr(args, "step_option", None)
    if option is not None:
        if args.step is not None and args.step != option:
            raise UsageError(f"two steps given: {args.step} and --step {option}")
        args.step = option
    if getattr(args, "step_required", False) and args.step is None:
        raise UsageError("the following arguments are required: STEP (or --step N)")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed command line."""
    parser, commands = build_parser()
    if argv and argv[0] in commands:
        # Intermixed, so options may come anywhere: `verify ROOT -o k=v STEP` finds STEP.
        # (argparse cannot intermix through subparsers, hence the dispatch by hand.)
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        resolve_step(args)
        return args
    return parser.parse_args(argv)  # help, or an error about the command


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        args = parse(sys.argv[1:] if argv is None else list(argv))
        args.storage_options = dict(args.options)
        return int(args.func(args))
    except UsageError as e:
        print(f"aiockpt: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, Failure) as e:
        if isinstance(e, BrokenPipeError):  # `aiockpt ls ROOT | head`: not an error
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        print(f"aiockpt: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("aiockpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
