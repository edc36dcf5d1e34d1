"""Storage operations are counted per kind, per save, and shown on the save's events."""

from __future__ import annotations

import threading

import anyio
import torch

from aiockpt import AsyncCheckpointManager, LatestN
from aiockpt.storage import CountingStorage, FsspecStorage, LocalStorage


def test_a_save_reports_what_it_asked_of_storage(root):
    committed = []

    def on_event(event) -> None:
        if event.name == "save.committed":
            committed.append(event)

    async def main() -> None:
        state = {"w": torch.randn(64, 64), "step": 0}
        async with AsyncCheckpointManager(
            root, retention=LatestN(1), event_handlers=[on_event]
        ) as mgr:
            for step in (1, 2, 3):
                state["w"] += 1
                await (await mgr.save(step, state))

    anyio.run(main)
    assert [e.step for e in committed] == [1, 2, 3]
    for event in committed:
        req = event.requests
        assert req is not None
        assert req["write_file"] == 1  # the shard
        assert req["put_if_absent"] == 1  # the manifest, created only if absent
        assert req["makedirs"] == 1
        assert "delete" not in req  # retention comes after the commit
        assert sum(req.values()) <= 8, req  # a handful, not a poll loop


def test_scopes_count_their_own_thread_and_nest(tmp_path):
    storage = CountingStorage(LocalStorage(str(tmp_path)))
    other_done = threading.Event()

    def other() -> None:
        storage.exists("nowhere")  # another thread: in the totals only
        other_done.set()

    with storage.scope() as outer:
        storage.makedirs("a")
        with storage.scope() as inner:
            storage.put_atomic("a/x", b"1")
            assert storage.put_if_absent("a/y", b"2")  # an optional operation, counted too
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert other_done.is_set()
    assert dict(inner) == {"put_atomic": 1, "put_if_absent": 1}
    assert dict(outer) == {"makedirs": 1, "put_atomic": 1, "put_if_absent": 1}
    assert storage.totals["exists"] == 1
    assert sum(storage.totals.values()) == 4


def test_an_optional_operation_is_there_only_when_the_backend_has_it(tmp_path):
    class Plain(LocalStorage):
        """A backend without conditional creates."""

        def __getattribute__(self, name: str):
            if name == "put_if_absent":
                raise AttributeError(name)
            return super().__getattribute__(name)

    assert not hasattr(CountingStorage(Plain(str(tmp_path))), "put_if_absent")
    assert callable(CountingStorage(FsspecStorage("memory://counting-test")).put_if_absent)
