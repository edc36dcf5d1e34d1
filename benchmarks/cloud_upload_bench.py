"""The GCS and Azure plugins' uploads against each cloud's own SDK: same bytes, same emulator.

Starts azurite (the Azure plugin's test emulator, from .venv/azurite) and fake-gcs-server (the
GCS plugin's test extra) on 127.0.0.1, then uploads one shard (default 256 MiB) several times
each way and prints the median times and the ratios (plugin ÷ SDK; ≤ 1.0: the plugin is no
slower):

- Azure: ``AzureStorage.write_file`` (16 MiB blocks, 8 at once) against azure-storage-blob's
  ``BlobClient.upload_blob`` with ``max_concurrency`` the plugin's ``concurrency`` (its other
  settings its defaults: 4 MiB blocks);
- GCS: ``GCSStorage.write_file`` (one multipart upload with its CRC32C) against the same
  bytes handed over in 8 MiB pieces from an iterator, as a save staged in windows writes them
  (parts of ``part_size`` uploaded ``concurrency`` at once, then composed), google-cloud-storage's
  ``Blob.upload_from_file`` (a resumable upload in 100 MiB chunks, CRC32C checked) and gcsfs's
  ``pipe`` (a resumable upload in 50 MiB chunks), each where it is installed.

    python benchmarks/cloud_upload_bench.py [--mib 256] [--repeat 3] [--only azure|gcs]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


def _helpers(plugin: str) -> None:
    """The plugins' test helpers start the emulators (their own process groups, on free ports)."""
    path = str(ROOT / "plugins" / plugin / "tests")
    if path not in sys.path:
        sys.path.insert(0, path)


def _timed(fn: Callable[..., object], *args: Any, **kwargs: Any) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def _rounds(
    clients: dict[str, Callable[[str], object]], repeat: int, check: Callable[[], None]
) -> dict[str, list[float]]:
    """Each client uploads ``repeat`` times, one after another in turn (the first to go
    rotating, so none is always the one that finds the emulator cold); ``check`` after each
    round."""
    times: dict[str, list[float]] = {k: [] for k in clients}
    order = list(clients)
    for i in range(repeat):
        for label in order[i % len(order) :] + order[: i % len(order)]:
            times[label].append(_timed(clients[label], f"shard_{i}.safetensors"))
        check()
    return times


def bench_azure(data: bytearray, repeat: int, folder: Path) -> dict[str, list[float]]:
    _helpers("aiockpt-azure")
    from _azserver import AzuriteServer, why_not  # type: ignore[import-not-found]

    from aiockpt_azure import AzureStorage

    if (why := why_not()) is not None:
        print(f"azure: skipped: {why}")
        return {}
    server = AzuriteServer(folder / "azurite")
    try:
        container = server.new_container()
        storage = AzureStorage(f"az://{container}/aiockpt", server.options())
        concurrency = storage.options.concurrency
        whole = bytes(data)  # the SDK takes bytes (a bytearray it reads wrongly)
        with server.client() as service:
            sdk = service.get_container_client(container)

            def check() -> None:  # all of it arrived; then away with it, the disk stays small
                for blob in list(sdk.list_blobs()):
                    assert blob.size == len(data), (blob.name, blob.size)
                    sdk.delete_blob(blob.name)

            try:
                return _rounds(
                    {
                        "aiockpt-azure": lambda n: storage.write_file(n, [memoryview(data)]),
                        "azure-storage-blob": lambda n: sdk.upload_blob(
                            f"sdk/{n}", whole, overwrite=True, max_concurrency=concurrency
                        ),
                    },
                    repeat,
                    check,
                )
            finally:
                storage.close()
    finally:
        server.stop()


def bench_gcs(data: bytearray, repeat: int, folder: Path) -> dict[str, list[float]]:
    _helpers("aiockpt-gcs")
    from _gcsserver import GCSServer  # type: ignore[import-not-found]

    from aiockpt.storage import open_storage

    server = GCSServer(folder / "gcs")
    try:
        bucket = server.new_bucket()
        storage = open_storage(f"gs://{bucket}/aiockpt", server.options())
        root = open_storage(f"gs://{bucket}", server.options())  # to check and clean up

        def streamed(name: str) -> None:  # as a save staged in windows hands the pieces over
            pieces = (memoryview(data)[i : i + 8 * MiB] for i in range(0, len(data), 8 * MiB))
            storage.write_file(name, pieces)  # type: ignore[arg-type]

        clients: dict[str, Callable[[str], object]] = {
            "aiockpt-gcs": lambda n: storage.write_file(n, [memoryview(data)]),
            "aiockpt-gcs streamed": streamed,
        }
        try:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage as gcs_sdk  # type: ignore[import-untyped]

            client = gcs_sdk.Client(
                project="bench",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": server.endpoint},
            )
            sdk_bucket = client.bucket(bucket)
            clients["google-cloud-storage"] = lambda n: sdk_bucket.blob(
                f"sdk/{n}"
            ).upload_from_file(io.BytesIO(data), size=len(data), checksum="crc32c")
        except ImportError:
            print("gcs: google-cloud-storage is not installed: not measured")
        try:
            from gcsfs.core import GCSFileSystem  # not the gRPC-probing extended one

            fs = GCSFileSystem(endpoint_url=server.endpoint, token="anon", skip_instance_cache=True)
            whole = bytes(data)
            clients["gcsfs pipe"] = lambda n: fs.pipe(f"{bucket}/gcsfs/{n}", whole)
        except ImportError:
            print("gcs: gcsfs is not installed: not measured")

        def check() -> None:  # all of it arrived; then away with it, the disk stays small
            for obj in server.names(bucket):
                assert root.size(obj) == len(data), obj
                root.delete(obj)

        try:
            return _rounds(clients, repeat, check)
        finally:
            storage.close()
            root.close()
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="shard size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["azure", "gcs"], default=None)
    args = ap.parse_args()

    data = bytearray(os.urandom(args.mib * MiB))
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="cloud-bench-") as tmp:
        if args.only in (None, "azure"):
            results["azure (azurite)"] = bench_azure(data, args.repeat, Path(tmp))
        if args.only in (None, "gcs"):
            results["gcs (fake-gcs-server)"] = bench_gcs(data, args.repeat, Path(tmp))

    print(f"\nshard {args.mib} MiB, {args.repeat} runs each, median; emulators on 127.0.0.1")
    print(f"{'emulator':<24}{'client':<22}{'median s':>10}{'MiB/s':>8}{'ratio':>8}   runs (s)")
    for emulator, times in results.items():
        if not times:
            continue
        plugin = next(iter(times))
        base = statistics.median(times[plugin])
        for client, ts in times.items():
            med = statistics.median(ts)
            ratio = "" if client == plugin else f"{base / med:.2f}"
            runs = ", ".join(f"{t:.2f}" for t in ts)
            print(
                f"{emulator:<24}{client:<22}{med:>10.2f}{args.mib / med:>8.0f}{ratio:>8}   {runs}"
            )
    print("ratio: the plugin's median ÷ the SDK's (≤ 1.0: the plugin is no slower)")


if __name__ == "__main__":
    main()
