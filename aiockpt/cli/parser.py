"""The command line parsed and run: the top-level parser, the commands' parsers, ``main``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import CheckpointError
from . import copy, export, ls, prune, show, verify
from .args import Parser, storage_option
from .common import Failure, UsageError

#: The commands, in the order ``aiockpt --help`` lists them: each module's ``HELP``,
#: ``DESCRIPTION``, ``add_arguments`` and ``run``.
COMMANDS = {
    "ls": ls,
    "show": show,
    "verify": verify,
    "export": export,
    "copy": copy,
    "prune": prune,
}


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
    for name, command in COMMANDS.items():
        command.add_arguments(
            sub.add_parser(
                name, parents=[common], help=command.HELP, description=command.DESCRIPTION
            )
        )
    return parser, dict(sub.choices)


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
