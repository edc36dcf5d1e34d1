"""The ``aiockpt`` command, run through its installed entry point on runs made by the manager."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from _support.roots import (
    flip_byte,
    make_partial,
    manifest_of,
    shard_name,
    shard_path,
    step_numbers,
)

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt

SCRIPT = str(Path(sys.executable).parent / "aiockpt")
STEPS = [1, 2, 3, 4, 5, 6]
LOSS = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8}


def run_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"weight": torch.randn(64, 32, generator=g), "bias": torch.zeros(32)},
        "ids": torch.arange(10, dtype=torch.int64),
        "step": step,
        "config": {"lr": 0.01, "name": "tiny", "betas": (0.9, 0.99), "tags": []},
        "best": float("inf"),
    }


async def _make_run(root: str) -> dict[int, int]:
    sizes = {}
    async with AsyncCheckpointManager(root) as mgr:
        for step in STEPS:
            info = await (
                await mgr.save(
                    step,
                    run_state(step),
                    metrics={"loss": LOSS[step], "acc": step / 10},
                    metadata={"epoch": step // 2},
                )
            )
            sizes[step] = info.nbytes
    return sizes


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[str, dict[int, int]]:
    """A run of six checkpoints, made once per module by the real manager and daemon."""
    root = str(tmp_path_factory.mktemp("cli") / "run")
    sizes = anyio.run(_make_run, root)
    return root, sizes


@pytest.fixture
def run(pristine, tmp_path) -> str:
    """A private copy of the run, free to corrupt."""
    dest = str(tmp_path / "run")
    shutil.copytree(pristine[0], dest)
    return dest


def aiockpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def shard(root: str, step: int) -> str:
    return shard_path(root, step)


# --------------------------------------------------------------------------- ls and show


def test_ls_lists_committed_steps_with_time_size_and_metrics(run, pristine):
    make_partial(run, 9)
    r = aiockpt("ls", run)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["STEP", "COMMITTED", "SIZE", "WRITTEN", "REFERENCED", "METRICS"]
    rows = [line.split() for line in lines[1:]]
    assert [int(row[0]) for row in rows] == STEPS  # the partial 9 is not listed
    for row in rows:
        step = int(row[0])
        assert f"loss={LOSS[step]:.6g}" in row
        assert f"acc={step / 10:.6g}" in row
        assert " ".join(row[3:5]) == dict(_sizes(run))[step]
    assert "1 partial step dir not listed" in r.stderr

    r = aiockpt("ls", run, "--json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["step"] for x in records] == STEPS
    for x in records:
        assert x["nbytes"] == pristine[1][x["step"]]
        assert x["metrics"] == {"loss": LOSS[x["step"]], "acc": x["step"] / 10}
        assert x["created_at"] == manifest_of(run, x["step"])["created_at"]


def test_show_lists_tensors_and_plain_values(run):
    r = aiockpt("show", run, "3")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("step 3  committed ")
    assert "metrics   acc=0.3 loss=0.5" in out
    assert 'metadata  {"epoch": 1}' in out
    tensors_part, values_part = out.split("\ntensors (", 1)[1].split("\nvalues\n")
    # After the "(3, 8.3 KiB in …)" title and the summary's bytes-by-dtype line.
    tensor_rows = tensors_part.splitlines()[2:]
    assert tensor_rows[0].split() == ["KEY", "DTYPE", "SHAPE", "BYTES"]
    tensors = {}
    for line in tensor_rows[1:]:
        if line:
            m = re.fullmatch(r"(\S+)\s+(\S+)\s+(\[.*\])\s+(\d+)", line)
            assert m, line
            tensors[m[1]] = (m[2], m[3], int(m[4]))
    assert tensors == {
        "ids": ("I64", "[10]", 80),
        "model/bias": ("F32", "[32]", 128),
        "model/weight": ("F32", "[64, 32]", 8192),
    }
    value_rows = values_part.splitlines()
    assert value_rows[0].split() == ["KEY", "VALUE"]
    values = dict(line.split(None, 1) for line in value_rows[1:])
    assert values == {
        "step": "3",
        "config/lr": "0.01",
        "config/name": '"tiny"',
        "config/betas/0": "0.9",
        "config/betas/1": "0.99",
        "config/tags": "[]",
        "best": "inf",
    }


# --------------------------------------------------------------------------- verify


def test_verify_passes_an_intact_run(run):
    r = aiockpt("verify", run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"step {s}: ok ({s_size})" for s, s_size in _sizes(run)]
    assert "all 6 checkpoints intact" in r.stderr
    assert "\r" not in r.stderr  # no progress bar when stderr is not a terminal


def _sizes(root: str) -> list[tuple[int, str]]:
    out = []
    for s in STEPS:
        nbytes = sum(x["nbytes"] for x in manifest_of(root, s)["shards"])
        out.append((s, f"{nbytes / 1024:.1f} KiB"))
    return out


def test_verify_catches_a_flipped_byte_in_a_tensor(run):
    m = manifest_of(run, 4)
    start, _ = m["tensors"][shard_name(run, 4)]["model/weight"]["byte_range"]
    flip_byte(shard(run, 4), start + 1000)
    r = aiockpt("verify", run)
    assert r.returncode == 1
    name = f"{fmt.step_dirname(4)}/{shard_name(run, 4)}"
    assert "step 4: CORRUPT" in r.stdout
    assert f"{name}: whole-file crc32c mismatch" in r.stdout
    assert f"{name}: tensor 'model/weight' crc32c mismatch" in r.stdout
    assert "'model/bias'" not in r.stdout
    assert "'ids'" not in r.stdout
    for s in STEPS:
        if s != 4:
            assert f"step {s}: ok" in r.stdout
    assert "1 of 6 checkpoints corrupt" in r.stderr
    # Only the step asked for is read.
    assert aiockpt("verify", run, "3").returncode == 0
    assert aiockpt("verify", run, "4").returncode == 1


def test_verify_catches_a_flipped_byte_outside_every_tensor(run):
    flip_byte(shard(run, 2), 10)  # inside the shard's JSON header
    r = aiockpt("verify", run, "2")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "step 2: CORRUPT",
        f"  {fmt.step_dirname(2)}/{shard_name(run, 2)}: whole-file crc32c mismatch",
    ]


def test_verify_names_missing_truncated_and_unreadable_files(run):
    os.unlink(shard(run, 1))
    with open(shard(run, 2), "r+b") as f:
        f.truncate(100)
    with open(os.path.join(run, fmt.step_dirname(3), fmt.MANIFEST), "w") as f:
        f.write('{"format": "aiockpt", "version": 1, "step": 3')  # cut short
    r = aiockpt("verify", run)
    assert r.returncode == 1
    out = r.stdout
    assert f"{fmt.step_dirname(1)}/{shard_name(run, 1)}: missing" in out
    size = manifest_of(run, 2)["shards"][0]["nbytes"]
    assert f"{fmt.step_dirname(2)}/{shard_name(run, 2)}: 100 bytes, the manifest says {size}" in out
    assert f"{fmt.step_dirname(3)}/{fmt.MANIFEST}: " in out
    assert "not valid JSON" in out
    assert "3 of 6 checkpoints corrupt" in r.stderr
    # ls still lists the unreadable step, marked; show refuses it with exit 1.
    ls = aiockpt("ls", run)
    assert ls.returncode == 0
    assert any(line.split()[:2] == ["3", "?"] for line in ls.stdout.splitlines()[1:])
    show = aiockpt("show", run, "3")
    assert show.returncode == 1
    assert "not valid JSON" in show.stderr
    assert "Traceback" not in show.stderr


def test_verify_draws_a_progress_bar_on_a_terminal(run):
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.run(
            [SCRIPT, "verify", run],
            stdout=subprocess.PIPE,
            stderr=terminal,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
        os.close(terminal)
        terminal = -1
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    assert proc.returncode == 0
    text = seen.decode()
    assert "\r" in text
    assert "100%" in text
    assert "[" + "#" * 30 + "]" in text
    assert b"%" not in proc.stdout  # the bar never reaches stdout


# --------------------------------------------------------------------------- prune


def test_prune_shows_then_deletes_with_yes(run):
    before = step_numbers(run)
    args = ("prune", run, "--keep-last", "2", "--keep-every", "3", "--keep-best", "loss:min:1")
    r = aiockpt(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"would delete step 1 (committed {_time(run, 1)}, {dict(_sizes(run))[1]})",
        f"would delete step 4 (committed {_time(run, 4)}, {dict(_sizes(run))[4]})",
        "keeping 4 checkpoints: 2, 3, 5, 6",
    ]
    assert "dry run" in r.stderr
    assert step_numbers(run) == before  # nothing deleted without --yes

    r = aiockpt(*args, "--yes")
    assert r.returncode == 0, r.stderr
    assert "deleting step 1" in r.stdout
    assert "deleting step 4" in r.stdout
    assert step_numbers(run) == [2, 3, 5, 6]
    assert aiockpt("verify", run).returncode == 0
    # A second pass finds nothing more to do.
    again = aiockpt(*args, "--yes")
    assert again.returncode == 0
    assert "nothing to delete" in again.stderr


def _time(root: str, step: int) -> str:
    import time

    created = manifest_of(root, step)["created_at"]
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))


def test_prune_always_keeps_the_newest(run):
    r = aiockpt("prune", run, "--keep-best", "loss:min:1", "--yes")
    assert r.returncode == 0, r.stderr
    assert step_numbers(run) == [2, 6]  # 2 is the best; 6 the newest


def test_prune_refuses_a_best_metric_no_checkpoint_has(run):
    """A typo in --keep-best must not plan to delete everything but the newest."""
    r = aiockpt("prune", run, "--keep-best", "val_loss:min:1", "--yes")
    assert r.returncode == 2
    assert "val_loss" in r.stderr
    assert "loss" in r.stderr.partition("val_loss")[2]  # names the metrics there are
    assert step_numbers(run) == STEPS  # nothing deleted


def test_prune_removes_partials_but_not_one_a_save_may_be_writing(run):
    make_partial(run, 0)  # below the newest commit: a dead save
    make_partial(run, 7)  # above it: maybe a save in flight
    r = aiockpt("prune", run)  # no policy: every checkpoint stays
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"would delete partial step directory {fmt.step_dirname(0)}",
        "keeping 6 checkpoints: 1, 2, 3, 4, 5, 6",
    ]
    assert "--all-partials" in r.stderr
    assert ": 7" in r.stderr
    assert step_numbers(run) == [0, *STEPS, 7]
    assert aiockpt("prune", run, "--yes").returncode == 0
    assert step_numbers(run) == [*STEPS, 7]
    assert aiockpt("prune", run, "--all-partials", "--yes").returncode == 0
    assert step_numbers(run) == STEPS


@pytest.mark.anyio
async def test_a_pruned_run_resumes_under_the_manager(run):
    assert aiockpt("prune", run, "--keep-last", "1", "--yes").returncode == 0
    async with AsyncCheckpointManager(run) as mgr:
        assert await mgr.steps() == [6]
        loaded = await mgr.load()
        assert torch.equal(loaded["model"]["weight"], run_state(6)["model"]["weight"])
        await (await mgr.save(7, run_state(7)))
    assert aiockpt("verify", run).returncode == 0


# --------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "required: COMMAND"),
        (("frobnicate", "ROOT"), "invalid choice"),
        (("ls",), "required: ROOT"),
        (("show", "RUN"), "required: STEP"),
        (("show", "RUN", "three"), "non-negative integer"),
        (("show", "RUN", "-3"), ""),
        (("show", "RUN", "99"), "step 99 is not a committed checkpoint"),
        (("verify", "RUN", "99"), "committed: 1, 2, 3, 4, 5, 6"),
        (("ls", "MISSING"), "does not exist"),
        (("verify", "MISSING"), "does not exist"),
        (("verify", "EMPTY"), "no checkpoints in"),
        (("ls", "nosuchproto://x/y"), "no storage knows the protocol"),
        (("ls", "RUN", "-o", "novalue"), "KEY=VALUE"),
        (("ls", "FILE"), "cannot list"),
        (("prune", "RUN", "--keep-last", "0"), "at least 1"),
        (("prune", "RUN", "--keep-last", "two"), "not an integer"),
        (("prune", "RUN", "--keep-every", "-5"), ""),
        (("prune", "RUN", "--keep-every-seconds", "nan"), "positive number of seconds"),
        (("prune", "RUN", "--keep-best", "loss"), "METRIC:MODE:N"),
        (("prune", "RUN", "--keep-best", "loss:median:2"), "min or max"),
        (("prune", "RUN", "--keep-best", "loss:min:0"), "at least 1"),
        (("prune", "EMPTY", "--keep-last", "1"), "no checkpoints in"),
    ],
)
def test_mistakes_exit_2_with_one_line(run, tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("not a directory")
    places = {
        "RUN": run,
        "EMPTY": str(empty),
        "MISSING": str(tmp_path / "missing"),
        "FILE": str(tmp_path / "file"),
    }
    r = aiockpt(*(places.get(a, a) for a in args))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("aiockpt: error: ")
    assert message in lines[0]
    assert step_numbers(run) == STEPS  # and nothing was touched


def test_help_exits_0(run):
    r = aiockpt("prune", "--help")
    assert r.returncode == 0
    assert "--keep-best METRIC:MODE:N" in r.stdout


# --------------------------------------------------------------------------- how it runs


def test_the_cli_never_imports_torch(run):
    code = (
        "import sys\n"
        "from aiockpt.cli import main\n"
        "codes = [main(['ls', sys.argv[1]]), main(['verify', sys.argv[1]]),\n"
        "         main(['show', sys.argv[1], '1']), main(['prune', sys.argv[1]])]\n"
        "assert codes == [0, 0, 0, 0], codes\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code, run], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_runs_as_a_module_too(run):
    r = subprocess.run(
        [sys.executable, "-m", "aiockpt.cli", "ls", run], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 + len(STEPS)


def test_any_fsspec_url_works_as_root(run):
    # dir:// is fsspec's DirFileSystem: the root goes through the fsspec storage, not the
    # local one, with its options given on the command line.
    parent, name = os.path.split(run)
    url = f"dir://{name}"
    opts = ("-o", f"path={parent}", "-o", "target_protocol=file")
    ls = aiockpt("ls", url, *opts, "--json")
    assert ls.returncode == 0, ls.stderr
    assert [json.loads(x)["step"] for x in ls.stdout.splitlines()] == STEPS
    assert aiockpt("verify", url, *opts).returncode == 0
    start, _ = manifest_of(run, 5)["tensors"][shard_name(run, 5)]["model/weight"]["byte_range"]
    flip_byte(shard(run, 5), start + 4)
    r = aiockpt("verify", url, *opts, "5")
    assert r.returncode == 1
    assert "tensor 'model/weight' crc32c mismatch" in r.stdout
    assert aiockpt("prune", url, *opts, "--keep-last", "1", "--yes").returncode == 0
    assert step_numbers(run) == [6]


def test_show_and_verify_cover_every_rank_of_a_multi_rank_checkpoint(run):
    # Make step 6 a two-rank checkpoint: rank 1's shard is a copy of rank 0's.
    step_dir = os.path.join(run, fmt.step_dirname(6))
    m = manifest_of(run, 6)
    rank1 = fmt.shard_filename(1, fmt.new_tag())
    shutil.copy(shard(run, 6), os.path.join(step_dir, rank1))
    r0 = m["shards"][0]
    m["world_size"] = 2
    m["shards"].append({**r0, "file": rank1, "rank": 1})
    m["tensors"][rank1] = m["tensors"][r0["file"]]
    m["trees"]["1"] = m["trees"]["0"]
    with open(os.path.join(step_dir, fmt.MANIFEST), "w") as f:
        json.dump(m, f)

    show = aiockpt("show", run, "6")
    assert show.returncode == 0, show.stderr
    assert "world size 2" in show.stdout
    for rank in (0, 1):
        assert f"rank {rank}: tensors (3, " in show.stdout
        assert f"rank {rank}: values" in show.stdout
    assert aiockpt("verify", run, "6").returncode == 0

    start, _ = m["tensors"][rank1]["ids"]["byte_range"]
    flip_byte(os.path.join(step_dir, rank1), start)
    r = aiockpt("verify", run, "6")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "step 6: CORRUPT",
        f"  {fmt.step_dirname(6)}/{rank1}: whole-file crc32c mismatch",
        f"  {fmt.step_dirname(6)}/{rank1}: tensor 'ids' crc32c mismatch",
    ]
