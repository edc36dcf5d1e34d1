"""``aiockpt --version``, ``show``'s summary, ``--all``, ``--json`` and ``latest``, ``verify
--json``, and ``ls`` of a missing or empty root, run through the installed entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist
from _support.roots import flip_byte, make_partial, manifest_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import aiockpt
from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt

SCRIPT = str(Path(sys.executable).parent / "aiockpt")
FIXTURES = Path(__file__).parent / "fixtures"
#: Step 3's note: its JSON text is far longer than the 80 characters a summary shows.
NOTE = "a long note about this run, " * 8
DTYPES = [torch.float32, torch.int64, torch.bfloat16]
#: Step 3's plain values, as show gives them.
BIG_VALUES = {
    "note": json.dumps(NOTE),
    "step": "3",
    "lr": "0.5",
    "tags/0": '"a"',
    "tags/1": '"b"',
}


def small_state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def big_state() -> dict:
    """33 tensors of three dtypes (more than a summary lists) and a long string value."""
    params = {f"layer{i:02d}": torch.full((i + 1, 4), i, dtype=DTYPES[i % 3]) for i in range(33)}
    return {"params": params, "note": NOTE, "step": 3, "lr": 0.5, "tags": ["a", "b"]}


async def _make_run(root: str) -> None:
    async with AsyncCheckpointManager(root) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, small_state(step), metrics={"loss": 1 / step}))
        await (await mgr.save(3, big_state(), metrics={"loss": 0.25}, metadata={"epoch": 1}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A run of three checkpoints (step 3 the big one), made once by the real manager."""
    root = str(tmp_path_factory.mktemp("cli-more") / "run")
    anyio.run(_make_run, root)
    return root


@pytest.fixture
def run(pristine, tmp_path) -> str:
    """A private copy of the run, free to change."""
    dest = str(tmp_path / "run")
    shutil.copytree(pristine, dest)
    return dest


@pytest.fixture(scope="module")
def many_dtensors(tmp_path_factory) -> str:
    """A checkpoint of 25 distributed tensors (more than a summary lists), saved by this
    process on a gloo group of one."""
    base = tmp_path_factory.mktemp("many-dtensors")
    root = str(base / "run")

    async def save() -> None:
        mesh = init_device_mesh("cpu", (1,))
        state = {
            f"d{i:02d}": distribute_tensor(torch.ones(2, i + 1), mesh, [Shard(0)])
            for i in range(25)
        }
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, {"model": state}))

    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=0, world_size=1)
    try:
        anyio.run(save)
    finally:
        dist.destroy_process_group()
    return root


@pytest.fixture
def v2_root(tmp_path) -> str:
    """A copy of the stored 2-rank format-2 checkpoint (step 5, three distributed tensors)."""
    root = str(tmp_path / "v2")
    shutil.copytree(FIXTURES / "format_v2", root)
    return root


def aiockpt_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def section(out: str, title: str) -> list[str]:
    """The lines after the line that starts with ``title``, up to the next blank line."""
    return out.split("\n" + title, 1)[1].split("\n\n")[0].splitlines()[1:]


# --------------------------------------------------------------------------- --version


def test_version_prints_the_package_version():
    r = aiockpt_run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"aiockpt {aiockpt.__version__}\n"
    assert aiockpt.__version__[0].isdigit()


# --------------------------------------------------------------------------- show: latest


def test_show_latest_is_the_newest_committed_step(run):
    make_partial(run, 9)  # a save that never committed is not the latest
    by_number = aiockpt_run("show", run, "3")
    assert by_number.returncode == 0, by_number.stderr
    for args in (("latest",), ("--step", "latest")):
        r = aiockpt_run("show", run, *args)
        assert r.returncode == 0, r.stderr
        assert r.stdout == by_number.stdout
    as_json = json.loads(aiockpt_run("show", run, "latest", "--json").stdout)
    assert as_json["step"] == 3


def test_show_latest_of_a_root_without_checkpoints_exits_2(tmp_path):
    make_partial(str(tmp_path), 4)
    r = aiockpt_run("show", str(tmp_path), "latest")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == f"aiockpt: error: no checkpoints in {tmp_path} (1 partial step dir)\n"


def test_show_refuses_a_step_that_is_neither_a_number_nor_latest(run):
    r = aiockpt_run("show", run, "newest")
    assert r.returncode == 2
    assert "a step is a non-negative integer or latest, not 'newest'" in r.stderr


# --------------------------------------------------------------------------- show: summary


def _tensor_rows(lines: list[str]) -> list[list[str]]:
    return [line.split() for line in lines]


def test_show_summarises_tensors_and_cuts_values_short(run):
    r = aiockpt_run("show", run, "3")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("step 3  committed ")
    assert "metrics   loss=0.25" in out
    shard = manifest_of(run, 3)["shards"][0]
    lines = section(out, "tensors (33, ")
    # 11 of each dtype: F32 and I64 (i+1)*4 elements of 4 and 8 bytes, BF16 of 2.
    f32 = sum((i + 1) * 16 for i in range(0, 33, 3))
    i64 = sum((i + 1) * 32 for i in range(1, 33, 3))
    bf16 = sum((i + 1) * 8 for i in range(2, 33, 3))
    assert (f32, i64, bf16) == (2816, 5984, 1584)
    assert (
        lines[0]
        == "bytes     10.1 KiB in 33 tensors: I64 5.8 KiB (11), F32 2.8 KiB (11), BF16 1.5 KiB (11)"
    )
    assert lines[1].split() == ["KEY", "DTYPE", "SHAPE", "BYTES"]
    rows = _tensor_rows(lines[2:-1])
    assert [row[0] for row in rows] == [f"params/layer{i:02d}" for i in range(20)]
    assert rows[0] == ["params/layer00", "F32", "[1,", "4]", "16"]
    assert rows[19] == ["params/layer19", "I64", "[20,", "4]", str(20 * 4 * 8)]
    assert lines[-1] == "… and 13 more (--all lists them all)"
    assert f"in {shard['file']})" in out

    values = section(out, "values")
    assert values[0].split() == ["KEY", "VALUE"]
    shown = dict(line.split(None, 1) for line in values[1:])
    assert shown.keys() == BIG_VALUES.keys()
    assert len(shown["note"]) == 80
    assert shown["note"] == BIG_VALUES["note"][:79] + "…"
    assert {k: v for k, v in shown.items() if k != "note"} == {
        k: v for k, v in BIG_VALUES.items() if k != "note"
    }


def test_show_all_lists_every_tensor_and_every_value_in_full(run):
    r = aiockpt_run("show", run, "3", "--all")
    assert r.returncode == 0, r.stderr
    lines = section(r.stdout, "tensors (33, ")
    assert lines[0].split() == ["KEY", "DTYPE", "SHAPE", "BYTES"]  # no bytes line
    rows = _tensor_rows(lines[1:])
    assert [row[0] for row in rows] == [f"params/layer{i:02d}" for i in range(33)]
    assert rows[32] == ["params/layer32", "BF16", "[33,", "4]", str(33 * 4 * 2)]
    assert "… and" not in r.stdout
    values = section(r.stdout, "values")
    assert dict(line.split(None, 1) for line in values[1:]) == BIG_VALUES


def test_a_small_checkpoint_shows_whole_in_its_summary(run):
    r = aiockpt_run("show", run, "1")
    assert r.returncode == 0, r.stderr
    lines = section(r.stdout, "tensors (1, ")
    assert lines == [
        "bytes     16 B in 1 tensor: F32 16 B (1)",
        "KEY  DTYPE  SHAPE  BYTES",
        "w    F32    [4]       16",
    ]
    assert "… and" not in r.stdout
    full = aiockpt_run("show", run, "1", "--all").stdout
    assert full == r.stdout.replace("bytes     16 B in 1 tensor: F32 16 B (1)\n", "")


def test_show_summarises_the_distributed_tensors_table(many_dtensors):
    r = aiockpt_run("show", many_dtensors, "latest")
    assert r.returncode == 0, r.stderr
    lines = section(r.stdout, "distributed tensors (25, ")
    assert lines[0].split() == ["KEY", "DTYPE", "SHAPE", "PLACEMENTS", "MESH", "CHUNKS", "BYTES"]
    assert [line.split()[0] for line in lines[1:-1]] == [f"model/d{i:02d}" for i in range(20)]
    assert lines[1].split() == ["model/d00", "F32", "[2,", "1]", "[Shard(dim=0)]", "[1]", "1", "8"]
    assert lines[-1] == "… and 5 more (--all lists them all)"
    full = section(aiockpt_run("show", many_dtensors, "1", "--all").stdout, "distributed tensors")
    assert [line.split()[0] for line in full[1:]] == [f"model/d{i:02d}" for i in range(25)]


# --------------------------------------------------------------------------- show --json


def test_show_json_is_one_complete_object(run):
    r = aiockpt_run("show", run, "3", "--json")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1
    got = json.loads(r.stdout)
    m = manifest_of(run, 3)
    assert list(got) == [
        "step",
        "created_at",
        "world_size",
        "nbytes",
        "written_nbytes",
        "referenced_nbytes",
        "referenced_files",
        "url",
        "metrics",
        "metadata",
        "tensors",
        "dtensors",
        "values",
    ]
    assert got["step"] == 3
    assert got["created_at"] == m["created_at"]
    assert got["world_size"] == 1
    assert got["nbytes"] == sum(s["nbytes"] for s in m["shards"])
    assert got["url"] == f"{run}/{fmt.step_dirname(3)}"
    assert got["metrics"] == {"loss": 0.25}
    assert got["metadata"] == {"epoch": 1}
    assert got["dtensors"] == {}
    assert list(got["tensors"]) == ["0"]
    tensors = got["tensors"]["0"]
    assert len(tensors) == 33  # every one, not a summary
    for i in range(33):
        dtype = ["F32", "I64", "BF16"][i % 3]
        size = {"F32": 4, "I64": 8, "BF16": 2}[dtype]
        assert tensors[f"params/layer{i:02d}"] == {
            "dtype": dtype,
            "shape": [i + 1, 4],
            "nbytes": (i + 1) * 4 * size,
        }
    assert got["values"] == {"0": BIG_VALUES}  # values in full


def test_show_json_of_a_checkpoint_with_distributed_tensors(v2_root):
    r = aiockpt_run("show", v2_root, "--step", "latest", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["step"] == 5
    assert got["world_size"] == 2
    assert got["metrics"] == {"loss": 0.25}
    assert got["dtensors"] == {
        "i": {
            "dtype": "I64",
            "shape": [7],
            "placements": ["Shard(dim=0)"],
            "mesh": [2],
            "chunks": 2,
            "nbytes": 56,
        },
        "rep": {
            "dtype": "F32",
            "shape": [3, 4],
            "placements": ["Replicate()"],
            "mesh": [2],
            "chunks": 1,
            "nbytes": 48,
        },
        "w": {
            "dtype": "F32",
            "shape": [6, 10],
            "placements": ["Shard(dim=1)"],
            "mesh": [2],
            "chunks": 2,
            "nbytes": 240,
        },
    }
    # Each rank's tensors are its plain ones; the chunks it holds are in dtensors.
    plain = {"plain": {"dtype": "I8", "shape": [3], "nbytes": 3}}
    assert got["tensors"] == {"0": plain, "1": plain}
    assert got["values"] == {"0": {"step": "5"}, "1": {"step": "5"}}


# --------------------------------------------------------------------------- verify --json


def test_verify_json_gives_one_object_per_checkpoint(run):
    r = aiockpt_run("verify", run, "--json")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == [
        {"step": s, "ok": True, "problems": []} for s in (1, 2, 3)
    ]

    shard = manifest_of(run, 2)["shards"][0]["file"]
    start, _ = manifest_of(run, 2)["tensors"][shard]["w"]["byte_range"]
    flip_byte(os.path.join(run, fmt.step_dirname(2), shard), start)
    with open(os.path.join(run, fmt.step_dirname(3), fmt.MANIFEST), "w") as f:
        f.write('{"format": "aiockpt"')  # cut short
    r = aiockpt_run("verify", run, "--json")
    assert r.returncode == 1
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert records[0] == {"step": 1, "ok": True, "problems": []}
    name = f"{fmt.step_dirname(2)}/{shard}"
    assert records[1] == {
        "step": 2,
        "ok": False,
        "problems": [f"{name}: whole-file crc32c mismatch", f"{name}: tensor 'w' crc32c mismatch"],
    }
    assert records[2]["step"] == 3
    assert records[2]["ok"] is False
    assert len(records[2]["problems"]) == 1
    assert records[2]["problems"][0].startswith(f"{fmt.step_dirname(3)}/{fmt.MANIFEST}: ")
    assert "not valid JSON" in records[2]["problems"][0]
    assert "2 of 3 checkpoints corrupt" in r.stderr

    one = aiockpt_run("verify", run, "1", "--json")
    assert one.returncode == 0
    assert one.stdout == '{"step": 1, "ok": true, "problems": []}\n'


# --------------------------------------------------------------------------- ls of a root


def test_ls_of_a_missing_root_exits_2_and_of_an_empty_root_0(tmp_path):
    missing = str(tmp_path / "missing")
    for extra in ((), ("--json",)):
        r = aiockpt_run("ls", missing, *extra)
        assert r.returncode == 2
        assert r.stdout == ""
        assert r.stderr == f"aiockpt: error: {missing} does not exist\n"
    assert not os.path.exists(missing)  # and ls did not make it

    empty = tmp_path / "empty"
    empty.mkdir()
    for extra in ((), ("--json",)):
        r = aiockpt_run("ls", str(empty), *extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout == ""
        assert r.stderr == f"no checkpoints in {empty}\n"
    make_partial(str(empty), 7)
    r = aiockpt_run("ls", str(empty))
    assert r.returncode == 0
    assert r.stderr == f"no checkpoints in {empty} (1 partial step dir)\n"

    # The other commands take a root without checkpoints for a mistake, and say a missing
    # root does not exist, as ls does.
    r = aiockpt_run("verify", str(empty))
    assert r.returncode == 2
    assert r.stderr == f"aiockpt: error: no checkpoints in {empty} (1 partial step dir)\n"
    for args in (("show", missing, "1"), ("prune", missing)):
        r = aiockpt_run(*args)
        assert r.returncode == 2
        assert r.stderr == f"aiockpt: error: {missing} does not exist\n"


def test_ls_asks_any_storage_whether_the_root_exists(tmp_path):
    # dir:// is fsspec's DirFileSystem: the fsspec storage, not the local one, answers.
    (tmp_path / "empty").mkdir()
    opts = ("-o", f"path={tmp_path}", "-o", "target_protocol=file")
    r = aiockpt_run("ls", "dir://missing", *opts)
    assert r.returncode == 2
    assert r.stderr == "aiockpt: error: dir://missing does not exist\n"
    r = aiockpt_run("ls", "dir://empty", *opts)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "no checkpoints in dir://empty\n"


def test_ls_json_keeps_its_format(run):
    r = aiockpt_run("ls", run, "--json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    keys = ["step", "url", "created_at", "nbytes", "written_nbytes", "referenced_nbytes", "metrics"]
    assert [list(x) for x in records] == [keys] * 3
    assert [x["metrics"] for x in records] == [{"loss": 1.0}, {"loss": 0.5}, {"loss": 0.25}]


# --------------------------------------------------------------------------- how it runs


def test_the_new_options_never_import_torch(run, tmp_path):
    code = (
        "import sys\n"
        "from aiockpt.cli import main\n"
        "root, empty = sys.argv[1:3]\n"
        "codes = [main(['show', root, 'latest', '--json']), main(['show', root, '3', '--all']),\n"
        "         main(['verify', root, '--json']), main(['ls', empty])]\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as e:\n"
        "    codes.append(e.code)\n"
        "assert codes == [0, 0, 0, 0, 0], codes\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, run, str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- exit codes, latest


def run_with_test_storages(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with ``broken://`` (every listing and read fails) and ``nocreds://`` (its
    storage finds no credentials) served from tests/_support/counted.py."""
    tests = str(Path(__file__).parent)
    env = dict(
        os.environ,
        AIOCKPT_STORAGE_FACTORIES="broken=_support.counted:open_broken;"
        "nocreds=_support.counted:open_without_credentials",
        PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    )
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.mark.parametrize("scheme", ["broken", "nocreds"])
def test_storage_failures_and_missing_credentials_exit_1(run, tmp_path, scheme):
    url = f"{scheme}://{run}"
    commands = [
        ("ls", url),
        ("show", url, "latest"),
        ("verify", url),
        ("export", url, str(tmp_path / "out.safetensors")),
        ("copy", url, "3", str(tmp_path / "dest")),
        ("prune", url),
    ]
    why = "connection reset" if scheme == "broken" else "no credentials"
    for args in commands:
        r = run_with_test_storages(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert why in r.stderr, args
        assert "error:" not in r.stderr, args  # not reported as a usage mistake
    assert not (tmp_path / "out.safetensors").exists()


def test_latest_is_taken_wherever_a_step_is(run, tmp_path):
    r = aiockpt_run("verify", run, "latest")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [r.stdout.splitlines()[0]]
    assert r.stdout.startswith("step 3: ok")
    r = aiockpt_run("verify", run, "--step", "latest", "--json")
    assert [json.loads(x)["step"] for x in r.stdout.splitlines()] == [3]
    # export: --step latest, and the default.
    for extra in ((), ("--step", "latest")):
        out = tmp_path / f"out{len(extra)}.safetensors"
        r = aiockpt_run("export", run, str(out), "--prefix", "params", *extra)
        assert r.returncode == 0, r.stderr
        assert "wrote 33 tensors" in r.stdout
    r = aiockpt_run("copy", run, "latest", str(tmp_path / "dest"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("copied step 3 ")
    assert (tmp_path / "dest" / fmt.step_dirname(3) / fmt.MANIFEST).exists()
    r = aiockpt_run("copy", run, "newest", str(tmp_path / "dest2"))
    assert r.returncode == 2
    assert "latest" in r.stderr


def test_export_dtype_writes_floating_tensors_in_bf16_or_fp16(tmp_path):
    from safetensors.torch import load_file

    specials = [0.0, -0.0, 1.0, -2.5, 3.14159265, 1e-40, -1e-45, 1e38, 7e4, 65519.0, 65520.0]
    specials += [float("inf"), float("-inf"), float("nan"), 1.00390625, 1.01171875]
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.cat([torch.tensor(specials), torch.randn(4000, generator=g) * 100]),
        "d": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6),
        "mask": torch.tensor([True, False]),
    }
    root = str(tmp_path / "root")

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, state))

    anyio.run(save)
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / f"{flag}.safetensors"
        r = aiockpt_run("export", root, str(out), "--dtype", flag)
        assert r.returncode == 0, r.stderr
        got = load_file(str(out))
        for k, v in state.items():
            want = v.to(dtype) if v.is_floating_point() else v
            assert got[k].dtype == want.dtype, k
            assert got[k].shape == want.shape, k
            # Bit for bit what torch's cast gives, NaN where it gives NaN (torch's vectorized
            # and scalar casts make NaNs of different bits).
            if want.is_floating_point():
                nan = want.isnan()
                assert torch.equal(got[k].isnan(), nan), (flag, k)
                bits = torch.int16 if want.element_size() == 2 else torch.int64
                assert torch.equal(got[k][~nan].view(bits), want[~nan].view(bits)), (flag, k)
            else:
                assert torch.equal(got[k], want), k
    r = aiockpt_run("export", root, str(tmp_path / "x.safetensors"), "--dtype", "int8")
    assert r.returncode == 2
    assert "bf16" in r.stderr
