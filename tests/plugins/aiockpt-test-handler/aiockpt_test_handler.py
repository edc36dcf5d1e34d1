"""An aiockpt event-handler plugin for the test suite.

The entry point names :func:`make_handler`, a zero-argument factory that aiockpt calls once per
manager. The handler appends each event as a JSON line to the file named by the environment
variable ``AIOCKPT_TEST_HANDLER_PATH`` when the manager opened, and does nothing without it (so
that it stays inert in every other test of the suite).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "AIOCKPT_TEST_HANDLER_PATH"


class Recorder:
    """Appends ``event.to_json()`` lines to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, event: Any) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(event.to_json() + "\n")


def _ignore(event: Any) -> None:
    """The handler when no file is named."""


def make_handler() -> Any:
    path = os.environ.get(ENV)
    return Recorder(path) if path else _ignore
