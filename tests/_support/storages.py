"""Storages for tests, registered under protocols of their own (``register_storage``): the
daemon imports their factories by name, so they live in a module it can import."""

from __future__ import annotations

from typing import Any

from aiockpt.storage import LocalStorage


class UnorderedStorage(LocalStorage):
    """A local root that does not declare ``writes_in_order``, as a storage whose upload must
    have every piece at once."""

    writes_in_order = False


def open_unordered(url: str, storage_options: dict[str, Any]) -> UnorderedStorage:
    return UnorderedStorage(url.partition("://")[2])
