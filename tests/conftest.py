from __future__ import annotations

import pytest
from _support.leaks import no_leaks  # noqa: F401 - an autouse fixture: pytest finds it here


@pytest.fixture
def anyio_backend() -> str:
    """The tests marked ``anyio`` run on asyncio, the loop aiockpt uses."""
    return "asyncio"


@pytest.fixture
def root(tmp_path) -> str:
    """A checkpoint root that does not exist yet."""
    return str(tmp_path / "run")
