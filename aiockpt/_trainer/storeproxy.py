"""The trainer's relay of the job's c10d store to its daemon (see aiockpt/_core/storeops.py).

The daemon never imports torch (that would add torch's import time and memory to each rank's
daemon), so the store a multi-rank commit signals through is reached here, in the trainer
process, by a thread that answers the daemon's calls on a pipe of their own. The thread spends
its life blocked in the pipe or in the store, both outside the GIL, and never waits for the
trainer's event loop: a commit goes on while the training step runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from .._core.storeops import StoreTimeout, StoreUnreachable, serve


def group_store(pg: Any) -> Any | None:
    """The store the process group ``pg`` was made with; None where torch keeps none for it
    (then the ranks signal through the checkpoint's storage instead)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_process_group_store(pg)
    except (AttributeError, KeyError, RuntimeError):
        return None


class TorchStoreOps:
    """:class:`~aiockpt._core.storeops.StoreOps` on a torch.distributed ``Store``, through a
    connection of its own (a clone), so a long wait here never holds up the process group's
    own calls. A connection whose call failed or timed out is dropped and made again.
    Raises StoreTimeout and StoreUnreachable, never torch's own errors."""

    def __init__(self, store: Any) -> None:
        self._template = store
        self._store: Any = None

    def connect(self) -> TorchStoreOps:
        """Make the connection now rather than at the first call (which then costs nothing),
        and return self. Where the store cannot be reached, the first call says so."""
        with contextlib.suppress(Exception):
            self._client()
        return self

    def _client(self) -> Any:
        if self._store is None:
            self._store = own_connection(self._template)
        return self._store

    def _run(self, call: Any, timeout: float | None = None) -> Any:
        t0 = time.monotonic()
        try:
            return call(self._client())
        except Exception as e:
            self._store = None  # a reply may still be on its way on that connection
            # Stores say "timed out" in different words; the clock does not.
            if timeout is not None and time.monotonic() - t0 >= timeout * 0.9:
                raise StoreTimeout(f"{type(e).__name__}: {e}") from None
            raise StoreUnreachable(f"the job's store failed: {type(e).__name__}: {e}") from None

    def set_if_absent(self, keys: Sequence[str], value: bytes) -> list[bytes]:
        # compare_set with an empty expected value sets a key only where it is not set.
        return self._run(lambda s: [s.compare_set(k, b"", value) for k in keys])

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        span = timedelta(seconds=max(timeout, 0.001))
        self._run(lambda s: s.wait(list(keys), span), timeout)

    def get(self, keys: Sequence[str]) -> list[bytes]:
        return self._run(lambda s: list(s.multi_get(list(keys))))

    def check(self, keys: Sequence[str]) -> list[bool]:
        return self._run(lambda s: [bool(s.check([k])) for k in keys])

    def delete(self, keys: Sequence[str]) -> None:
        self._run(lambda s: [s.delete_key(k) for k in keys])


def own_connection(store: Any) -> Any:
    """A connection to ``store``'s server of our own. Keys need no prefix of the group's:
    they hold the save's uuid. A TCPStore client is made afresh from its address (``clone()``
    of a client is far slower than a new client); any other store is cloned."""
    import torch.distributed as dist

    inner = getattr(store, "_underlying_non_prefix_store", store)
    if isinstance(inner, dist.TCPStore):
        timeout = inner.timeout  # type: ignore[attr-defined]  # a Store property the stubs lack
        return dist.TCPStore(inner.host, inner.port, None, False, timeout, wait_for_workers=False)
    return store.clone()


def start_relay(store: Any) -> Connection:
    """A pipe end for a daemon to inherit; a thread answers the calls that come on it with
    ``store`` until the daemon closes it (or exits). Close this end once the daemon has it."""
    ours, theirs = Pipe(duplex=True)
    thread = threading.Thread(
        target=_relay, args=(ours, TorchStoreOps(store)), name="aiockpt-store-relay", daemon=True
    )
    thread.start()
    return theirs


def _relay(conn: Connection, ops: TorchStoreOps) -> None:
    # Connected as the daemon starts, not when the first commit needs it: every rank's
    # first part would come at once, and a TCPStore accepts many clients connecting
    # together far more slowly than the same clients one at a time.
    ops.connect()
    try:
        serve(conn, ops)
    finally:
        conn.close()
