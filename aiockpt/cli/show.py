"""``aiockpt show``: one checkpoint's tensors and values, summarised, in full or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .._core import format as fmt
from .._core.tree import plain_values
from .args import Parser, add_step
from .common import Entry, Root, show_entry
from .output import format_metrics, format_time, human_bytes, plural, table

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


#: The line of ``aiockpt --help`` that names the command.
HELP = "tensors and values of one checkpoint"
#: What ``aiockpt show --help`` says it does.
DESCRIPTION = (
    "Show one checkpoint (STEP, or latest for the newest): a summary of its tensors and "
    f"values (the first {SUMMARY_ROWS} tensors of each table, each value cut to "
    f"{SUMMARY_CHARS} characters), all of them with --all, or one JSON object with --json."
)


def add_arguments(p: Parser) -> None:
    """The arguments of ``show``."""
    add_step(p, required=True, latest=True)
    p.add_argument("--all", action="store_true", help="every tensor and every value in full")
    p.add_argument("--json", action="store_true", help="the whole checkpoint as one JSON object")
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
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
