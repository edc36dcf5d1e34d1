"""Google Cloud Storage for aiockpt, registered for ``gs://`` and ``gcs://`` by entry point."""

from __future__ import annotations

from ._options import GCSOptions
from ._storage import GCSStorage, open_gcs

__all__ = ["GCSOptions", "GCSStorage", "open_gcs"]
