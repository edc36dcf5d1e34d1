"""aiockpt's S3 storage against boto3's upload_file: the same shard, the same local S3 server.

Starts moto's S3 server in its own process on 127.0.0.1, then uploads one shard (default
256 MiB) several times with each client and prints the median times and their ratio
(aiockpt ÷ boto3; the target is ≤ 1.0). boto3 runs with its default TransferConfig (8 MiB
parts, 10 threads); aiockpt with its defaults unless --part-size/--concurrency are given.

    python benchmarks/s3_bench.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

MiB = 1024 * 1024
KEY = SECRET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="shard size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-size", type=int, default=None, help="aiockpt part size in MiB")
    ap.add_argument("--concurrency", type=int, default=None, help="aiockpt parts in flight")
    args = ap.parse_args()

    import boto3
    from boto3.s3.transfer import TransferConfig

    from aiockpt.storage import open_storage

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = start_server(port)
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="bench")
        data = bytearray(os.urandom(args.mib * MiB))
        options: dict = {
            "endpoint_url": endpoint,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        if args.part_size:
            options["part_size"] = args.part_size * MiB
        if args.concurrency:
            options["concurrency"] = args.concurrency
        storage = open_storage("s3://bench/aiockpt", options)
        times: dict[str, list[float]] = {"aiockpt": [], "boto3": []}
        with tempfile.NamedTemporaryFile(
            dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ) as f:
            f.write(data)
            f.flush()
            for i in range(args.repeat):
                t0 = time.perf_counter()
                storage.write_file(f"shard_{i}.safetensors", [memoryview(data)])
                times["aiockpt"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.upload_file(f.name, "bench", f"boto3/shard_{i}", Config=TransferConfig())
                times["boto3"].append(time.perf_counter() - t0)
        for i in range(args.repeat):  # same bytes arrived both ways
            a = client.head_object(Bucket="bench", Key=f"aiockpt/shard_{i}.safetensors")
            b = client.head_object(Bucket="bench", Key=f"boto3/shard_{i}")
            assert a["ContentLength"] == b["ContentLength"] == len(data)
        storage.close()
    finally:
        server.terminate()
        server.wait(timeout=30)

    opts = storage.options
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"shard {args.mib} MiB, {args.repeat} runs each, median; moto server on 127.0.0.1")
    print(
        f"aiockpt: part {opts.part_size // MiB} MiB × {opts.concurrency} in flight, "
        f"checksum {opts.checksum}; boto3: TransferConfig() defaults"
    )
    print(f"{'client':<10}{'median s':>10}{'MiB/s':>10}   all runs (s)")
    for name, ts in times.items():
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{name:<10}{med[name]:>10.2f}{args.mib / med[name]:>10.0f}   {runs}")
    print(f"ratio aiockpt/boto3: {med['aiockpt'] / med['boto3']:.2f} (target ≤ 1.0)")


if __name__ == "__main__":
    main()
