from __future__ import annotations

import os

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


@pytest.fixture
def test_storages(monkeypatch) -> None:
    """Serve the test storages of ``_support.storages`` for this test alone: ``fulldisk://``
    (a disk that fills up on cue), ``gated://`` (a writer paused mid-shard on cue) and
    ``vanishing://`` (a step deleted while it is read). The daemon imports them from the
    tests folder."""
    from _support.storages import open_full_disk, open_gated, open_vanishing

    from aiockpt.storage import register_storage
    from aiockpt.storage._registry import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "")
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    )
    register_storage("fulldisk", open_full_disk)
    register_storage("gated", open_gated)
    register_storage("vanishing", open_vanishing)
