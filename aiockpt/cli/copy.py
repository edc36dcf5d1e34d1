"""``aiockpt copy``: one checkpoint, self-contained, into another root (see
:mod:`aiockpt._copy`)."""

from __future__ import annotations

import argparse
import sys

from .. import _copy
from .args import Parser, step_or_latest, storage_option
from .common import LATEST, open_root, show_entry
from .output import Progress, human_bytes

#: The line of ``aiockpt --help`` that names the command.
HELP = "copy one checkpoint to another root, self-contained"
#: What ``aiockpt copy --help`` says it does.
DESCRIPTION = (
    "Copy step STEP of ROOT to the root DEST (any URL) as a self-contained checkpoint: every "
    "byte it refers to in earlier steps is copied into its own shards, every checksum checked "
    "on the way."
)


def add_arguments(p: Parser) -> None:
    """The arguments of ``copy``."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
