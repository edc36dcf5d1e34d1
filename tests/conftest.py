from __future__ import annotations

import pytest
from _support.leaks import no_leaks  # noqa: F401 - an autouse fixture: pytest finds it here


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "run")
