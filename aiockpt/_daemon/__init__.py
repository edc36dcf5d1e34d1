"""The daemon side: code that runs only in the checkpoint daemon process.

It never imports torch nor the trainer side (``aiockpt._trainer``): for the daemon, tensors are
byte ranges of a shared-memory slab. ``main`` is what the spawned interpreter runs.
"""

from __future__ import annotations

from .server import main

__all__ = ["main"]
