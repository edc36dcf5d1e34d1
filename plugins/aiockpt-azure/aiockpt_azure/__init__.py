"""Azure Blob Storage for aiockpt, registered for ``az://``, ``abfs://`` and ``abfss://``."""

from __future__ import annotations

from ._storage import AzureOptions, AzureStorage, open_azure

__all__ = ["AzureOptions", "AzureStorage", "open_azure"]
