"""The plugin's own storage options, and the limits S3 puts on multipart uploads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
        def _int(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"storage option {name!r} must be an int, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                raise ValueError(f"storage option {name!r} must be {bound}, got {value}")

        _int("part_size", MIN_PART, MAX_PART)
        _int("multipart_threshold", 1)
        _int("concurrency", 1, 1024)
        _int("read_part_size", MIN_READ_PART, MAX_PART)
        _int("read_concurrency", 1, 1024)
        _int("retries", 0, 100)
        for name in ("backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"storage option {name!r} must be a number >= 0, got {value!r}")
        if self.checksum not in ("crc32c", None):
            raise ValueError(
                f"storage option 'checksum' must be 'crc32c' or None, got {self.checksum!r}"
            )

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[S3Options, dict[str, Any]]:
        """This plugin's options out of ``options``, and the rest (for s3fs)."""
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        return cls(**ours), rest
