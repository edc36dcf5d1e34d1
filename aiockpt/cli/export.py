"""``aiockpt export``: one checkpoint's tensors, whole, as plain safetensors (see
:mod:`aiockpt._export`)."""

from __future__ import annotations

import argparse
import sys

from .. import _export
from .args import Parser, step_or_latest
from .common import LATEST, UsageError, show_entry
from .output import Progress, human_bytes, plural

#: The line of ``aiockpt --help`` that names the command.
HELP = "write one checkpoint's tensors, whole, as plain safetensors"
#: What ``aiockpt export --help`` says it does.
DESCRIPTION = (
    "Write the tensors of step N (the newest by default; distributed tensors assembled whole) as "
    "a safetensors file OUT; with --max-shard-size, as the directory OUT in the Hugging Face "
    "layout."
)


def add_arguments(p: Parser) -> None:
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
    p.set_defaults(func=run)


#: ``export --dtype``: the dtypes floating tensors may be written in.
EXPORT_DTYPES = {"bf16": "BF16", "fp16": "F16"}


def size_arg(text: str) -> int:
    """A size such as ``5GB``, ``500MB`` or ``10KiB`` (see _export.parse_size)."""
    try:
        return _export.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
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
    for name, others in done.tied.items():
        verb = "is" if len(others) == 1 else "are"
        print(f"tied: {', '.join(others)} {verb} {name} (written once, as {name})")
    return 0
