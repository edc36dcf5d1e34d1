"""aiockpt: an asyncio-native checkpoint manager for PyTorch with pluggable storage.

Names are imported lazily (PEP 562), so the daemon and the CLI, which run as ``aiockpt.*``
modules, never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncCheckpointManager": "._trainer.manager",
    "CheckpointManager": "._trainer.sync",
    "SyncSaveHandle": "._trainer.sync",
    "CheckpointInfo": "._core.protocol",
    "SaveHandle": "._trainer.ledger",
    "AnyOf": ".retention",
    "BestN": ".retention",
    "EveryNSeconds": ".retention",
    "EveryNSteps": ".retention",
    "LatestN": ".retention",
    "LocalTier": ".tiers",
    "Event": ".events",
    "JsonLinesHandler": ".events",
    "ScopeTracker": ".events",
    "CheckpointError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "CorruptCheckpointError": ".errors",
    "DaemonDiedError": ".errors",
    "LeaseLostError": ".errors",
    "RootLockedError": ".errors",
    "StorageError": ".errors",
    "UnsupportedValueError": ".errors",
    "load_safetensors": "._trainer.hfload",
}

__all__ = [
    "AnyOf",
    "AsyncCheckpointManager",
    "BestN",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DaemonDiedError",
    "Event",
    "EveryNSeconds",
    "EveryNSteps",
    "JsonLinesHandler",
    "LatestN",
    "LeaseLostError",
    "LocalTier",
    "RootLockedError",
    "SaveHandle",
    "ScopeTracker",
    "StorageError",
    "SyncSaveHandle",
    "UnsupportedValueError",
    "load_safetensors",
]

if TYPE_CHECKING:
    from ._core.protocol import CheckpointInfo
    from ._trainer.hfload import load_safetensors
    from ._trainer.ledger import SaveHandle
    from ._trainer.manager import AsyncCheckpointManager
    from ._trainer.sync import CheckpointManager, SyncSaveHandle
    from .errors import (
        CheckpointError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        DaemonDiedError,
        LeaseLostError,
        RootLockedError,
        StorageError,
        UnsupportedValueError,
    )
    from .events import Event, JsonLinesHandler, ScopeTracker
    from .retention import AnyOf, BestN, EveryNSeconds, EveryNSteps, LatestN
    from .tiers import LocalTier


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiockpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
