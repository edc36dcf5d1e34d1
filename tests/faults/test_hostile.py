"""Hostile checkpoints. What is read from storage is untrusted: validation raises only
CorruptCheckpointError, never executes code (no pickle on the load path), never allocates
from a claimed size before checking it against the real file, and never opens a path outside
the checkpoint's own step directory."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import pickle
import re
import shutil
import struct
import sys
import threading
from collections.abc import Iterator
from multiprocessing import Pipe
from typing import Any

import anyio
import pytest
import torch
from _support.roots import shard_name, shm_segments
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiockpt import AsyncCheckpointManager
from aiockpt._core import format as fmt
from aiockpt._core.chunks import Chunk
from aiockpt._core.lease import LEASE_DIR
from aiockpt._core.protocol import Hello, LoadAsk, LoadReq
from aiockpt._daemon.server import Daemon, PipeEnd
from aiockpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError

from ._helpers import step_dir

HOSTILE_NAMES = [
    "..",
    "../secret.safetensors",
    "../../etc/passwd",
    "/etc/passwd",
    "/dev/zero",
    "file:///etc/passwd",
    "s3://bucket/key",
    "http://127.0.0.1:9/x",
    "shard_r00000.safetensors/../../secret",
    "./shard_r00000.safetensors",
    "shard_r00000.safetensors\n",
    "shard_r\u0661\u0660\u0660\u0660\u0660.safetensors",  # Arabic-Indic digits
    "shard_r00000.safetensors\x00.txt",
    "~/.ssh/id_rsa",
    "C:\\Windows\\win.ini",
    "",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**64, 10**300, -1, 0, 1, 4096]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(HOSTILE_NAMES),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
TAG = st.sampled_from(["T", "D", "L", "U", "S", "V", "F", "X", ""])
#: Trees shaped like the real ones (tagged one-member objects), with wrong bodies mixed in.
TREE = st.recursive(
    st.builds(lambda tag, body: {tag: body}, TAG, JSON | st.sampled_from(["w", "nan", "-inf"])),
    lambda inner: st.one_of(
        st.lists(
            st.tuples(JSON | st.sampled_from(["k", 0, True]), inner).map(list), max_size=3
        ).map(lambda items: {"D": items}),
        st.lists(inner, max_size=3).map(lambda xs: {"L": xs}),
        st.lists(inner, max_size=3).map(lambda xs: {"U": xs}),
        inner.map(lambda x: {"S": x}),
        st.lists(inner, max_size=2),
        st.builds(lambda a, b: {"D": [["k", a]], "L": [b]}, inner, inner),
    ),
    max_leaves=10,
)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- a real checkpoint


def shard_of(manifest: dict) -> str:
    """Rank 0's shard file, as the manifest names it."""
    return manifest["shards"][0]["file"]


def sample_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.float16)},
        "optim": {"state": {0: {"step": torch.tensor(3)}}, "groups": [{"lr": 0.1}]},
        "seen": (1, None, "x", float("nan")),
        "mask": torch.ones(5, dtype=torch.bool),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    """(root holding step 1, its manifest bytes), saved once through the real manager."""
    root = str(tmp_path_factory.mktemp("pristine") / "run")

    async def save() -> None:
        async with AsyncCheckpointManager(root) as mgr:
            await (await mgr.save(1, sample_state(), metrics={"loss": 0.5}, metadata={"a": [1]}))

    anyio.run(save)
    with open(os.path.join(step_dir(root, 1), fmt.MANIFEST), "rb") as f:
        return root, f.read()


def copy_checkpoint(pristine_root: str, dest: str) -> str:
    shutil.copytree(pristine_root, dest)
    return dest


# --------------------------------------------------------------------------- audit


class Audit:
    """Records, for the current thread only, files opened and pickle globals resolved.

    Audit hooks cannot be removed, so one hook is installed for the session and records only
    while a recording is active."""

    _current: Audit | None = None
    _installed = False

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.unpickled: list[tuple[str, str]] = []
        self.thread = threading.get_ident()

    @classmethod
    def _hook(cls, event: str, args: tuple[Any, ...]) -> None:
        rec = cls._current
        if rec is None or threading.get_ident() != rec.thread:
            return
        if event == "open" and isinstance(args[0], (str, bytes)):
            rec.opened.append(os.fsdecode(args[0]))
        elif event == "pickle.find_class":
            rec.unpickled.append((args[0], args[1]))

    def __enter__(self) -> Audit:
        if not Audit._installed:
            sys.addaudithook(Audit._hook)
            Audit._installed = True
        Audit._current = self
        return self

    def __exit__(self, *exc: object) -> None:
        Audit._current = None


def audited_load(root: str) -> tuple[Audit, BaseException | None]:
    """The daemon's own load (its reader's), run in this process under the audit hook."""
    parent, child = Pipe()
    daemon = Daemon(PipeEnd(child), Hello(url=root, storage_options={}, retention=None))
    error: BaseException | None = None
    try:
        with Audit() as audit:
            try:
                reply = daemon.handle(LoadReq(0, LoadAsk(1, 0, 1)))
            except Exception as e:
                error = e
            else:
                # The reply names a shared-memory segment the trainer would map and unlink.
                os.unlink(os.path.join("/dev/shm", reply.segment.lstrip("/")))
    finally:
        daemon.close()
        parent.close()
        child.close()
    return audit, error


def assert_confined(audit: Audit, root: str) -> None:
    inside = os.path.abspath(step_dir(root, 1)) + os.sep
    outside = [p for p in audit.opened if not os.path.abspath(p).startswith(inside)]
    assert outside == [], f"opened outside the step directory: {outside}"
    assert audit.unpickled == [], f"unpickled on the load path: {audit.unpickled}"


# --------------------------------------------------------------------------- invariants


def check_manifest_invariants(m: fmt.Manifest) -> None:
    """What a manifest that passed validation guarantees to the code that uses it."""
    sizes = {s.file: s.nbytes for s in m.shards}
    for s in m.shards:
        assert re.fullmatch(r"shard_r[0-9]{5}(\.[0-9a-f]{16})?\.safetensors", s.file), s.file
        assert 0 <= s.rank < m.world_size
    for shard, records in m.tensors.items():
        spans = []
        for r in records.values():
            assert 0 <= r.start <= r.end <= sizes[shard]
            assert math.prod(r.shape) * fmt.DTYPE_SIZES[r.dtype] == r.end - r.start
            spans.append((r.start, r.end))
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, "overlapping tensors"


def paths(obj: Any) -> Iterator[tuple]:
    """The key path of every member of ``obj``, parents first; iteratively, as the "deep"
    mutation nests members far deeper than a recursive walk may go."""
    todo: list[tuple[tuple, Any]] = [((), obj)]
    while todo:
        prefix, node = todo.pop()
        yield prefix
        if isinstance(node, dict):
            todo.extend(((*prefix, k), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            todo.extend(((*prefix, i), v) for i, v in reversed(list(enumerate(node))))


def dumps(raw: Any) -> bytes:
    """A (mutated) manifest as JSON text. The encoder recurses once per level, and the "deep"
    mutation nests up to 1,800 levels: the recursion limit is raised for the encoder alone,
    not for the parse under test."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        return json.dumps(raw).encode()
    finally:
        sys.setrecursionlimit(limit)


def mutate(data: st.DataObject, raw: Any) -> Any:
    """Replace, delete or add one member somewhere in a parsed manifest."""
    where = data.draw(st.sampled_from(list(paths(raw))))
    op = data.draw(st.sampled_from(["replace", "delete", "add", "deep"]))
    if not where:
        return data.draw(JSON)
    parent = raw
    for k in where[:-1]:
        parent = parent[k]
    key = where[-1]
    if op == "replace":
        parent[key] = data.draw(JSON)
    elif op == "delete":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[data.draw(st.sampled_from([*HOSTILE_NAMES, "__metadata__", "0", "1"]))] = data.draw(
            JSON
        )
    elif op == "add":
        parent.append(data.draw(JSON))
    else:  # nest the member inside itself, deeper than any limit
        depth = data.draw(st.integers(min_value=100, max_value=600))
        node = parent[key]
        for _ in range(depth):
            node = data.draw(st.sampled_from([[node], {"S": node}, {"D": [["k", node]]}]))
        parent[key] = node
    return raw


def mutate_bytes(data: st.DataObject, text: bytes) -> bytes:
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "splice"]))
    i = data.draw(st.integers(min_value=0, max_value=len(text)))
    if op == "flip" and i < len(text):
        return text[:i] + bytes([text[i] ^ data.draw(st.integers(1, 255))]) + text[i + 1 :]
    if op == "truncate":
        return text[:i]
    if op == "insert":
        return text[:i] + data.draw(st.binary(max_size=8)) + text[i:]
    snippet = data.draw(st.sampled_from([b"[[[[[[[[[[", b'"../x"', b"1e999", b"-1", b"NaN", b"{}"]))
    return text[:i] + snippet + text[i:]


def parse_all(text: bytes, step: int = 1) -> None:
    """parse_manifest and check_tree; any outcome but success or CorruptCheckpointError fails.

    Parsed lazily too, with every record then used as loads and verify use them: the two
    parses refuse exactly the same manifests."""
    refused = []
    for lazy in (False, True):
        try:
            m = fmt.parse_manifest(text, path="root/manifest.json", step=step, lazy=lazy)
            for records in m.tensors.values():
                records.checked()
            for d in m.dtensors.values():
                if d.shape:  # the first rows alone, then the whole
                    d.covering(Chunk((0,) * len(d.shape), (d.shape[0] // 2, *d.shape[1:])))
                d.covering(Chunk((0,) * len(d.shape), d.shape))
                d.chunks  # noqa: B018
        except CorruptCheckpointError:
            refused.append(lazy)
            continue
        check_manifest_invariants(m)
        for rank, tree in m.trees.items():
            names = set(m.tensors[m.shard_of(rank).file])
            with contextlib.suppress(CorruptCheckpointError):
                fmt.check_tree(tree, names, path="root/step_000000000001/shard")
    assert refused in ([], [False, True]), f"refused only when lazy is {refused}"


# --------------------------------------------------------------------------- property tests


@FUZZ
@given(data=st.data())
def test_mutated_manifest_members_raise_only_corrupt(pristine, data):
    """Random members of a real manifest replaced, deleted, added or nested absurdly deep."""
    raw = json.loads(pristine[1])
    for _ in range(data.draw(st.integers(1, 3))):
        raw = mutate(data, raw)
    parse_all(dumps(raw))


def test_a_member_nested_deepest_can_be_mutated_again_and_parsed() -> None:
    """The "deep" mutation at its deepest (600 levels of the 3-deep shape: 1,800), then
    another mutation: the test's own walk and serialization of such a manifest must not
    overflow (they did, now and then, failing the fuzz tests with RecursionError), and the
    parse refuses it or takes it."""
    with open(V2_MANIFEST) as f:
        raw = json.load(f)
    node = raw["metadata"]
    for _ in range(600):
        node = {"D": [["k", node]]}
    raw["metadata"] = node
    assert len(list(paths(raw))) > 1800
    parse_all(dumps(raw), step=5)


#: A real version-2 manifest, of distributed tensors saved on two ranks.
V2_MANIFEST = os.path.join(
    os.path.dirname(__file__), "..", "fixtures", "format_v2", "step_000000000005", fmt.MANIFEST
)


@FUZZ
@given(data=st.data())
def test_mutated_version_2_manifests_raise_only_corrupt(data):
    """The same of a manifest with distributed tensors: their chunk tables, checked lazily as a
    load uses them or in full, refuse the same mutations."""
    with open(V2_MANIFEST) as f:
        raw = json.load(f)
    for _ in range(data.draw(st.integers(1, 3))):
        raw = mutate(data, raw)
    parse_all(dumps(raw), step=5)


@FUZZ
@given(data=st.data())
def test_mutated_manifest_bytes_raise_only_corrupt(pristine, data):
    """Random bytes of a real manifest flipped, cut, inserted."""
    parse_all(mutate_bytes(data, pristine[1]))


@FUZZ
@given(tree=TREE | JSON, names=st.sets(st.sampled_from(["w", "b", "", "k"]), max_size=3))
@example(tree={"T": []}, names=set())  # unhashable references: `in` would raise TypeError
@example(tree={"D": [["k", {"T": {"w": 1}}]]}, names={"w"})
@example(tree={"L": [{"V": [1]}]}, names=set())
def test_random_trees_raise_only_corrupt(tree, names):
    with contextlib.suppress(CorruptCheckpointError):
        fmt.check_tree(tree, names, path="p")


def real_header() -> bytes:
    specs = [
        fmt.TensorSpec("a", "F32", (2, 3), 0, 24),
        fmt.TensorSpec("b", "I16", (4,), 24, 32),
        fmt.TensorSpec("c", "BOOL", (0,), 32, 32),
    ]
    return fmt.build_header(specs, {"k": "v"})


@FUZZ
@given(data=st.data())
def test_mutated_shard_headers_raise_only_corrupt(data):
    """safetensors headers with random members, random bytes, and absurd length prefixes."""
    head = real_header()
    raw = json.loads(head[8:])
    choice = data.draw(st.sampled_from(["members", "bytes", "length"]))
    if choice == "members":
        text = dumps(mutate(data, raw))
        head = struct.pack("<Q", len(text)) + text
    elif choice == "bytes":
        head = mutate_bytes(data, head)
    else:
        n = data.draw(
            st.sampled_from([0, 2**64 - 1, 2**63, len(head), 7]) | st.integers(0, 2**64 - 1)
        )
        head = struct.pack("<Q", n) + head[8:]
    size = data.draw(st.sampled_from([len(head) + 32, len(head), 0, 2**40]))
    try:
        start, specs = fmt.parse_header(head, size, path="shard")
    except CorruptCheckpointError:
        return
    assert start <= size
    for s in specs.values():
        assert 0 <= s.start <= s.end <= size - start
        assert math.prod(s.shape) * fmt.DTYPE_SIZES[s.dtype] == s.end - s.start


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_daemon_load_of_mutated_manifests_stays_inside_the_step(pristine, tmp_path, data):
    """The daemon's real load on a mutated manifest, run in this process under an audit hook:
    it raises only CorruptCheckpointError (or CheckpointNotFoundError when the manifest is
    valid but has no part for rank 0), opens nothing outside the step directory, unpickles
    nothing, and leaves no shared memory behind."""
    root = str(tmp_path / "run")
    if not os.path.exists(root):
        copy_checkpoint(pristine[0], root)
    raw = json.loads(pristine[1])
    if data.draw(st.booleans()):  # aim straight at the file fields
        field = data.draw(st.sampled_from(["shard", "tensors"]))
        bad = data.draw(st.sampled_from(HOSTILE_NAMES))
        if field == "shard":
            raw["shards"][0]["file"] = bad
        else:
            raw["tensors"] = {bad: raw["tensors"][shard_of(raw)]}
    else:
        raw = mutate(data, raw)
    with open(os.path.join(step_dir(root, 1), fmt.MANIFEST), "wb") as f:
        f.write(dumps(raw))
    before = shm_segments(os.getpid())
    audit, error = audited_load(root)
    assert error is None or isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)), (
        repr(error)
    )
    assert_confined(audit, root)
    assert shm_segments(os.getpid()) == before


def test_daemon_load_of_a_real_checkpoint_opens_only_its_files(pristine, tmp_path):
    """The baseline for the audits above: a good load opens the manifest and the shard, and
    resolves no pickle global."""
    root = copy_checkpoint(pristine[0], str(tmp_path / "run"))
    audit, error = audited_load(root)
    assert error is None
    assert_confined(audit, root)
    opened = {os.path.basename(p) for p in audit.opened}
    assert opened == {fmt.MANIFEST, shard_name(root, 1)}


# --------------------------------------------------------------------------- through the manager


def edit_manifest(root: str, change: Any) -> None:
    path = os.path.join(step_dir(root, 1), fmt.MANIFEST)
    with open(path) as f:
        raw = json.load(f)
    change(raw)
    with open(path, "w") as f:
        json.dump(raw, f)


def nest(node: Any, tag: str, depth: int) -> Any:
    for _ in range(depth):
        node = {tag: node} if tag == "S" else {tag: [node]} if tag == "L" else {"D": [["k", node]]}
    return node


def _set_shape(raw: dict, shape: list[int]) -> None:
    raw["tensors"][shard_of(raw)]["model/w"]["shape"] = shape


def _set_range(raw: dict, rng: list[int]) -> None:
    raw["tensors"][shard_of(raw)]["model/w"]["byte_range"] = rng


def _overlap(raw: dict) -> None:
    t = raw["tensors"][shard_of(raw)]
    t["mask"]["byte_range"] = [t["model/w"]["byte_range"][0], t["model/w"]["byte_range"][0] + 5]


CASES = {
    "parent dir": lambda m: m["shards"][0].update(file="../secret.safetensors"),
    "absolute": lambda m: m["shards"][0].update(file="/etc/passwd"),
    "url": lambda m: m["shards"][0].update(file="s3://bucket/shard_r00000.safetensors"),
    "unicode digits": lambda m: m["shards"][0].update(
        file="shard_r\u0661\u0660\u0660\u0660\u0660.safetensors"
    ),
    "absurd shape": lambda m: _set_shape(m, [2**62, 2**62]),
    "absurd size": lambda m: m["shards"][0].update(nbytes=2**80),
    "range past the file": lambda m: _set_range(m, [0, 2**40]),
    "overlapping tensors": _overlap,
    "unknown dtype": lambda m: m["tensors"][shard_of(m)]["model/w"].update(dtype="object"),
    "unhashable tensor ref": lambda m: m["trees"].update({"0": {"T": ["model/w"]}}),
    "tree too deep": lambda m: m["trees"].update({"0": nest({"V": 1}, "S", 129)}),
    "tree deeper than pickle": lambda m: m["trees"].update({"0": nest({"V": 1}, "S", 900)}),
    "metadata too deep": lambda m: m.update(metadata={"a": json.loads("[" * 500 + "]" * 500)}),
    "metric not a number": lambda m: m.update(metrics={"loss": {"$": "x"}}),
    "metric overflows a float": lambda m: m.update(metrics={"loss": 10**400}),
    "version true": lambda m: m.update(version=True),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_hostile_manifests_through_the_manager(pristine, tmp_path, case):
    """End to end: the manager's load refuses each hostile manifest with CorruptCheckpointError
    within seconds (a hang is a failure), and the manager keeps working."""
    root = copy_checkpoint(pristine[0], str(tmp_path / "run"))
    edit_manifest(root, CASES[case])
    async with AsyncCheckpointManager(root) as mgr:
        with anyio.fail_after(20), pytest.raises(CorruptCheckpointError):
            await mgr.load(1)
        await (await mgr.save(2, {"w": torch.ones(2)}))
        assert torch.equal((await mgr.load(2))["w"], torch.ones(2))


@pytest.mark.anyio
async def test_a_partial_load_checks_the_records_it_reads(pristine, tmp_path):
    """A load checks the records it reads: overlapping tensors it selects are refused, and a
    bad record it does not read stays for ``verify`` to report (see format.ShardTensors)."""
    root = copy_checkpoint(pristine[0], str(tmp_path / "run"))
    edit_manifest(root, _overlap)  # "mask" starts inside "model/w"
    async with AsyncCheckpointManager(root) as mgr:
        with anyio.fail_after(20), pytest.raises(CorruptCheckpointError, match="overlap"):
            await mgr.load(1, keys=["model/w", "mask"])
        with anyio.fail_after(20), pytest.raises(CorruptCheckpointError, match="overlap"):
            await mgr.load(1)
        assert (await mgr.load(1, keys=["model/b"]))["model"]["b"].shape == (3,)
    edit_manifest(root, lambda m: m["tensors"][shard_of(m)]["mask"].update(dtype="object"))
    async with AsyncCheckpointManager(root) as mgr:
        got = await mgr.load(1, keys=["model"])
        assert set(got["model"]) == {"w", "b"}
        with anyio.fail_after(20), pytest.raises(CorruptCheckpointError, match="unknown dtype"):
            await mgr.load(1, keys=["mask"])


def test_tree_depth_limit_is_exact():
    ok = nest({"V": 1}, "D", fmt.MAX_TREE_DEPTH)
    fmt.check_tree(ok, set(), path="p")
    with pytest.raises(CorruptCheckpointError, match="deeper than"):
        fmt.check_tree({"D": [["k", ok]]}, set(), path="p")


@pytest.mark.anyio
async def test_deepest_allowed_state_round_trips(root):
    """A state nested MAX_TREE_DEPTH deep saves and loads: the load-side limit never refuses
    what save accepted at that depth."""
    state: Any = {"t": torch.arange(3)}
    for _ in range(fmt.MAX_TREE_DEPTH - 1):
        state = {"k": state}
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state))
        out = await mgr.load(1)
    for _ in range(fmt.MAX_TREE_DEPTH - 1):
        out = out["k"]
    assert torch.equal(out["t"], torch.arange(3))


@pytest.mark.anyio
async def test_too_deep_state_is_refused_at_save(root):
    """A state deeper than loading accepts is refused when saved, naming the limit."""
    state: Any = {"t": torch.zeros(1)}
    for _ in range(fmt.MAX_TREE_DEPTH + 100):
        state = {"k": state}
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError):
            await mgr.save(1, state)


@pytest.mark.anyio
async def test_missing_shard_is_corrupt(pristine, tmp_path):
    root = copy_checkpoint(pristine[0], str(tmp_path / "run"))
    shard = shard_name(root, 1)
    os.unlink(os.path.join(step_dir(root, 1), shard))
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(CorruptCheckpointError, match=shard):
            await mgr.load(1)


# --------------------------------------------------------------------------- no code execution


class Payload:
    """Unpickling this creates a marker directory: proof that something ran a pickle."""

    marker = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.anyio
@pytest.mark.parametrize("target", [fmt.MANIFEST, "shard"])
async def test_pickle_payloads_are_never_executed(pristine, tmp_path, target):
    """A manifest or shard replaced by a pickle whose loading would run code (as a torch.save
    file's would): load refuses it as corrupt and the code never runs. aiockpt parses only
    JSON and raw tensor bytes from storage."""
    root = copy_checkpoint(pristine[0], str(tmp_path / "run"))
    if target == "shard":
        target = shard_name(root, 1)
    Payload.marker = str(tmp_path / "pwned")
    blob = pickle.dumps({"state": Payload()})
    with open(os.path.join(step_dir(root, 1), target), "wb") as f:
        f.write(blob)
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(CorruptCheckpointError):
            await mgr.load(1)
    audit, error = audited_load(root)
    assert isinstance(error, CorruptCheckpointError)
    assert_confined(audit, root)
    assert not os.path.exists(Payload.marker)


# --------------------------------------------------------------------------- hostile keys


@pytest.mark.anyio
async def test_keys_with_slashes_and_dots_are_stored_safely(root):
    """Keys like '..', '/abs' and 'a/../b' are stored: tensor names are keys inside the shard
    and the manifest, never file paths, so they cannot reach the filesystem. The step
    directory holds exactly its shard and manifest afterwards, and every key round-trips."""
    state = {
        "..": {"..": torch.arange(2)},
        "/abs": torch.arange(3),
        "a/../b": torch.arange(4),
        "": {"~": torch.arange(5)},
        "plain": {"0": 1, 0: 2},  # same text, different types: kept apart in the tree
    }
    async with AsyncCheckpointManager(root) as mgr:
        info = await (await mgr.save(1, state))
        out = await mgr.load(1)
    assert sorted(os.listdir(info.url)) == [fmt.MANIFEST, shard_name(root, 1)]
    # nothing else: the lease, the root's identity, the step
    assert sorted(os.listdir(root)) == [LEASE_DIR, "_peer.key", "_root.json", "step_000000000001"]
    assert torch.equal(out[".."][".."], torch.arange(2))
    assert torch.equal(out["/abs"], torch.arange(3))
    assert torch.equal(out["a/../b"], torch.arange(4))
    assert torch.equal(out[""]["~"], torch.arange(5))
    assert out["plain"] == {"0": 1, 0: 2}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}, "two keys"),
        ({0: torch.zeros(1), "0": torch.ones(1)}, "two keys"),
        ({"a\x00b": torch.zeros(1)}, "NUL"),
        ({"x": {"a\x00": 1}}, "NUL"),
        ({1.5: torch.zeros(1)}, "keys must be str or int"),
        ({None: torch.zeros(1)}, "keys must be str or int"),
        ({b"k": torch.zeros(1)}, "keys must be str or int"),
        ({("a", "b"): 1}, "keys must be str or int"),
        ({True: 1}, "keys must be str or int"),
    ],
)
async def test_unsafe_keys_are_refused_at_save(root, state, why):
    """Refused, each for a reason: two keys whose tensor names collide would make one tensor
    overwrite the other; NUL ends a name for C readers of safetensors, so 'a\\0b' could alias
    'a'; other key types (float, None, bytes, tuple, bool) do not survive JSON as themselves."""
    async with AsyncCheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match=why):
            await mgr.save(1, state)
        assert await mgr.steps() == []
