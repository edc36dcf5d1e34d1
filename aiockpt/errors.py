"""The exception tree of aiockpt.

Every error derives from :class:`CheckpointError` and from the built-in it resembles, so
``except ValueError`` keeps working for code that does not know aiockpt::

    CheckpointError
    ├── UnsupportedValueError (TypeError)     a state leaf that cannot be saved; names its key path
    ├── StateDictError (RuntimeError)         an object's state_dict() raised; names its key path
    ├── StagingMemoryError (ValueError)       staging_memory, or /dev/shm, too small for the state
    ├── StateChangedError (RuntimeError)      the state changed while save() copied it
    ├── InvalidStepError (ValueError)         a negative or non-int step
    │   └── StepExistsError                   a step that is already committed or in flight
    ├── CheckpointNotFoundError (LookupError) no committed checkpoint for that step / in that root
    ├── CorruptCheckpointError (ValueError)   a failed checksum or a malformed manifest or header
    ├── LoadMismatchError (ValueError)        load(into=...) met a tensor of another shape or dtype
    │   └── SavedKeyNotFoundError (KeyError)  load(keys=...) named a key path that was not saved
    ├── StorageError (OSError)                the storage failed; carries errno and the path
    ├── DaemonError (RuntimeError)            the daemon could not do what was asked
    │   ├── DaemonDiedError                   the daemon exited; carries its exit code
    │   └── DaemonStartError                  the daemon did not report READY in time
    ├── DistributedSaveError (RuntimeError)   another rank's part of a save failed; names the rank
    ├── ReadOnlyError (PermissionError)       save() on a manager opened read_only=True
    ├── RootLockedError (RuntimeError)        another writer holds the root's lease; names it
    ├── LeaseLostError (RuntimeError)         this writer's lease was taken over or ran out
    └── ManagerClosedError (RuntimeError)     the manager was used before open or after close
"""

from __future__ import annotations

__all__ = [
    "CALLER_ERRORS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DaemonDiedError",
    "DaemonError",
    "DaemonStartError",
    "DistributedSaveError",
    "InvalidStepError",
    "LeaseLostError",
    "LoadMismatchError",
    "ManagerClosedError",
    "ReadOnlyError",
    "RootLockedError",
    "SavedKeyNotFoundError",
    "StagingMemoryError",
    "StateChangedError",
    "StateDictError",
    "StepExistsError",
    "StorageError",
    "UnsupportedValueError",
]


class CheckpointError(Exception):
    """Root of every aiockpt error."""

    #: Traceback text of the same error in the daemon, when it was raised there.
    remote_traceback: str | None = None

    def __reduce__(self):  # keep extra attributes across the pipe
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state that aiockpt cannot save; the message names its key path."""

    def __init__(
        self, path: str, message: str, *, more: list[tuple[str, str]] | None = None
    ) -> None:
        text = f"{path or '<root>'}: {message}"
        if more:
            text += f"; and {len(more)} more: " + "; ".join(
                f"{p or '<root>'}: {m}" for p, m in more
            )
        super().__init__(text)
        self.path = path
        self.reason = message
        #: Every refused value of the state, (key path, why), the first one first.
        self.problems: list[tuple[str, str]] = [(path, message), *(more or [])]


class StateDictError(CheckpointError, RuntimeError):
    """An object's ``state_dict()`` raised while its state was saved (or, on a load, checked
    against what is restored into it); the message names its key path, and the error it
    raised is the ``__cause__``."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '<root>'}: {message}")
        self.path = path


class InvalidStepError(CheckpointError, ValueError):
    """A step that is not a non-negative int."""


class StepExistsError(InvalidStepError):
    """A step already committed in this root, or already being saved."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """No committed checkpoint matches."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint failed validation: bad checksum, malformed manifest or shard header."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key = key


class LoadMismatchError(CheckpointError, ValueError):
    """``load(into=...)`` found a saved value that does not fit the destination."""


class SavedKeyNotFoundError(LoadMismatchError, KeyError):
    """``load(keys=...)`` named a key path the checkpoint does not hold; the message names it
    and the close matches among the saved key paths."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return Exception.__str__(self)


class StorageError(CheckpointError, OSError):
    """The storage backend failed. ``errno`` and ``path`` are those of the failure."""

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        CheckpointError.__init__(self, message)
        self.path = path
        self.os_errno = errno

    # OSError keeps errno in a slot that Exception.__init__ leaves unset; expose ours instead.
    @property
    def errno(self) -> int | None:  # type: ignore[override]
        return self.os_errno

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DaemonError(CheckpointError, RuntimeError):
    """The daemon could not do what was asked."""


class DaemonDiedError(DaemonError):
    """The daemon process exited while work was pending."""

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DaemonStartError(DaemonError):
    """The daemon did not start or did not report READY in time."""


class DistributedSaveError(CheckpointError, RuntimeError):
    """A multi-rank save failed on some rank; ``ranks`` names which."""

    def __init__(self, message: str, *, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class StateChangedError(CheckpointError, RuntimeError):
    """The state changed (a tensor's dtype, shape or device) while save() was copying it, as
    when another thread modifies it; nothing was written."""


class StagingMemoryError(CheckpointError, ValueError):
    """Shared memory is too small for a save or a load: ``staging_memory`` too small to cut the
    shard into windows that fit (the message says the least that works), or /dev/shm without
    room for a slab or a load's tensors (the message says how much was needed, how much is
    free and what helps). Nothing was written, and a load(into=) target is unchanged."""


class ReadOnlyError(CheckpointError, PermissionError):
    """``save()`` on a manager opened with ``read_only=True``."""


class RootLockedError(CheckpointError, RuntimeError):
    """Another writer holds the root's lease (``open()`` without ``takeover=True``).

    ``holder`` describes it (host, pid, since, expires, generation as a dict) when its lease
    file could be read; None when the file there is not a lease."""

    holder: dict[str, object] | None = None


class LeaseLostError(CheckpointError, RuntimeError):
    """This writer's lease on its root was taken over by another writer, or ran out before it
    could be renewed: it commits and deletes nothing more."""


class TierMismatchError(CheckpointError, ValueError):
    """A local tier that cannot serve this manager: its directory belongs to another root,
    or the ranks of one host do not see one directory (each rank given its own, or two
    machines given one host id). Raised by ``open()`` on every rank; nothing was written."""


class ManagerClosedError(CheckpointError, RuntimeError):
    """The manager is not open: used before ``async with`` or after it closed."""


#: Mistakes of the caller's (a value that cannot be saved, a step taken, a target that does not
#: fit, a closed manager): the exception raised to the caller is the report, so their
#: ``*.exception`` events are logged at DEBUG, not ERROR.
CALLER_ERRORS: tuple[type[CheckpointError], ...] = (
    UnsupportedValueError,
    InvalidStepError,
    LoadMismatchError,
    CheckpointNotFoundError,
    ManagerClosedError,
    StagingMemoryError,
)
