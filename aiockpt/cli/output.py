"""How the commands write: sizes, times and values as text, aligned tables, a progress bar."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, TextIO


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
