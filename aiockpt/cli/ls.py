"""``aiockpt ls``: the committed checkpoints of a root, as a table or JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from .._core import format as fmt
from .args import Parser
from .common import Root, UsageError, no_checkpoints, open_root, scan
from .output import format_metrics, format_time, human_bytes, plural, table

#: The line of ``aiockpt --help`` that names the command.
HELP = "list committed checkpoints"
#: What ``aiockpt ls --help`` says it does.
DESCRIPTION = None


def add_arguments(p: Parser) -> None:
    """The arguments of ``ls``."""
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
