"""The argument parser's pieces every command uses: one-line usage errors, and the types of
steps, counts, durations and storage options."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn

from .common import LATEST, UsageError


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


def add_step(p: Parser, *, required: bool, latest: bool = False) -> None:
    """A step given as STEP or as --step N (as export takes it), one of them; with ``latest``,
    either may be ``latest``."""
    kind = step_or_latest if latest else step_arg
    what = f"the step{f', or {LATEST} for the newest committed one' if latest else ''}"
    p.add_argument("step", metavar="STEP", type=kind, nargs="?", help=what)
    p.add_argument("--step", dest="step_option", metavar="N", type=kind, help=what)
    p.set_defaults(step_required=required)
