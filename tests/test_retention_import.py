"""A retention policy of the user's own, from a module the trainer imports from beside its
script (a folder on the trainer's ``sys.path`` that the daemon's working directory is not):
the daemon imports it from the trainer's ``sys.path``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt.errors import DaemonStartError

pytestmark = pytest.mark.anyio

POLICY = textwrap.dedent(
    """
    from dataclasses import dataclass


    @dataclass(frozen=True)
    class KeepOdd:
        def keep(self, checkpoints):
            return [c.step % 2 == 1 for c in checkpoints]
    """
)


@pytest.fixture
def beside_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding ``corner_policies.py``, on this process's path only (as a script's
    own folder is), not in the working directory the daemon starts in."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "corner_policies.py").write_text(POLICY)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("corner_policies", None)


async def test_a_policy_beside_the_script_runs_in_the_daemon(
    root: str, beside_the_script: Path
) -> None:
    from corner_policies import KeepOdd  # type: ignore[import-not-found]

    async with AsyncCheckpointManager(root, retention=KeepOdd() | LatestN(1)) as mgr:
        for step in range(1, 6):
            await (await mgr.save(step, {"x": torch.full((2,), float(step))}))
        assert await mgr.steps() == [1, 3, 5]


async def test_a_policy_the_daemon_cannot_import_fails_open_naming_it(
    root: str, beside_the_script: Path
) -> None:
    from corner_policies import KeepOdd

    policy = KeepOdd()
    (beside_the_script / "corner_policies.py").unlink()  # gone before the daemon looks
    with pytest.raises(DaemonStartError, match="retention policy"):
        async with AsyncCheckpointManager(root, retention=policy):
            pass
