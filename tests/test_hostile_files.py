"""Files that are not what a checkpoint's names promise: a FIFO, a unix socket, a symbolic
link to /dev/zero or to a file outside the root, a step directory that is a link into another
run. Loading must open only regular files and never through a link (a FIFO's open(2) alone
would block the daemon forever, and a link reads, or deletes, what lies outside the root).

Every probe runs in a subprocess with a deadline, so a hang fails its test instead of the
suite.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt._core import format as fmt

REPO = str(Path(__file__).resolve().parent.parent)
SCRIPT = str(Path(sys.executable).parent / "aiockpt")
#: The most a probe may take; the subprocess gets more, for its interpreter to start.
DEADLINE = 20


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1000, generator=g), "b": torch.arange(64.0), "step": step}


async def _save(root: str, steps: list[int]) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        for step in steps:
            await (await mgr.save(step, _state(step)))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run of one committed step, made once by the real manager and daemon."""
    root = str(tmp_path_factory.mktemp("hostile") / "run")
    anyio.run(_save, root, [1])
    return root


@pytest.fixture
def run(pristine: str, tmp_path: Path) -> str:
    """A private copy of the run, free to damage."""
    dest = str(tmp_path / "run")
    shutil.copytree(pristine, dest)
    return dest


def _manifest(root: str, step: int = 1) -> str:
    return os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)


def _shard(root: str, step: int = 1) -> str:
    with open(_manifest(root, step)) as f:
        name = json.load(f)["shards"][0]["file"]
    return os.path.join(root, fmt.step_dirname(step), name)


def _unix_socket(path: str) -> None:
    """A unix socket bound at ``path`` (bound by its name in its own directory: a socket's
    address is limited to 108 bytes, and test paths are long)."""
    here = os.getcwd()
    os.chdir(os.path.dirname(path))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def _outside(path: str, elsewhere: Path) -> None:
    """The file moved out of the root, a symbolic link left in its place: its bytes are
    right, but no file outside the root is ever read."""
    elsewhere.mkdir(exist_ok=True)
    target = str(elsewhere / os.path.basename(path))
    shutil.move(path, target)
    os.symlink(target, path)


def _replace(path: str, kind: str, elsewhere: Path) -> None:
    if kind == "outside":
        _outside(path, elsewhere)
        return
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        _unix_socket(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "socket", "devzero", "outside"]
PLACES: dict[str, Callable[[str], str]] = {"shard": _shard, "manifest": _manifest}

_LOADS = textwrap.dedent(
    """
    import json, sys
    import anyio, torch
    from aiockpt import AsyncCheckpointManager
    from aiockpt.errors import CorruptCheckpointError

    async def main(root, deadline):
        async with AsyncCheckpointManager(root, read_only=True) as mgr:
            into = {"w": torch.zeros(1000), "b": torch.zeros(64), "step": 0}
            for name, probe in (("load", mgr.load), ("into", lambda: mgr.load(into=into))):
                try:
                    with anyio.fail_after(deadline):
                        await probe()
                    out = {"probe": name, "error": None}
                except Exception as e:
                    out = {
                        "probe": name,
                        "error": type(e).__name__,
                        "corrupt": isinstance(e, CorruptCheckpointError),
                        "message": str(e),
                    }
                print(json.dumps(out), flush=True)

    anyio.run(main, sys.argv[1], float(sys.argv[2]))
    """
)


def _loads(root: str) -> dict[str, dict]:
    """What ``load()`` and ``load(into=...)`` of a read-only manager did, each under the
    deadline, in a subprocess of its own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    try:
        r = subprocess.run(
            [sys.executable, "-c", _LOADS, root, str(DEADLINE)],
            capture_output=True,
            text=True,
            timeout=2 * DEADLINE + 60,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the loads did not end: {e.stdout!r} {e.stderr!r}")
    assert r.returncode == 0, r.stderr
    return {(o := json.loads(line))["probe"]: o for line in r.stdout.splitlines()}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"aiockpt {' '.join(args)} did not end within {DEADLINE} s: {e.stderr!r}")


def _assert_refused(outcome: dict, path: str) -> None:
    assert outcome["error"] is not None, f"{outcome['probe']} read {path}"
    assert outcome["error"] != "TimeoutError", f"{outcome['probe']} hung on {path}"
    assert outcome["corrupt"], outcome
    assert path in outcome["message"], outcome


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", KINDS)
def test_loads_refuse_what_is_not_a_regular_file_in_the_root(
    run: str, tmp_path: Path, kind: str, place: str
) -> None:
    path = PLACES[place](run)
    _replace(path, kind, tmp_path / "elsewhere")
    outcome = _loads(run)
    assert set(outcome) == {"load", "into"}
    for probe in outcome.values():
        _assert_refused(probe, path)


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", KINDS)
def test_the_cli_refuses_what_is_not_a_regular_file_in_the_root(
    run: str, tmp_path: Path, kind: str, place: str
) -> None:
    path = PLACES[place](run)
    rel = os.path.relpath(path, run)
    _replace(path, kind, tmp_path / "elsewhere")
    verify = _cli("verify", run)
    assert verify.returncode == 1, verify
    assert rel in verify.stdout + verify.stderr
    assert "Traceback" not in verify.stderr
    show = _cli("show", run, "1")
    assert "Traceback" not in show.stderr
    if place == "manifest":
        assert show.returncode == 1, show
        assert path in show.stderr
    else:
        # show reads the manifest alone: the shard is never opened, so it is not refused
        assert show.returncode == 0, show
        assert "step 1" in show.stdout


def test_a_step_directory_linked_into_another_run_is_not_loaded(run: str, tmp_path: Path) -> None:
    """A step directory that is a link (to a whole, valid step elsewhere) is refused: the
    link is a directory component under the root."""
    other = str(tmp_path / "other")
    anyio.run(_save, other, [2])
    os.symlink(os.path.join(other, fmt.step_dirname(2)), os.path.join(run, fmt.step_dirname(2)))
    outcome = _loads(run)  # the newest step is the linked one
    for probe in outcome.values():
        _assert_refused(probe, os.path.join(run, fmt.step_dirname(2)))
    verify = _cli("verify", run)
    assert verify.returncode == 1, verify
    assert fmt.step_dirname(2) in verify.stdout + verify.stderr


def _tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


def test_retention_never_deletes_through_a_linked_step_directory(run: str, tmp_path: Path) -> None:
    """A run seeded with another run's step by a symbolic link: retention lets that step
    go, and must not unlink the other run's manifest (nor anything of it) through the link."""
    other = str(tmp_path / "other")
    anyio.run(_save, other, [2])
    before = _tree(other)
    link = os.path.join(run, fmt.step_dirname(2))
    os.symlink(os.path.join(other, fmt.step_dirname(2)), link)

    async def save_three() -> BaseException | None:
        async with AsyncCheckpointManager(run, retention=LatestN(1)) as mgr:
            try:
                await (await mgr.save(3, _state(3)))
            except Exception as e:  # retention's failure reaches the caller; the commit stands
                return e
            return None

    error = anyio.run(save_three)
    assert _tree(other) == before
    assert os.path.exists(_manifest(run, 3))
    if error is not None:
        assert link in str(error)


def test_a_partial_step_that_is_a_link_loses_the_link_alone(run: str, tmp_path: Path) -> None:
    """A step directory without a manifest, below the newest commit, is removed when the
    manager opens; when it is a link to a directory elsewhere, the link goes and what it
    points to stays."""
    target = tmp_path / "elsewhere" / "step"
    target.mkdir(parents=True)
    (target / "keep.bin").write_bytes(b"not the root's")
    link = os.path.join(run, fmt.step_dirname(0))  # below the newest commit: dead
    os.symlink(str(target), link)

    async def open_and_close() -> None:
        async with AsyncCheckpointManager(run):
            pass

    anyio.run(open_and_close)
    assert not os.path.lexists(link)
    assert (target / "keep.bin").read_bytes() == b"not the root's"


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", KINDS)
def test_export_and_copy_refuse_what_is_not_a_regular_file_in_the_root(
    run: str, tmp_path: Path, kind: str, place: str
) -> None:
    """export and copy read what load reads: each ends in time, refusing the file by name,
    and leaves nothing behind."""
    path = PLACES[place](run)
    rel = os.path.relpath(path, run)
    _replace(path, kind, tmp_path / "elsewhere")
    out, dest = tmp_path / "out.safetensors", tmp_path / "dest"
    for args in (("export", run, str(out), "--step", "1"), ("copy", run, "1", str(dest))):
        r = _cli(*args)
        assert r.returncode == 1, (args, r)
        assert rel in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not any(name.startswith("shard_r") for _, _, files in os.walk(dest) for name in files)
