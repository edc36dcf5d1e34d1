"""Retries of one request on transient errors: bounded in number, with jittered backoff."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ._errors import GaveUp, is_transient

log = logging.getLogger("aiockpt")
T = TypeVar("T")


class Retrier:
    """Runs a request again after a transient error, at most ``retries`` more times.

    The n-th retry waits ``backoff * 2**n`` seconds capped at ``max_backoff``, jittered;
    ``where`` names a key in the log lines.
    """

    def __init__(
        self, retries: int, backoff: float, max_backoff: float, where: Callable[[str], str]
    ) -> None:
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._where = where

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0 for the first)."""
        cap = min(self.max_backoff, self.backoff * (2**attempt))
        return cap / 2 + random.uniform(0, cap / 2)  # equal jitter: spread the retries out

    async def run(self, op: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` with retries on transient errors; raises GaveUp at the end."""
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as e:
                if attempt >= self.retries or not is_transient(e):
                    raise GaveUp(op, key, e, attempt + 1) from e
                log.debug("%s %s: %s; retry %d", op, self._where(key), e, attempt + 1)
            await asyncio.sleep(self.delay(attempt))
            attempt += 1
