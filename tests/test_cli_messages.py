"""What the ``aiockpt`` command says: a missing root named so by every command, a hint about
partial step directories that names the command that removes them, problem lines that name
a file once, and a description in every command's ``--help``. Run through the installed
entry point on a run made by the manager."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from _support.roots import make_partial, step_numbers

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt.cli.parser import COMMANDS, build_parser

SCRIPT = str(Path(sys.executable).parent / "aiockpt")


def aiockpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


async def _make_run(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        for step in (2, 4, 6):
            await (await mgr.save(step, {"w": torch.full((8,), float(step)), "step": step}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A run of three checkpoints (steps 2, 4 and 6), made once by the real manager."""
    root = str(tmp_path_factory.mktemp("cli-messages") / "run")
    anyio.run(_make_run, root)
    return root


@pytest.fixture
def run(pristine, tmp_path) -> str:
    """A private copy of the run, free to change."""
    dest = str(tmp_path / "run")
    shutil.copytree(pristine, dest)
    return dest


# --------------------------------------------------------------------------- a missing root


@pytest.mark.parametrize(
    "args",
    [
        ("ls", "MISSING"),
        ("ls", "MISSING", "--json"),
        ("show", "MISSING", "1"),
        ("show", "MISSING", "latest"),
        ("verify", "MISSING"),
        ("verify", "MISSING", "3"),
        ("prune", "MISSING"),
        ("prune", "MISSING", "--keep-last", "1", "--yes"),
        ("prune", "MISSING", "--all-partials", "--yes"),
        ("export", "MISSING", "OUT"),
        ("copy", "MISSING", "latest", "DEST"),
    ],
)
def test_every_command_says_a_missing_root_does_not_exist_and_exits_2(tmp_path, args):
    missing = str(tmp_path / "missing")
    places = {"MISSING": missing, "OUT": str(tmp_path / "out"), "DEST": str(tmp_path / "dest")}
    r = aiockpt(*(places.get(a, a) for a in args))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr == f"aiockpt: error: {missing} does not exist\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing was made


def test_a_root_that_exists_without_checkpoints_is_still_said_to_hold_none(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (("show", str(empty), "1"), ("verify", str(empty)), ("prune", str(empty))):
        r = aiockpt(*args)
        assert r.returncode == 2
        assert r.stderr == f"aiockpt: error: no checkpoints in {empty}\n"
    make_partial(str(empty), 3)  # a partial: the root exists, whatever storage says of it
    r = aiockpt("verify", str(empty))
    assert r.returncode == 2
    assert r.stderr == f"aiockpt: error: no checkpoints in {empty} (1 partial step dir)\n"


def test_a_missing_root_of_any_storage_does_not_exist(tmp_path):
    # dir:// is fsspec's DirFileSystem: the fsspec storage, not the local one, answers.
    opts = ("-o", f"path={tmp_path}", "-o", "target_protocol=file")
    for args in (("show", "dir://missing", "latest"), ("verify", "dir://missing")):
        r = aiockpt(*args, *opts)
        assert r.returncode == 2
        assert r.stderr == "aiockpt: error: dir://missing does not exist\n"


def test_the_exit_code_of_a_missing_root_is_documented():
    doc = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    codes = doc.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in codes.splitlines() if line.startswith("| 2 |"))
    assert "a root that does not exist" in row
    assert "every command exits 2 with `aiockpt: error: ROOT does not exist`" in doc


# --------------------------------------------------------------------------- ls and partials


def ls_note(root: str) -> str:
    r = aiockpt("ls", root)
    assert r.returncode == 0, r.stderr
    return r.stderr.strip()


def test_ls_names_the_prune_that_removes_a_dead_partial_and_it_does(run):
    make_partial(run, 3)  # below the newest commit: a save that died
    cmd = f"aiockpt prune {shlex.quote(run)}"
    assert ls_note(run).endswith(f"; 1 partial step dir not listed (3; {cmd} removes it)")
    r = aiockpt(*shlex.split(cmd)[1:], "--yes")
    assert r.returncode == 0, r.stderr
    assert step_numbers(run) == [2, 4, 6]
    assert "partial" not in ls_note(run)


def test_ls_names_all_partials_for_a_partial_a_save_may_still_be_writing(run):
    make_partial(run, 9)  # above the newest commit: plain prune keeps it
    cmd = f"aiockpt prune {shlex.quote(run)} --all-partials"
    assert ls_note(run).endswith(
        "; 1 partial step dir not listed (9; it is above the newest commit and may be a save "
        f"still being written: {cmd} removes it when none is)"
    )
    assert aiockpt("prune", run, "--yes").returncode == 0
    assert 9 in step_numbers(run)  # prune alone keeps it, as the hint says
    assert aiockpt(*shlex.split(cmd)[1:], "--yes").returncode == 0
    assert step_numbers(run) == [2, 4, 6]


def test_ls_names_both_commands_for_partials_on_both_sides_of_the_newest_commit(run):
    for step in (1, 3, 7):
        make_partial(run, step)
    cmd = f"aiockpt prune {shlex.quote(run)}"
    assert ls_note(run).endswith(
        f"; 3 partial step dirs not listed (1, 3, 7; {cmd} removes 1, 3; 7 is above the "
        f"newest commit and may be a save still being written: {cmd} --all-partials removes "
        "it too when none is)"
    )


def test_ls_quotes_a_root_the_shell_would_split(tmp_path, pristine):
    root = str(tmp_path / "my run")
    shutil.copytree(pristine, root)
    make_partial(root, 5)
    assert ls_note(root).endswith(f"(5; aiockpt prune '{root}' removes it)")


# --------------------------------------------------------------------------- verify


def test_verify_names_an_unreadable_manifest_once(run):
    path = Path(run) / fmt.step_dirname(4) / fmt.MANIFEST
    path.write_text("{not json")
    r = aiockpt("verify", run)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[1] == "step 4: CORRUPT"
    problem = lines[2].strip()
    assert problem.startswith(f"{fmt.step_dirname(4)}/{fmt.MANIFEST}: manifest is not valid JSON")
    assert run not in problem  # the root is named once, by the command line
    r = aiockpt("verify", run, "4", "--json")
    assert json.loads(r.stdout)["problems"] == [problem]


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_describes_itself_in_its_help(name):
    _, parsers = build_parser()
    description = parsers[name].description
    assert description, f"aiockpt {name} --help has no description"
    r = aiockpt(name, "--help")
    assert r.returncode == 0
    # argparse prints the usage, then the description, then the arguments.
    paragraphs = r.stdout.split("\n\n")
    assert paragraphs[0].startswith(f"usage: aiockpt {name}")
    assert " ".join(paragraphs[1].split()) == " ".join(description.split())
