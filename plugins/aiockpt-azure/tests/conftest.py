"""Fixtures of the Azure plugin's tests, under the same leak check as aiockpt's own tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The leak check lives with aiockpt's tests; this directory may be tested on its own.
_AIOCKPT_TESTS = str(Path(__file__).resolve().parents[3] / "tests")
if _AIOCKPT_TESTS not in sys.path:
    sys.path.append(_AIOCKPT_TESTS)

from _support.leaks import no_leaks  # noqa: E402, F401 - an autouse fixture: pytest finds it here


@pytest.fixture
def anyio_backend() -> str:
    """The tests marked ``anyio`` run on asyncio, the loop aiockpt uses."""
    return "asyncio"
