"""Pausing the cyclic garbage collector around work that builds many acyclic containers."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: a 20k-tensor manifest decodes into ~100k fresh containers, and the
    collector kept re-scanning them (as long as the parse itself, and a long full pass at
    any point of a load). Nothing built here is cyclic.

    The GC switch is process-wide: whichever caller paused it first turns it back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def no_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with the cyclic GC paused (see gc_paused)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper
