"""Fixtures of the Lightning plugin's tests, under the same leak check as aiockpt's own tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aiockpt_lightning import AiockptCheckpointIO

# The leak check lives with aiockpt's tests; this directory may be tested on its own.
_AIOCKPT_TESTS = str(Path(__file__).resolve().parents[3] / "tests")
if _AIOCKPT_TESTS not in sys.path:
    sys.path.append(_AIOCKPT_TESTS)

from _support.leaks import no_leaks  # noqa: E402, F401 - an autouse fixture: pytest finds it here


@pytest.fixture
def plugin() -> Iterator[Callable[..., AiockptCheckpointIO]]:
    """Makes plugins, and tears each down after the test, whatever the test did."""
    made: list[AiockptCheckpointIO] = []

    def make(root: Path, cls: type[AiockptCheckpointIO] = AiockptCheckpointIO) -> Any:
        """A plugin of class ``cls`` on ``root``."""
        made.append(cls(root))
        return made[-1]

    yield make
    for io in made:
        io.teardown()
