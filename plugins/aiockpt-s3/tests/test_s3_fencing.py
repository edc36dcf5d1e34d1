"""A writer fenced off by a takeover, on S3: its upload finishing late lands under a key of
its own, so the new holder's committed step stays as it committed it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from _s3server import S3Server

from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LeaseLostError

MiB = 1 << 20
FAST = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "backoff": 0.02, "retries": 2}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


class HoldCompletion:
    """Holds the first CompleteMultipartUpload of a step 2 shard until released: the writer
    is paused between its last part and the completion, as a stopped process would be."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self._held = False
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any]) -> None:
        path, query = environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        completing = environ["REQUEST_METHOD"] == "POST" and "uploadId" in query
        if not completing or "/step_000000000002/shard_r" not in path:
            return
        with self._lock:
            if self._held:
                return
            self._held = True
        self.reached.set()
        self.release.wait(60)


@pytest.mark.anyio
async def test_a_fenced_writers_late_upload_changes_nothing_committed(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    url, options = f"s3://{bucket}/run", s3.options(**FAST)
    hold = HoldCompletion()
    s3.on_request = hold
    try:
        async with AsyncCheckpointManager(url, storage_options=options) as first:
            late = await first.save(2, {"w": torch.full((3 * MiB,), 1.0)})  # 12 MiB: multipart
            await anyio.to_thread.run_sync(hold.reached.wait, 60)
            # The second writer takes the root over and commits step 2 meanwhile.
            async with AsyncCheckpointManager(url, storage_options=options, takeover=True) as mgr:
                await (await mgr.save(2, {"w": torch.full((3 * MiB,), 2.0)}))
                hold.release.set()  # the first writer's upload completes now
                with pytest.raises(LeaseLostError):
                    await late
                got = await mgr.load(2)
                assert torch.equal(got["w"], torch.full((3 * MiB,), 2.0))
    finally:
        hold.release.set()
        s3.on_request = None
