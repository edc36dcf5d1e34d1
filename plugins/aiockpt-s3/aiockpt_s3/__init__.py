"""S3 storage for aiockpt, registered for ``s3://`` and ``s3a://`` through an entry point."""

from __future__ import annotations

from ._options import S3Options
from ._storage import S3Storage, open_s3

__all__ = ["S3Options", "S3Storage", "open_s3"]
