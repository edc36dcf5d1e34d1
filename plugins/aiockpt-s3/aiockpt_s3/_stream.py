"""S3 writes from an iterator (a save staged in windows): parts cut as the pieces come."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiockpt.storage.parts import InFlight, cut_parts

if TYPE_CHECKING:
    from ._storage import S3Storage


def write_stream(self: S3Storage, path: str, pieces: Iterable[memoryview]) -> None:
    """Write pieces that come from an iterator, each taken before the next is asked for:
    they are copied into parts, each sent as it fills, at most ``concurrency`` at once
    (so this holds at most that many parts). Parts double in size every 1,000, so S3's
    10,000 parts reach past 5 TiB; an object under ``multipart_threshold`` is one PUT."""
    key = self._key(path)
    self._run("write", path, self._uploads.flush_aborts)
    parts = cut_parts(pieces, self.options.part_size, double_every=1000)
    head: list[bytes] = []  # parts held until the object is known to need an upload
    for part in parts:
        head.append(part)
        if sum(map(len, head)) >= self.options.multipart_threshold:
            break
    else:
        self._run("write", path, self._create, key, b"".join(head))
        return
    upload_id = self._run("write", path, self._uploads.create, key)
    sending = InFlight(self.fs.loop, self.options.concurrency)
    total = 0
    try:
        for number, part in enumerate(itertools.chain(head, parts), start=1):
            total += len(part)
            head = []
            if not sending.submit(self._uploads.part(key, upload_id, number, part)):
                break  # a part failed: _result raises its error
        done = self._result(sending.results, path)
        self._run("write", path, self._uploads.complete, key, upload_id, done, total)
    except BaseException:
        sending.cancel()
        with contextlib.suppress(Exception):
            self._run("abort upload of", path, self._uploads.abort, key, upload_id)
        raise
