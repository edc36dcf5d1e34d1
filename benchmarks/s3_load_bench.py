"""aiockpt's S3 loads against boto3's download_file: the same object, the same local S3 server.

Starts moto's S3 server in its own process on 127.0.0.1, saves one checkpoint (default 256 MiB
in 16 float32 tensors) through ``AsyncCheckpointManager`` on ``s3://``, then, alternating in one
run, times:

- ``aiockpt load()``: ``await mgr.load(step)`` into fresh tensors: the daemon lists the steps,
  reads the manifest, fetches the shard in ranged GETs into shared memory and checks every
  tensor's crc32c; the trainer maps the result.
- ``aiockpt load(into=)``: the same, restored in place into the saved state's tensors.
- ``S3Storage.readinto``: the plugin alone, the shard into a preallocated buffer, no checks.
- ``boto3 download_file``: the shard object to a file in /dev/shm through boto3's
  TransferManager with ``TransferConfig(max_concurrency=C, multipart_chunksize=P)``, the same
  part size and concurrency as aiockpt's ``read_part_size`` / ``read_concurrency``.

It prints the medians and the ratio load ÷ download_file (the target is ≤ 1.0). ``--sweep``
times the plugin's loads over several part sizes and concurrencies instead, each beside
boto3 at the same settings, which is how the defaults were chosen.

    python benchmarks/s3_load_bench.py [--mib 256] [--repeat 5] [--part-size MiB] [--concurrency N]
    python benchmarks/s3_load_bench.py --sweep [8x8,16x4,...] [--mib 256] [--repeat 5]

moto reads the whole object for every ranged GET (and slices it), so on this server each GET
costs time in proportion to the object, not the range: fewer, larger parts win here more than
they would on S3. Both clients pay it alike at the same part size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

MiB = 1024 * 1024
KEY = SECRET = "bench"
BUCKET = "bench"
TENSORS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(port: int) -> None:
    """moto's S3 on 127.0.0.1:``port``, each ranged GET of an object read from the range alone.

    moto itself reads the whole object for a ranged GET and slices it, so every GET costs in
    proportion to the object (256 MiB read, to send 8 MiB): the server, not the client, would
    be what this benchmark measures. This front serves ``GET`` with ``Range: bytes=a-b`` from
    moto's stored object (under its lock, the range only), as S3 costs; everything else is
    moto's.
    """
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.s3.models import s3_backends
    from werkzeug.serving import WSGIRequestHandler, make_server

    app = DomainDispatcherApplication(create_backend_app)

    def ranged(environ: dict[str, Any], start_response: Any) -> Any:
        rng = environ.get("HTTP_RANGE", "")
        if (
            environ["REQUEST_METHOD"] == "GET"
            and rng.startswith("bytes=")
            and not (environ.get("QUERY_STRING"))
        ):
            bucket, _, key_name = environ.get("PATH_INFO", "").lstrip("/").partition("/")
            first, _, last = rng[len("bytes=") :].partition("-")
            try:
                key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key_name)
                lo, hi = int(first), int(last)
            except Exception:
                key = None
            if key is not None and 0 <= lo <= hi < key.size:
                with key.lock:
                    key._value_buffer.seek(lo)
                    body = key._value_buffer.read(hi - lo + 1)
                headers = {**key.response_dict, **key.metadata}
                headers = {
                    k: str(v)
                    for k, v in headers.items()
                    if not k.lower().startswith("x-amz-checksum")
                }
                headers.update(
                    {
                        "content-length": str(len(body)),
                        "content-range": f"bytes {lo}-{hi}/{key.size}",
                        "accept-ranges": "bytes",
                    }
                )
                start_response("206 Partial Content", list(headers.items()))
                return [body]
        return app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log(self, type: str, message: str, *args: Any) -> None:
            pass

    make_server("127.0.0.1", port, ranged, threaded=True, request_handler=Quiet).serve_forever()


def start_server(port: int, plain: bool) -> subprocess.Popen[bytes]:
    if plain:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def storage_options(endpoint: str, part_mib: int | None, concurrency: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "endpoint_url": endpoint,
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    if part_mib:
        options["read_part_size"] = part_mib * MiB
    if concurrency:
        options["read_concurrency"] = concurrency
    return options


class Bench:
    """One saved checkpoint on the server, and the contenders that read it back."""

    def __init__(self, endpoint: str, mib: int) -> None:
        import boto3
        import torch

        self.endpoint = endpoint
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )
        self.client.create_bucket(Bucket=BUCKET)
        numel = mib * MiB // TENSORS // 4
        g = torch.Generator().manual_seed(0)
        self.state = {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(TENSORS)}}
        self.url = f"s3://{BUCKET}/run"
        fd, self.path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.close(fd)

    async def save(self) -> None:
        from aiockpt import AsyncCheckpointManager

        options = storage_options(self.endpoint, None, None)
        async with AsyncCheckpointManager(self.url, storage_options=options) as mgr:
            await (await mgr.save(1, self.state))
        listing = self.client.list_objects_v2(Bucket=BUCKET, Prefix="run/step_")
        (self.key,) = [o["Key"] for o in listing["Contents"] if o["Key"].endswith(".safetensors")]
        self.size = int(self.client.head_object(Bucket=BUCKET, Key=self.key)["ContentLength"])
        self.shard_path = self.key.removeprefix("run/")

    def boto3(self, part_size: int, concurrency: int) -> Callable[[], Any]:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_concurrency=concurrency,
        )

        def run() -> None:
            self.client.download_file(BUCKET, self.key, self.path, Config=config)

        return run

    def check_boto3(self, expected: bytes) -> None:
        with open(self.path, "rb") as f:
            assert f.read() == expected, "boto3 downloaded other bytes"


async def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    if asyncio.iscoroutine(result):
        result = await result
    elapsed = time.perf_counter() - t0
    del result
    return elapsed


async def compare(bench: Bench, part_mib: int | None, concurrency: int | None, repeat: int) -> None:
    """The main table: every contender at one setting, alternating."""
    import torch

    from aiockpt import AsyncCheckpointManager
    from aiockpt.storage import open_storage

    options = storage_options(bench.endpoint, part_mib, concurrency)
    storage = open_storage(bench.url, options)
    opts = storage.options  # type: ignore[attr-defined]
    part_size, conc = opts.read_part_size, opts.read_concurrency
    buf = bytearray(bench.size)
    view = memoryview(buf)
    into = {"model": {k: torch.empty_like(v) for k, v in bench.state["model"].items()}}
    times: dict[str, list[float]] = {
        "aiockpt load()": [],
        "aiockpt load(into=)": [],
        "S3Storage.readinto": [],
        "boto3 download_file": [],
    }
    download = bench.boto3(part_size, conc)
    async with AsyncCheckpointManager(bench.url, storage_options=options, read_only=True) as mgr:
        loaded = await mgr.load(1)  # warm-up: the daemon's client, connections, the slab
        assert all(torch.equal(loaded["model"][k], v) for k, v in bench.state["model"].items())
        del loaded
        download()
        for _ in range(repeat):
            times["aiockpt load()"].append(await timed(lambda: mgr.load(1)))
            times["boto3 download_file"].append(await timed(download))
            times["aiockpt load(into=)"].append(await timed(lambda: mgr.load(1, into=into)))
            times["S3Storage.readinto"].append(
                await timed(lambda: storage.readinto(bench.shard_path, 0, view))
            )
    assert all(torch.equal(into["model"][k], v) for k, v in bench.state["model"].items())
    bench.check_boto3(bytes(buf))
    view.release()
    storage.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    mib = bench.size / MiB
    print(
        f"shard {mib:.0f} MiB ({TENSORS} tensors), moto server on 127.0.0.1, {repeat} runs each, "
        f"alternating; median"
    )
    print(
        f"aiockpt: read_part_size {part_size // MiB} MiB × read_concurrency {conc}; boto3: "
        f"TransferConfig(multipart_chunksize={part_size // MiB} MiB, max_concurrency={conc})"
    )
    print(f"{'contender':<22}{'median s':>10}{'MiB/s':>8}   all runs (s)")
    for name, ts in times.items():
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{name:<22}{med[name]:>10.3f}{mib / med[name]:>8.0f}   {runs}")
    ratio = med["aiockpt load()"] / med["boto3 download_file"]
    ratio_into = med["aiockpt load(into=)"] / med["boto3 download_file"]
    print(f"ratio load() / download_file: {ratio:.2f} (target ≤ 1.0)")
    print(f"ratio load(into=) / download_file: {ratio_into:.2f}")


async def sweep(bench: Bench, settings: list[tuple[int, int]], repeat: int) -> None:
    """aiockpt's load() and boto3 at several part sizes and concurrencies, every setting's
    managers open at once and the runs interleaved, so each setting sees the same machine."""
    from contextlib import AsyncExitStack

    from aiockpt import AsyncCheckpointManager

    async with AsyncExitStack() as stack:
        managers = []
        for part_mib, conc in settings:
            options = storage_options(bench.endpoint, part_mib, conc)
            mgr = await stack.enter_async_context(
                AsyncCheckpointManager(bench.url, storage_options=options, read_only=True)
            )
            await mgr.load(1)
            managers.append(mgr)
        downloads = [bench.boto3(p * MiB, c) for p, c in settings]
        ours: list[list[float]] = [[] for _ in settings]
        theirs: list[list[float]] = [[] for _ in settings]
        for _ in range(repeat):
            for i, (mgr, download) in enumerate(zip(managers, downloads, strict=True)):
                ours[i].append(await timed(lambda mgr=mgr: mgr.load(1)))  # type: ignore[misc]
                theirs[i].append(await timed(download))
    print(f"shard {bench.size / MiB:.0f} MiB, {repeat} runs each, interleaved; median seconds")
    print(f"{'part MiB':>8}{'conc':>6}{'load()':>9}{'boto3':>9}{'ratio':>7}")
    for (part_mib, conc), a_runs, b_runs in zip(settings, ours, theirs, strict=True):
        a, b = statistics.median(a_runs), statistics.median(b_runs)
        print(f"{part_mib:>8}{conc:>6}{a:>9.3f}{b:>9.3f}{a / b:>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--part-size", type=int, default=None, help="read_part_size in MiB")
    ap.add_argument("--concurrency", type=int, default=None, help="read_concurrency")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="8x4,8x8,8x16,16x4,16x8,32x4,32x8,64x4",
        default=None,
        metavar="PxC,...",
        help="load() and boto3 at these settings (part MiB x concurrency), interleaved",
    )
    ap.add_argument(
        "--plain-moto",
        action="store_true",
        help="moto's server as it is (every ranged GET reads the whole object)",
    )
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return

    port = free_port()
    server = start_server(port, args.plain_moto)
    bench = None
    try:
        bench = Bench(f"http://127.0.0.1:{port}", args.mib)
        asyncio.run(bench.save())
        if args.sweep:
            settings = [
                (int(p), int(c)) for p, _, c in (x.partition("x") for x in args.sweep.split(","))
            ]
            asyncio.run(sweep(bench, settings, args.repeat))
        else:
            asyncio.run(compare(bench, args.part_size, args.concurrency, args.repeat))
    finally:
        if bench is not None:
            os.unlink(bench.path)
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
