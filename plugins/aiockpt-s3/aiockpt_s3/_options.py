"""The plugin's own storage options, and the limits S3 puts on multipart uploads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiockpt.storage.objects import check_int, check_seconds, split_options

MiB = 1024 * 1024
MIN_PART = 5 * MiB  # S3's minimum for every part but the last
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000
MIN_READ_PART = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """The plugin's own ``storage_options``; every other key goes to ``s3fs.S3FileSystem``."""

    #: Bytes per multipart part (S3: 5 MiB to 5 GiB). Raised when a file would need more
    #: than 10,000 parts.
    part_size: int = 16 * MiB
    #: Files of at least this many bytes go up as multipart uploads, smaller ones in one PUT.
    multipart_threshold: int = 16 * MiB
    #: Parts uploaded at once, per file.
    concurrency: int = 8
    #: Bytes per ranged GET of a read (a load): a read of more is split into parts of this
    #: size, fetched concurrently straight into the caller's buffer, each retried on its own.
    read_part_size: int = 8 * MiB
    #: Ranged GETs in flight at once, per read.
    read_concurrency: int = 8
    #: Retries of one request after a transient error (throttling, 5xx, connection errors).
    retries: int = 5
    #: First backoff in seconds; doubles each retry, jittered, capped at ``max_backoff``.
    backoff: float = 0.2
    max_backoff: float = 10.0
    #: "crc32c": send each part's and object's CRC32C as S3's additional checksum, so the
    #: server verifies what it stores. None: send none, for servers that do not take
    #: additional checksums (bodies are never SHA-256 signed either).
    checksum: str | None = "crc32c"

    def __post_init__(self) -> None:
        check_int("part_size", self.part_size, MIN_PART, MAX_PART)
        check_int("multipart_threshold", self.multipart_threshold, 1)
        check_int("concurrency", self.concurrency, 1, 1024)
        check_int("read_part_size", self.read_part_size, MIN_READ_PART, MAX_PART)
        check_int("read_concurrency", self.read_concurrency, 1, 1024)
        check_int("retries", self.retries, 0, 100)
        for name in ("backoff", "max_backoff"):
            check_seconds(name, getattr(self, name))
        if self.checksum not in ("crc32c", None):
            raise ValueError(
                f"storage option 'checksum' must be 'crc32c' or None, got {self.checksum!r}"
            )

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[S3Options, dict[str, Any]]:
        """This plugin's options out of ``options``, and the rest (for s3fs)."""
        return split_options(cls, options)
