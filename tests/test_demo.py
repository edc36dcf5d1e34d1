"""The README's demo, examples/async_trainer.py: stopped at step 35 and run again, it resumes
from its checkpoint and trains on exactly as a run that was never stopped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAVED = re.compile(r"step +(\d+)/60 +loss ([0-9.]+) +saved:")


def run(root: Path, *args: str) -> str:
    script = str(REPO / "examples" / "async_trainer.py")
    proc = subprocess.run(
        [sys.executable, script, "--root", str(root), "--steps", "60", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def losses(out: str) -> dict[int, str]:
    """The loss each saved step printed, as printed."""
    return {int(step): loss for step, loss in SAVED.findall(out)}


def test_the_demo_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    stopped = run(tmp_path / "demo", "--stop-at", "35")
    assert "starting fresh" in stopped
    assert "stopping at step 35 (as if preempted)" in stopped
    assert sorted(losses(stopped)) == [5, 10, 15, 20, 25, 30, 35]

    resumed = run(tmp_path / "demo")
    assert "RESUMED from step 35 (checkpoint 35 in" in resumed
    assert sorted(losses(resumed)) == [40, 45, 50, 55, 60]
    assert "committed checkpoints: [50, 55, 60]" in resumed  # LatestN(2) | EveryNSteps(50)

    whole = losses(run(tmp_path / "whole"))
    assert whole == {**losses(stopped), **losses(resumed)}


def test_a_script_beside_a_checkout_named_aiockpt_imports_the_package(tmp_path: Path) -> None:
    """A newcomer's script next to the checkout's folder, itself named aiockpt, imports the
    installed package, not that folder as an empty namespace package."""
    (tmp_path / "aiockpt").symlink_to(REPO, target_is_directory=True)
    (tmp_path / "mine.py").write_text(
        "import aiockpt\nprint(aiockpt.AsyncCheckpointManager.__module__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "mine.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "aiockpt._trainer.manager"
