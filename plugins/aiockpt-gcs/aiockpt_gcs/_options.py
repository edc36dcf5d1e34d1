"""The plugin's own storage options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiockpt.storage.objects import check_int, check_seconds, split_options

MiB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class GCSOptions:
    """The plugin's own ``storage_options``; every other key goes to ``gcsfs.GCSFileSystem``."""

    #: Bytes per ranged GET when a read is split; ``concurrency`` of them run at once.
    part_size: int = 16 * MiB
    #: Ranged GETs in flight per read, and objects deleted at once by a recursive delete.
    concurrency: int = 8
    #: Retries of one request after a transient error (429, 408, 5xx, connection errors).
    retries: int = 5
    #: First backoff in seconds; doubles each retry, jittered, capped at ``max_backoff``.
    backoff: float = 0.2
    max_backoff: float = 10.0
    #: Seconds to connect, and to wait for the next bytes of an answer.
    connect_timeout: float = 30.0
    read_timeout: float = 120.0
    #: "crc32c": every upload carries the CRC32C of its bytes, which GCS checks before it
    #: creates the object. None: no checksum sent.
    checksum: str | None = "crc32c"

    def __post_init__(self) -> None:
        check_int("part_size", self.part_size, 256 * 1024, 1024 * MiB)
        check_int("concurrency", self.concurrency, 1, 1024)
        check_int("retries", self.retries, 0, 100)
        for name in ("backoff", "max_backoff", "connect_timeout", "read_timeout"):
            check_seconds(name, getattr(self, name))
        if self.checksum not in ("crc32c", None):
            raise ValueError(
                f"storage option 'checksum' must be 'crc32c' or None, got {self.checksum!r}"
            )

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[GCSOptions, dict[str, Any]]:
        """This plugin's options out of ``options``, and the rest (for gcsfs)."""
        return split_options(cls, options)
