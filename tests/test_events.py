from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import types
from collections import defaultdict
from importlib.metadata import EntryPoint
from typing import Any

import anyio
import psutil
import pytest
import torch
import torch.distributed as dist
from _support.roots import live_daemons

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt._core import format as fmt
from aiockpt.errors import (
    CheckpointNotFoundError,
    DaemonDiedError,
    InvalidStepError,
    StorageError,
    UnsupportedValueError,
)
from aiockpt.events import (
    ENTRY_POINT_GROUP,
    Event,
    EventDispatcher,
    JsonLinesHandler,
    RecordedError,
    ScopeTracker,
    entry_point_handlers,
    process_group_info,
)

pytestmark = pytest.mark.anyio

SAVE_PHASES = ["save.start", "save.staged", "save.written", "save.committed", "save.end"]
PLUGIN_ENV = "AIOCKPT_TEST_HANDLER_PATH"  # read by tests/plugins/aiockpt-test-handler


class Recorder:
    """A handler keeping every event it gets."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def ops(self) -> dict[str, list[Event]]:
        """Events of each operation, by uuid, in delivery order."""
        out: dict[str, list[Event]] = defaultdict(list)
        for e in self.events:
            if e.uuid is not None:
                out[e.uuid].append(e)
        return dict(out)

    def names(self, uuid: str) -> list[str]:
        return [e.name for e in self.events if e.uuid == uuid]


class RecordingScope:
    """A context manager that remembers how it was entered and exited."""

    def __init__(self, event: Event) -> None:
        self.start = event
        self.entered = False
        self.exit_args: tuple[Any, Any, Any] | None = None

    def __enter__(self) -> RecordingScope:
        self.entered = True
        return self

    def __exit__(self, *args: Any) -> bool:
        self.exit_args = args
        return False


class Scopes:
    """A ScopeTracker whose factory keeps every scope it made."""

    def __init__(self) -> None:
        self.made: list[RecordingScope] = []
        self.tracker = ScopeTracker(self.factory)

    def factory(self, event: Event) -> RecordingScope:
        scope = RecordingScope(event)
        self.made.append(scope)
        return scope

    def by_uuid(self, uuid: str) -> RecordingScope:
        (scope,) = [s for s in self.made if s.start.uuid == uuid]
        return scope


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "n": seed}


def daemon_process() -> psutil.Process:
    (proc,) = live_daemons()
    return proc


def assert_exited_with_error(scope: RecordingScope, event: Event) -> RecordedError:
    assert scope.exit_args is not None
    exc_type, exc, tb = scope.exit_args
    assert exc_type is RecordedError
    assert isinstance(exc, RecordedError)
    assert isinstance(tb, types.TracebackType)
    assert event.error is not None
    assert exc.type_name == event.error["type"]
    assert exc.message == event.error["message"]
    assert exc.traceback_text == event.error["traceback"]
    return exc


# --------------------------------------------------------------------------- operations


async def test_saves_and_loads_yield_start_phases_end_with_one_uuid(root):
    rec, scopes = Recorder(), Scopes()
    async with AsyncCheckpointManager(
        root, retention=LatestN(2), event_handlers=[rec, scopes.tracker]
    ) as mgr:
        handles = [await mgr.save(step, state(step)) for step in (1, 2, 3)]
        infos = [await h for h in handles]
        loaded = await mgr.load(2)
        latest = await mgr.load()
    assert loaded["n"] == 2
    assert latest["n"] == 3

    ops = rec.ops()
    assert len(ops) == 5  # three saves, two loads: one uuid each
    for handle, info in zip(handles, infos, strict=True):
        events = ops[handle.uuid]
        names = [e.name for e in events]
        assert [n for n in names if n != "retention.delete"] == SAVE_PHASES
        assert {e.step for e in events if e.name != "retention.delete"} == {handle.step}
        assert [e.where for e in events if e.name in SAVE_PHASES] == [
            "trainer",
            "trainer",
            "daemon",
            "daemon",
            "trainer",
        ]
        for e in events[1:]:
            if e.name in SAVE_PHASES:
                assert e.nbytes == info.nbytes
                assert e.duration_s is not None
                assert e.duration_s >= 0
        assert scopes.by_uuid(handle.uuid).exit_args == (None, None, None)
    # LatestN(2): the save of step 3 let step 1 go, after its commit and before its end
    deletes = [e for e in rec.events if e.name == "retention.delete"]
    assert [(e.uuid, e.step) for e in deletes] == [(handles[2].uuid, 1)]
    names3 = rec.names(handles[2].uuid)
    assert (
        names3.index("save.committed") < names3.index("retention.delete") < names3.index("save.end")
    )

    loads = [events for events in ops.values() if events[0].name == "load.start"]
    assert [[e.name for e in events] for events in loads] == [["load.start", "load.end"]] * 2
    assert [events[-1].step for events in loads] == [2, 3]  # load() names the step it found
    assert all(events[-1].nbytes > 0 for events in loads)

    assert rec.events[0].name == "daemon.spawn"
    assert rec.events[-1].name == "daemon.exit"
    for e in rec.events:
        assert (e.rank, e.world_size, e.process_group) == (0, 1, {})
        assert e.error is None
        assert Event.from_json(e.to_json()) == e
    assert scopes.tracker.open_scopes() == []
    assert all(s.entered for s in scopes.made)


async def test_save_failing_in_the_daemon_yields_exception_with_the_error(root, caplog):
    rec, scopes = Recorder(), Scopes()
    async with AsyncCheckpointManager(root, event_handlers=[rec, scopes.tracker]) as mgr:
        # the step's directory is taken by a file: the daemon's write fails
        with open(os.path.join(root, fmt.step_dirname(5)), "w"):
            pass
        handle = await mgr.save(5, state())
        with pytest.raises(StorageError, match=fmt.step_dirname(5)) as raised:
            await handle
        ok = await (await mgr.save(6, state()))
    assert ok.step == 6

    assert rec.names(handle.uuid) == ["save.start", "save.staged", "save.exception"]
    event = rec.ops()[handle.uuid][-1]
    assert event.step == 5
    assert event.error is not None
    assert event.error["type"] == f"{type(raised.value).__module__}.{type(raised.value).__name__}"
    assert event.error["message"] == str(raised.value)
    assert "Raised in the daemon" in event.error["traceback"]
    assert fmt.step_dirname(5) in event.error["traceback"]
    exc = assert_exited_with_error(scopes.by_uuid(handle.uuid), event)
    assert str(exc).startswith(event.error["type"])
    assert scopes.by_uuid(ok_uuid(rec, 6)).exit_args == (None, None, None)
    assert scopes.tracker.open_scopes() == []
    errors = [r for r in caplog.records if r.name == "aiockpt" and r.levelno == logging.ERROR]
    assert [r.aiockpt_event.name for r in errors] == ["save.exception"]
    # One line: the traceback is the caller's (the handle raised it) and the event's.
    assert "Raised in the daemon" not in errors[0].getMessage()
    assert "Raised in the daemon" in errors[0].aiockpt_event.error["traceback"]


def ok_uuid(rec: Recorder, step: int) -> str:
    (uuid,) = {e.uuid for e in rec.events if e.name == "save.end" and e.step == step}
    assert uuid is not None
    return uuid


async def test_a_killed_daemon_ends_pending_saves_in_exceptions(root):
    rec, scopes = Recorder(), Scopes()
    async with AsyncCheckpointManager(root, event_handlers=[rec, scopes.tracker]) as mgr:
        proc = daemon_process()
        proc.send_signal(signal.SIGSTOP)  # the save stays pending until the kill
        handle = await mgr.save(1, state())
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(DaemonDiedError):
            await handle
        await (await mgr.save(2, state()))  # a new daemon takes over

    assert rec.names(handle.uuid) == ["save.start", "save.staged", "save.exception"]
    event = rec.ops()[handle.uuid][-1]
    assert event.error is not None
    assert event.error["type"] == "aiockpt.errors.DaemonDiedError"
    assert f"-{signal.SIGKILL.value}" in event.error["message"]
    assert_exited_with_error(scopes.by_uuid(handle.uuid), event)
    daemon_events = [e.name for e in rec.events if e.name.startswith("daemon.")]
    assert daemon_events == [
        "daemon.spawn",
        "daemon.exit",
        "daemon.spawn",
        "daemon.restart",
        "daemon.exit",
    ]
    assert rec.names(ok_uuid(rec, 2)) == SAVE_PHASES
    assert scopes.tracker.open_scopes() == []


async def test_refused_and_cancelled_operations_end_in_exceptions(root):
    rec, scopes = Recorder(), Scopes()
    async with AsyncCheckpointManager(root, event_handlers=[rec, scopes.tracker]) as mgr:
        with pytest.raises(InvalidStepError):
            await mgr.save(-1, state())
        with pytest.raises(UnsupportedValueError):
            await mgr.save(1, {"x": object()})
        with pytest.raises(CheckpointNotFoundError):
            await mgr.load(99)
        with anyio.CancelScope() as cancelled:
            cancelled.cancel()
            await mgr.save(2, state())
        assert cancelled.cancelled_caught
        await (await mgr.save(3, state()))

    ops = rec.ops()
    assert len(ops) == 5
    failed = {
        uuid: events[-1] for uuid, events in ops.items() if events[-1].name.endswith(".exception")
    }
    assert len(failed) == 4
    kinds = sorted(e.error["type"].rsplit(".", 1)[-1] for e in failed.values() if e.error)
    assert kinds == [
        "CancelledError",
        "CheckpointNotFoundError",
        "InvalidStepError",
        "UnsupportedValueError",
    ]
    for uuid, event in failed.items():
        assert [e.name.split(".")[1] for e in ops[uuid]] == ["start", "exception"]
        assert_exited_with_error(scopes.by_uuid(uuid), event)
    assert rec.names(ok_uuid(rec, 3)) == SAVE_PHASES
    assert scopes.tracker.open_scopes() == []


async def test_closing_with_saves_in_flight_ends_every_operation(root):
    rec, scopes = Recorder(), Scopes()
    async with AsyncCheckpointManager(root, event_handlers=[rec, scopes.tracker]) as mgr:
        handles = [await mgr.save(step, state(step)) for step in range(1, 6)]
    # not awaited: closing waits for them
    assert all(h.done() for h in handles)
    for h in handles:
        assert rec.names(h.uuid) == SAVE_PHASES
    assert len(scopes.made) == 5
    assert scopes.tracker.open_scopes() == []


async def test_a_raising_handler_breaks_nothing_and_is_logged_once(root, caplog):
    calls = 0

    def broken(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("handler bug")

    rec = Recorder()
    async with AsyncCheckpointManager(root, event_handlers=[broken, rec]) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, state(step)))
        assert (await mgr.load())["n"] == 3
    assert await_all_ok(rec)
    assert calls == len(rec.events)  # still called for every event, before the next handler
    logged = [r for r in caplog.records if "event handler" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].levelno == logging.ERROR
    assert logged[0].exc_info is not None
    assert "handler bug" in str(logged[0].exc_info[1])


def await_all_ok(rec: Recorder) -> bool:
    return not [e for e in rec.events if e.name.endswith(".exception")] and len(rec.ops()) == 4


def test_handlers_must_be_callable(root):
    with pytest.raises(TypeError, match="must be callable"):
        AsyncCheckpointManager(root, event_handlers=["not a handler"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be callable"):
        ScopeTracker(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- logging


async def test_log_levels(root, caplog):
    caplog.set_level(logging.DEBUG, logger="aiockpt")
    async with AsyncCheckpointManager(root) as mgr:
        await (await mgr.save(1, state()))
        with pytest.raises(InvalidStepError):
            await mgr.save(1, state())  # already committed
        await mgr.load(1)
    levels: dict[str, set[int]] = defaultdict(set)
    for r in caplog.records:
        if r.name == "aiockpt" and hasattr(r, "aiockpt_event"):
            levels[r.aiockpt_event.name].add(r.levelno)
    debug, info = {logging.DEBUG}, {logging.INFO}
    assert levels == {
        "daemon.spawn": info,
        "lease.acquired": info,
        "save.start": debug,
        "save.staged": debug,
        "save.written": debug,
        "save.committed": debug,
        "save.end": info,
        # A mistake of the caller's: the exception raised to it is the report.
        "save.exception": debug,
        "load.start": debug,
        "load.end": info,
        "daemon.exit": info,
    }
    assert [r for r in caplog.records if r.levelno == logging.ERROR] == []
    (exc_record,) = [r for r in caplog.records if r.getMessage().startswith("save.exception")]
    message = exc_record.getMessage()
    assert message.startswith("save.exception step=1 uuid=")
    assert "already committed" in message
    assert "Traceback (most recent call last)" in message
    (end,) = [r for r in caplog.records if r.getMessage().startswith("save.end")]
    assert "duration_s=" in end.getMessage()
    assert "nbytes=" in end.getMessage()


# --------------------------------------------------------------------------- JSON lines


async def test_json_lines_handler_appends_one_parsable_object_per_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"earlier": "run"}\n')
    recs = []
    for run in range(2):  # two managers append to the same file
        rec = Recorder()
        recs.append(rec)
        handler = JsonLinesHandler(path)
        async with AsyncCheckpointManager(
            tmp_path / f"run{run}", event_handlers=[handler, rec]
        ) as mgr:
            await (await mgr.save(1, state()))
            with pytest.raises(InvalidStepError):
                await mgr.save(1, state())  # an exception event: a multi-line traceback
            await mgr.load()
            # flushed per event: what is delivered is already in the file
            on_disk = path.read_text().splitlines()
            assert Event.from_json(on_disk[-1]) == rec.events[-1]
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"earlier": "run"}
    parsed = [Event.from_json(line) for line in lines[1:]]
    assert parsed == recs[0].events + recs[1].events
    assert len({e.uuid for e in parsed if e.name == "save.exception"}) == 2
    for line in lines[1:]:
        assert set(json.loads(line)) == set(Event.__dataclass_fields__)


def test_json_lines_handler_refuses_a_path_it_cannot_open(tmp_path):
    with pytest.raises(FileNotFoundError):
        JsonLinesHandler(tmp_path / "missing" / "events.jsonl")


def test_event_from_json_refuses_unknown_fields():
    with pytest.raises(ValueError, match="unknown event fields"):
        Event.from_json(
            '{"name": "save.end", "uuid": null, "step": 1, "rank": 0, '
            '"world_size": 1, "colour": "red"}'
        )
    with pytest.raises(ValueError, match="JSON object"):
        Event.from_json("[1, 2]")


# --------------------------------------------------------------------------- scope tracking


def test_scope_tracker_never_leaks_a_scope(caplog):
    made: list[RecordingScope] = []

    def factory(event: Event) -> Any:
        if event.step == 13:
            raise RuntimeError("no span for you")
        scope = RecordingScope(event)
        if event.step == 7:
            scope.__exit__ = _raise  # type: ignore[method-assign]
        made.append(scope)
        return scope

    tracker = ScopeTracker(factory)
    events = EventDispatcher([tracker])
    events.emit("save.start", uuid="a", step=13)  # the factory fails: nothing to leak
    events.emit("save.exception", uuid="a", step=13, error=RuntimeError("x"))
    events.emit("load.start", uuid="b", step=7)
    events.emit("load.end", uuid="b", step=7)  # __exit__ raises: the scope is gone anyway
    events.emit("save.start", uuid="c", step=8)
    assert tracker.scope("c") is made[-1]
    events.emit("save.start", uuid="c", step=8)  # a second start does not replace the scope
    assert tracker.open_scopes() == ["c"]
    events.close()  # the manager closed before "c" ended
    assert tracker.open_scopes() == []
    assert events.open_operations() == []
    closed = made[-1]
    assert closed.exit_args is not None
    assert closed.exit_args[0] is RecordedError
    assert "closed before this save" in str(closed.exit_args[1])
    with pytest.raises(KeyError):
        tracker.scope("c")
    # one log line for the tracker, however many times it failed
    assert len([r for r in caplog.records if "event handler" in r.getMessage()]) == 1


def _raise(*args: Any) -> None:
    raise RuntimeError("exit failed")


def test_dispatcher_times_operations_and_refuses_unknown_names():
    rec = Recorder()
    events = EventDispatcher([rec], rank=3, world_size=8, process_group={"name": "g"})
    events.emit("save.start", uuid="u", step=1)
    events.emit("save.end", uuid="u", step=1)
    events.emit("load.start", uuid="v", step=1)
    events.emit("load.end", uuid="v", step=1, duration_s=0.25)
    assert rec.events[1].duration_s is not None
    assert rec.events[1].duration_s >= 0
    assert rec.events[3].duration_s == 0.25  # a duration given is kept
    assert {(e.rank, e.world_size, e.process_group["name"]) for e in rec.events} == {(3, 8, "g")}
    with pytest.raises(ValueError, match="unknown event name"):
        events.emit("save.begin", uuid="w", step=1)
    with pytest.raises(ValueError, match="only with them"):
        events.emit("save.exception", uuid="w", step=1)
    with pytest.raises(ValueError, match="only with them"):
        events.emit("save.end", uuid="w", step=1, error=RuntimeError("x"))


def test_scope_tracker_exits_with_an_error_even_when_none_was_recorded():
    scopes = Scopes()
    start = Event("load.start", "u", 1, 0, 1)
    scopes.tracker(start)
    scopes.tracker(Event("load.exception", "u", 1, 0, 1))  # e.g. read back from an old file
    assert scopes.tracker.open_scopes() == []
    exit_args = scopes.by_uuid("u").exit_args
    assert exit_args is not None
    assert "carried no error" in str(exit_args[1])


# --------------------------------------------------------------------------- process groups

CUSTOM_BACKEND = "aiockpt_evtest"


def _gloo_under_another_name(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """A real gloo group registered under a backend name of its own, so that a group's backend
    differs from the default group's in a CPU-only, single-process test."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@pytest.fixture
def default_gloo(tmp_path):
    """The default process group: gloo, world size 1, in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0, world_size=1)
    if not hasattr(dist.Backend, CUSTOM_BACKEND.upper()):
        dist.Backend.register_backend(CUSTOM_BACKEND, _gloo_under_another_name, devices=["cpu"])
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", CUSTOM_BACKEND])
async def test_events_carry_the_group_passed_not_the_default(root, default_gloo, backend):
    group = dist.new_group([0], backend=backend)
    rec = Recorder()
    async with AsyncCheckpointManager(root, process_group=group, event_handlers=[rec]) as mgr:
        await (await mgr.save(1, state()))
        await mgr.load(1)
    default = process_group_info()
    assert default == {"backend": "gloo", "name": "0", "size": 1, "rank": 0}
    expected = {
        "backend": backend,
        "name": dist._get_process_group_name(group),
        "size": 1,
        "rank": 0,
    }
    assert expected["name"] != default["name"]
    assert len(rec.events) == 10  # lease.acquired, then 9 of the save and the load
    for e in rec.events:
        assert e.process_group == expected
        assert json.loads(e.to_json())["process_group"] == expected


# One rank of a two-rank gloo run: the default group is both ranks; each rank checkpoints with
# a group of its own (size 1), so name, size and rank all differ from the default group's.
RANK_SCRIPT = """
import json, sys
import anyio, torch, torch.distributed as dist
from aiockpt import AsyncCheckpointManager
from aiockpt.events import JsonLinesHandler

rank, store, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
mine = groups[rank]


async def main():
    handler = JsonLinesHandler(out + ".jsonl")
    async with AsyncCheckpointManager(root, process_group=mine, event_handlers=[handler]) as m:
        await (await m.save(1, {"w": torch.full((4,), float(rank))}))
        await m.load(1)


anyio.run(main)
with open(out + ".truth", "w") as f:
    json.dump({"name": dist._get_process_group_name(mine), "world": dist.get_world_size()}, f)
dist.destroy_process_group()
"""


def test_two_gloo_ranks_each_passing_its_own_group(tmp_path):
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                str(rank),
                str(tmp_path / "store"),
                str(tmp_path / f"root{rank}"),
                str(tmp_path / f"rank{rank}"),
            ]
        )
        for rank in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    names = set()
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"rank{rank}.truth").read_text())
        assert truth["world"] == 2
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        events = [Event.from_json(line) for line in lines]
        assert [e.name for e in events if e.uuid is not None] == [
            *SAVE_PHASES,
            "load.start",
            "load.end",
        ]
        for e in events:
            # the default group would say size 2, name "0", and rank 1 on the second rank
            assert e.process_group == {
                "backend": "gloo",
                "name": truth["name"],
                "size": 1,
                "rank": 0,
            }
            assert (e.rank, e.world_size) == (0, 1)
        names.add(truth["name"])
    assert len(names) == 2
    assert "0" not in names


async def test_without_a_group_events_carry_the_default_group(root, default_gloo):
    rec = Recorder()
    async with AsyncCheckpointManager(root, event_handlers=[rec]) as mgr:
        await (await mgr.save(1, state()))
    assert {json.dumps(e.process_group, sort_keys=True) for e in rec.events} == {
        json.dumps({"backend": "gloo", "name": "0", "size": 1, "rank": 0}, sort_keys=True)
    }


def test_process_group_info_refuses_what_is_not_a_group(default_gloo):
    with pytest.raises(TypeError, match="must be a torch.distributed ProcessGroup"):
        process_group_info("gloo")
    with pytest.raises(ValueError, match="not a member"):
        process_group_info(dist.GroupMember.NON_GROUP_MEMBER)


async def test_a_manager_refuses_a_process_group_that_is_not_one(root, default_gloo):
    manager = AsyncCheckpointManager(root, process_group="gloo")
    with pytest.raises(TypeError, match="must be a torch.distributed ProcessGroup, not str"):
        await manager.open()


def test_process_group_info_is_empty_without_torch_distributed():
    assert not dist.is_initialized()
    assert process_group_info() == {}


# --------------------------------------------------------------------------- entry points


async def test_an_entry_point_handler_receives_events_with_code_handlers(
    root, tmp_path, monkeypatch
):
    path = tmp_path / "plugin.jsonl"
    monkeypatch.setenv(PLUGIN_ENV, str(path))
    rec = Recorder()
    async with AsyncCheckpointManager(root, event_handlers=[rec]) as mgr:
        handle = await mgr.save(1, state())
        await handle
    monkeypatch.delenv(PLUGIN_ENV)
    from_plugin = [Event.from_json(line) for line in path.read_text().splitlines()]
    assert from_plugin == rec.events
    assert [e.name for e in from_plugin if e.uuid == handle.uuid] == SAVE_PHASES


def test_entry_point_handlers_leave_out_broken_plugins(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(PLUGIN_ENV, str(tmp_path / "x.jsonl"))
    good = EntryPoint("good", "aiockpt_test_handler:make_handler", ENTRY_POINT_GROUP)
    broken = [
        EntryPoint("missing", "aiockpt_no_such_module:make", ENTRY_POINT_GROUP),
        EntryPoint("not-callable", "aiockpt_test_handler:ENV", ENTRY_POINT_GROUP),
        EntryPoint("factory-raises", "json:dumps", ENTRY_POINT_GROUP),  # dumps() needs an arg
        EntryPoint("returns-a-str", "os:getcwd", ENTRY_POINT_GROUP),
    ]
    handlers = entry_point_handlers([*broken, good])
    assert len(handlers) == 1
    assert type(handlers[0]).__name__ == "Recorder"
    logged = sorted(r.args[0] for r in caplog.records if r.levelno == logging.ERROR and r.exc_info)
    assert logged == ["factory-raises", "missing", "not-callable", "returns-a-str"]
    # each call makes new handlers: one per manager
    assert entry_point_handlers([good])[0] is not entry_point_handlers([good])[0]
