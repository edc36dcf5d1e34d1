"""The S3 plugin against a real S3 server (moto's server mode on 127.0.0.1)."""

from __future__ import annotations

import errno
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from _s3server import (
    CutReply,
    DropReply,
    ErrorReply,
    S3Server,
    is_complete_upload,
    is_put_object,
    is_upload_part,
)

import aiockpt_s3
from aiockpt import AsyncCheckpointManager
from aiockpt.errors import LeaseLostError, RootLockedError, StorageError
from aiockpt.retention import LatestN
from aiockpt.storage import open_storage
from aiockpt.storage.testing import Relay, StorageContract

MiB = 1024 * 1024
# Small parts so a few MiB make a multipart upload; fast retries so failures are quick.
FAST = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "backoff": 0.02, "retries": 2}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.new_bucket()


def _uploads(s3: S3Server, bucket: str) -> list[dict[str, Any]]:
    return s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


class TestS3Contract(StorageContract):
    """A root under a prefix of the bucket."""

    large_size = 11 * MiB + 123  # three parts of 5 MiB
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, s3: S3Server, bucket: str):
        return lambda: open_storage(f"s3://{bucket}/run", s3.options(**FAST))


class TestS3BucketRoot(StorageContract):
    """A root at the bucket itself: no prefix."""

    large_size = 6 * MiB
    writes_in_order = True

    @pytest.fixture
    def storage_factory(self, s3: S3Server, bucket: str):
        return lambda: open_storage(f"s3a://{bucket}", s3.options(**FAST))


# ------------------------------------------------------------------- the plugin


def test_s3_opens_the_plugin(s3: S3Server, bucket: str) -> None:
    storage = open_storage(f"s3://{bucket}/a/b", s3.options())
    try:
        assert isinstance(storage, aiockpt_s3.S3Storage)
        assert (storage.bucket, storage.prefix) == (bucket, "a/b")
        assert storage.options == aiockpt_s3.S3Options()  # sensible defaults
    finally:
        storage.close()


def test_bad_options_are_refused(s3: S3Server) -> None:
    with pytest.raises(ValueError, match="part_size"):
        open_storage("s3://b/x", s3.options(part_size=1024))
    with pytest.raises(ValueError, match="concurrency"):
        open_storage("s3://b/x", s3.options(concurrency=0))
    with pytest.raises(ValueError, match="read_part_size"):
        open_storage("s3://b/x", s3.options(read_part_size=1024))
    with pytest.raises(ValueError, match="read_concurrency"):
        open_storage("s3://b/x", s3.options(read_concurrency=0))
    with pytest.raises(ValueError, match="checksum"):
        open_storage("s3://b/x", s3.options(checksum="md5"))
    with pytest.raises(ValueError, match="no bucket"):
        open_storage("s3:///x", s3.options())


class _Recorder:
    """Sees every request the server gets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.active = 0
        self.peak = 0
        self.release = threading.Event()

    def __call__(self, environ: dict[str, Any]) -> None:
        headers = {
            k[5:].lower().replace("_", "-"): v for k, v in environ.items() if k[:5] == "HTTP_"
        }
        with self.lock:
            self.requests.append(
                (environ["REQUEST_METHOD"], environ.get("QUERY_STRING", ""), headers)
            )
        if is_upload_part(environ):
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            # hold each part until several are in flight at once (or a little while passed)
            self.release.wait(timeout=2)
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.release.clear()

    def parts(self) -> list[dict[str, str]]:
        return [h for m, q, h in self.requests if m == "PUT" and "partNumber=" in q]


def test_parts_go_up_concurrently_with_crc32c(s3: S3Server, bucket: str) -> None:
    rec = _Recorder()

    def hook(environ: dict[str, Any]) -> None:
        rec(environ)
        with rec.lock:
            if rec.active >= 3:
                rec.release.set()

    s3.on_request = hook
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST, concurrency=3))
    try:
        data = bytearray(range(256)) * (64 * 1024)  # 16 MiB: four parts of 5 MiB
        rec.requests.clear()
        storage.write_file("shard.bin", [memoryview(data)])
    finally:
        s3.on_request = None
        storage.close()
    parts = rec.parts()
    assert len(parts) == 4
    assert rec.peak == 3  # the configured concurrency, reached and not exceeded
    assert all("x-amz-checksum-crc32c" in h for h in parts)
    obj = s3.client().get_object(Bucket=bucket, Key="run/shard.bin")["Body"].read()
    assert obj == data
    assert _uploads(s3, bucket) == []


def _ranged_get(environ: dict[str, Any]) -> str | None:
    """The Range header of a GET of an object, if it is one."""
    if environ["REQUEST_METHOD"] != "GET" or environ.get("QUERY_STRING"):
        return None
    return environ.get("HTTP_RANGE")


def test_reads_are_concurrent_ranged_gets(s3: S3Server, bucket: str) -> None:
    """A large read: equal parts of at most read_part_size, read_concurrency in flight."""
    data = bytes(range(256)) * (40 * 1024)  # 10 MiB: four parts of 2.5 MiB
    storage = open_storage(
        f"s3://{bucket}/run", s3.options(**FAST, read_part_size=3 * MiB, read_concurrency=3)
    )
    lock = threading.Lock()
    ranges: list[str] = []
    seen = {"active": 0, "peak": 0}
    all_in = threading.Event()

    def hook(environ: dict[str, Any]) -> None:
        rng = _ranged_get(environ)
        if rng is None:
            return
        with lock:
            ranges.append(rng)
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
            if seen["active"] == 3:
                all_in.set()
        all_in.wait(timeout=10)  # hold each GET until three are in flight
        with lock:
            seen["active"] -= 1

    try:
        storage.write_file("shard.bin", [memoryview(data)])
        s3.on_request = hook
        buf = bytearray(len(data) - 100)
        storage.readinto("shard.bin", 100, memoryview(buf))
    finally:
        s3.on_request = None
        storage.close()
    assert bytes(buf) == data[100:]
    size = len(data) - 100
    assert sorted(ranges, key=lambda r: int(r[6:].split("-")[0])) == [
        f"bytes={100 + size * i // 4}-{100 + size * (i + 1) // 4 - 1}" for i in range(4)
    ]
    assert seen["peak"] == 3


def test_small_files_are_single_puts(s3: S3Server, bucket: str) -> None:
    rec = _Recorder()
    s3.on_request = rec
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    try:
        storage.write_file("small.bin", [memoryview(b"a" * 1000), memoryview(b"b" * 24)])
        storage.put_atomic("manifest.json", b"{}")
    finally:
        s3.on_request = None
        storage.close()
    puts = [(q, h) for m, q, h in rec.requests if m in ("PUT", "POST")]
    assert len(puts) == 2
    assert all(q == "" for q, _ in puts)  # no ?uploads, no ?partNumber
    assert all("x-amz-checksum-crc32c" in h for _, h in puts)


def test_checksum_can_be_turned_off(s3: S3Server, bucket: str) -> None:
    rec = _Recorder()
    s3.on_request = rec
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST, checksum=None))
    try:
        storage.write_file("f.bin", [memoryview(b"x" * (6 * MiB))])
        assert storage.read_range("f.bin", 0, 3) == b"xxx"
    finally:
        s3.on_request = None
        storage.close()
    assert not any("x-amz-checksum-crc32c" in h for _, _, h in rec.requests)


def test_missing_bucket_is_named(s3: S3Server) -> None:
    storage = open_storage("s3://no-such-bucket-here/run", s3.options(**FAST))
    try:
        for call in (
            lambda: storage.list_dir(""),
            lambda: storage.exists("step/manifest.json"),
            lambda: storage.size("x"),
            lambda: storage.write_file("x", [memoryview(b"x")]),
            lambda: storage.write_file("big", [memoryview(bytearray(6 * MiB))]),
        ):
            with pytest.raises(StorageError) as info:
                call()
            assert "the bucket 'no-such-bucket-here' does not exist" in str(info.value)
            assert info.value.errno == errno.ENOENT
    finally:
        storage.close()


def test_throttling_and_5xx_are_retried(s3: S3Server, bucket: str) -> None:
    failures = {"left": 4}
    lock = threading.Lock()

    def hook(environ: dict[str, Any]) -> None:
        with lock:
            if is_upload_part(environ) and failures["left"] > 0:
                failures["left"] -= 1
                raise ErrorReply(503 if failures["left"] % 2 else 500)

    s3.on_request = hook
    storage = open_storage(f"s3://{bucket}/run", s3.options(**{**FAST, "retries": 4}))
    try:
        data = bytes(range(256)) * (48 * 1024)  # 12 MiB, three parts
        storage.write_file("retried.bin", [memoryview(data)])
        assert storage.read_range("retried.bin", 0, len(data)) == data
    finally:
        s3.on_request = None
        storage.close()
    assert failures["left"] == 0


def test_retries_are_bounded_and_the_upload_aborted(s3: S3Server, bucket: str) -> None:
    def hook(environ: dict[str, Any]) -> None:
        if is_upload_part(environ):
            raise ErrorReply(503, code="SlowDown")

    s3.on_request = hook
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    try:
        buf = bytearray(12 * MiB)
        view = memoryview(buf)
        with pytest.raises(StorageError) as info:
            storage.write_file("step_1/shard.bin", [view])
        view.release()
        buf.append(0)  # no view of the buffer outlives the failed write
    finally:
        s3.on_request = None
        storage.close()
    assert "s3://" + bucket + "/run/step_1/shard.bin" in str(info.value)
    assert "after 3 attempts" in str(info.value)
    assert _uploads(s3, bucket) == []


# ------------------------------------------------------------------- writes create


def _conditional(environ: dict[str, Any]) -> bool:
    return environ.get("HTTP_IF_NONE_MATCH") == "*"


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_a_write_onto_an_object_is_refused_once_and_aborted(
    s3: S3Server, bucket: str, size: int
) -> None:
    """The create is conditional (PutObject, or CompleteMultipartUpload, with
    ``If-None-Match: *``); S3's 412 is EEXIST at once, not retried, and a multipart upload
    refused so is aborted."""
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    sent: list[str] = []

    def hook(environ: dict[str, Any]) -> None:
        if is_put_object(environ) or is_complete_upload(environ):
            sent.append("conditional" if _conditional(environ) else "plain")

    try:
        storage.write_file("step_1/shard.bin", [memoryview(b"first")])
        assert sent == []  # the hook is not set yet
        s3.on_request = hook
        with pytest.raises(StorageError) as info:
            storage.write_file("step_1/shard.bin", [memoryview(bytes(size))])
    finally:
        s3.on_request = None
        storage.close()
    assert info.value.errno == errno.EEXIST
    assert f"s3://{bucket}/run/step_1/shard.bin" in str(info.value)
    assert sent == ["conditional"]  # one request, never retried
    assert _uploads(s3, bucket) == []
    body = s3.client().get_object(Bucket=bucket, Key="run/step_1/shard.bin")["Body"].read()
    assert body == b"first"


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_a_create_whose_answer_was_lost_is_still_its_own(
    s3: S3Server, bucket: str, size: int
) -> None:
    """The server makes the object and the answer is lost: the retry meets the object (412
    from PutObject; moto completes an upload again without one) and knows it for its own by
    its ETag, rather than failing with EEXIST."""
    dropped: list[str] = []

    def hook(environ: dict[str, Any]) -> None:
        if (is_put_object(environ) or is_complete_upload(environ)) and not dropped:
            dropped.append(environ["REQUEST_METHOD"])
            raise DropReply

    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    s3.on_request = hook
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    try:
        storage.write_file("step_1/shard.bin", [memoryview(data)])
        assert storage.read_range("step_1/shard.bin", 0, len(data)) == data
    finally:
        s3.on_request = None
        storage.close()
    assert dropped == (["PUT"] if size < 5 * MiB else ["POST"])


def test_a_create_retried_onto_another_object_is_refused(s3: S3Server, bucket: str) -> None:
    """A retried PutObject that meets 412 and an object of other bytes (another writer's,
    between the lost answer and the retry) is EEXIST: never taken for its own."""
    key = "run/step_1/shard.bin"
    dropped: list[bool] = []

    def hook(environ: dict[str, Any]) -> None:
        if is_put_object(environ) and _conditional(environ) and not dropped:
            dropped.append(True)
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            s3.client().put_object(Bucket=bucket, Key=key, Body=b"another writer's")
            raise ErrorReply(503, code="SlowDown")

    s3.on_request = hook
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    try:
        with pytest.raises(StorageError) as info:
            storage.write_file("step_1/shard.bin", [memoryview(b"mine")])
    finally:
        s3.on_request = None
        storage.close()
    assert info.value.errno == errno.EEXIST
    assert s3.client().get_object(Bucket=bucket, Key=key)["Body"].read() == b"another writer's"


def test_a_stream_stops_at_its_first_failed_part(s3: S3Server, bucket: str) -> None:
    """Every part refused: the write fails once a part has spent its retries, without cutting
    and sending the rest of the pieces (each would spend its own retries first)."""
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))
    asked: list[int] = []

    def pieces() -> Iterator[memoryview]:
        buf = memoryview(bytes(5 * MiB))
        for i in range(40):
            asked.append(i)
            yield buf

    def refuse_parts(environ: dict[str, Any]) -> None:
        if is_upload_part(environ):
            raise ErrorReply(503, "SlowDown")

    s3.on_request = refuse_parts
    try:
        with pytest.raises(StorageError, match="after 3 attempts"):
            storage.write_file("step_1/shard.bin", pieces())  # type: ignore[arg-type]
    finally:
        s3.on_request = None
        storage.close()
    assert len(asked) <= storage.options.concurrency + 3  # in flight, and taken meanwhile
    assert _uploads(s3, bucket) == []


def test_a_stream_that_fails_part_way_aborts_its_upload(s3: S3Server, bucket: str) -> None:
    """Pieces from an iterator (a save staged in windows): the upload starts with the first
    full part; when the pieces stop with an error, the upload is aborted, no object made."""
    storage = open_storage(f"s3://{bucket}/run", s3.options(**FAST))

    def pieces() -> Iterator[memoryview]:
        for _ in range(3):
            yield memoryview(bytes(4 * MiB))
        raise RuntimeError("the trainer went away")

    try:
        with pytest.raises(RuntimeError, match="went away"):
            storage.write_file("step_1/shard.bin", pieces())  # type: ignore[arg-type]
        assert not storage.exists("step_1/shard.bin")
    finally:
        storage.close()
    assert _uploads(s3, bucket) == []


@pytest.mark.anyio
async def test_a_save_staged_in_windows_on_s3(s3: S3Server, bucket: str) -> None:
    """staging_memory below the shard's size: the shard goes up as a multipart upload fed
    window by window, and loads back exactly."""
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(50_000, generator=g) for i in range(120)}  # 23 MiB
    async with AsyncCheckpointManager(
        f"s3://{bucket}/run", storage_options=s3.options(**FAST), staging_memory=8 * MiB
    ) as mgr:
        await (await mgr.save(1, state))
        assert mgr._pool.peak <= 8 * MiB
        loaded = await mgr.load(1)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert _uploads(s3, bucket) == []


class _FlakyRanges:
    """Fails the first try of every other ranged GET of a shard, alternately with a 500 and
    with a reply cut halfway (the connection dropped); records every ranged GET."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets: list[str] = []
        self.failed: dict[str, str] = {}  # range: "500" or "cut"
        self._seen = 0

    def __call__(self, environ: dict[str, Any]) -> None:
        rng = _ranged_get(environ)
        if rng is None or not environ.get("PATH_INFO", "").endswith(".safetensors"):
            return
        last = rng.rpartition("-")[2]
        with self.lock:
            self.gets.append(rng)
            if any(r.endswith(f"-{last}") for r in self.failed):
                return  # a retry
            self._seen += 1
            if self._seen % 2:
                return
            how = self.failed[rng] = "500" if self._seen % 4 else "cut"
        if how == "500":
            raise ErrorReply(500)
        first, last = (int(x) for x in rng[6:].split("-"))
        raise CutReply(keep=(last - first + 1) // 2)


@pytest.mark.anyio
async def test_a_load_survives_failed_range_requests(s3: S3Server, bucket: str) -> None:
    """Ranged GETs that fail once (a 500, or a reply cut short by a dropped connection) are
    retried part by part: the load through the manager is bit-exact, and the server saw each
    failed range again (a cut one from where it stopped)."""
    options = s3.options(**FAST, read_part_size=MiB, read_concurrency=4)
    state = _state(3 * MiB, 7)  # 12 MiB of floats: twelve ranged GETs
    flaky = _FlakyRanges()
    async with AsyncCheckpointManager(f"s3://{bucket}/run", storage_options=options) as mgr:
        await (await mgr.save(1, state))
        s3.on_request = flaky
        try:
            loaded = await mgr.load(1)
        finally:
            s3.on_request = None
    assert torch.equal(loaded["w"], state["w"])
    assert torch.equal(loaded["b"], state["b"])
    assert list(flaky.failed.values()).count("500") >= 2
    assert list(flaky.failed.values()).count("cut") >= 2
    spans = [tuple(int(x) for x in r[6:].split("-")) for r in flaky.gets]
    firsts = sorted({last: first for first, last in sorted(spans, reverse=True)}.items())
    # the first tries tile the shard's tensor bytes, in parts of at most 1 MiB
    assert all(a[0] + 1 == b[1] for a, b in itertools.pairwise(firsts))
    assert all(last - first < MiB for last, first in firsts)
    assert sum(last - first + 1 for last, first in firsts) >= 12 * MiB
    for rng, how in flaky.failed.items():
        first, last = spans[flaky.gets.index(rng)]
        again = [s for s in spans if s[1] == last][1:]
        assert len(again) == 1, (rng, flaky.gets)  # one retry of the part
        if how == "500":
            assert again[0][0] == first  # the whole part again
        else:  # the rest of it: from at most where the cut came
            assert first <= again[0][0] <= first + (last - first + 1) // 2
    assert len(flaky.gets) == len(firsts) + len(flaky.failed)


# ------------------------------------------------------------------- the manager on S3


def _state(n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7), "step_info": {"lr": 0.1}}


@pytest.mark.anyio
async def test_manager_save_load_retention_on_s3(s3: S3Server, bucket: str) -> None:
    options = s3.options(**FAST)
    async with AsyncCheckpointManager(
        f"s3://{bucket}/run", storage_options=options, retention=LatestN(2)
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, _state(2 * MiB, step)))  # 8 MiB: multipart
        assert await mgr.steps() == [2, 3]
        loaded = await mgr.load(3)
        expected = _state(2 * MiB, 3)
        assert torch.equal(loaded["w"], expected["w"])
        assert torch.equal(loaded["b"], expected["b"])
        assert loaded["step_info"] == {"lr": 0.1}
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert {k.split("/")[1] for k in keys} == {
        "_lease",
        "_peer.key",
        "_root.json",
        "step_000000000002",
        "step_000000000003",
    }
    assert _uploads(s3, bucket) == []


@pytest.mark.anyio
async def test_one_writer_per_s3_root(s3: S3Server, bucket: str) -> None:
    """The lease on S3: a second manager is refused naming the first; with takeover it goes on,
    and the first's next save fails with LeaseLostError and commits nothing."""
    url, options = f"s3://{bucket}/run", s3.options(**FAST)
    async with AsyncCheckpointManager(url, storage_options=options) as first:
        await (await first.save(1, _state(1024, 1)))
        with pytest.raises(RootLockedError, match="is leased by this process") as info:
            async with AsyncCheckpointManager(url, storage_options=options):
                pass
        assert info.value.holder is not None
        assert info.value.holder["generation"] == 1
        async with AsyncCheckpointManager(url, storage_options=options, takeover=True) as second:
            with pytest.raises(LeaseLostError):
                await (await first.save(2, _state(1024, 2)))
            await (await second.save(3, _state(1024, 3)))
            assert await second.steps() == [1, 3]
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert not [k for k in keys if k.startswith("run/step_000000000002")]
    assert {k for k in keys if k.startswith("run/_lease/")} == {
        "run/_lease/g000000000001.json",
        "run/_lease/g000000000002.json",
    }


@pytest.mark.anyio
async def test_manager_on_a_missing_bucket_fails_clearly(s3: S3Server) -> None:
    mgr = AsyncCheckpointManager(
        "s3://no-such-bucket-at-all/run", storage_options=s3.options(**FAST)
    )
    with pytest.raises(Exception) as info:  # noqa: PT011 - at open or at the first save
        async with mgr:
            await (await mgr.save(1, _state(10, 1)))
    assert "the bucket 'no-such-bucket-at-all' does not exist" in str(info.value)


@pytest.mark.anyio
async def test_server_down_in_the_middle_of_a_multipart_upload(s3: S3Server, bucket: str) -> None:
    gate = Relay(s3.port)
    seen = {"parts": 0}
    lock = threading.Lock()

    def hook(environ: dict[str, Any]) -> None:
        if is_upload_part(environ):
            with lock:
                seen["parts"] += 1
                if seen["parts"] == 2:  # the second part of the first save: the server stops
                    gate.down()

    options = s3.options(gate.endpoint, **{**FAST, "concurrency": 1})
    try:
        async with AsyncCheckpointManager(f"s3://{bucket}/run", storage_options=options) as mgr:
            s3.on_request = hook
            handle = await mgr.save(1, _state(4 * MiB, 1))  # 16 MiB, four parts
            with pytest.raises(StorageError) as info:
                await handle
            s3.on_request = None
            # the shard, whatever the save's unique part of its name
            assert "step_000000000001/shard_r00000" in str(info.value)
            assert ".safetensors" in str(info.value)
            assert "after 3 attempts" in str(info.value)
            # nothing committed; the part that got through is still held by the server
            client = s3.client()
            keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
            assert not any(k.endswith("manifest.json") for k in keys)
            assert len(_uploads(s3, bucket)) == 1
            gate.up()
            # the next save, once the server is back, aborts what could not be aborted
            await (await mgr.save(2, _state(4 * MiB, 2)))
            assert _uploads(s3, bucket) == []
            assert await mgr.steps() == [2]
    finally:
        s3.on_request = None
        gate.down()


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
async def test_a_fenced_writers_late_upload_changes_nothing_committed(
    s3: S3Server, bucket: str
) -> None:
    """A writer fenced off by a takeover, its upload completing late: it lands under a key of
    its own, so the new holder's committed step stays as it committed it."""
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
