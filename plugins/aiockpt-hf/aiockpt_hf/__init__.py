"""Checkpoint and resume a Hugging Face ``transformers`` Trainer through aiockpt."""

from __future__ import annotations

from ._callback import AiockptCallback

__all__ = ["AiockptCallback"]
