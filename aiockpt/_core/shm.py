"""POSIX shared-memory segments, owned explicitly.

``multiprocessing.shared_memory`` registers every segment with a resource tracker that unlinks
it when *that* process exits, even when another process still needs it (fixed only in 3.13 with
``track=False``). Slabs cross processes by design, so aiockpt owns their lifetime itself: the
trainer creates and unlinks them, and the daemon unlinks what it knows of if the trainer dies.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import mmap
import os
import secrets

from ..errors import StagingMemoryError

PREFIX = "aiockpt"
SHM_DIR = "/dev/shm"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def new_name(kind: str) -> str:
    return f"/{PREFIX}-{os.getpid()}-{kind}-{secrets.token_hex(6)}"


class Segment:
    """A mapped shared-memory segment. ``buf`` is a writable memoryview of the whole mapping."""

    __slots__ = ("buf", "mm", "name", "size")

    def __init__(
        self, name: str, size: int, *, create: bool, populate: bool = True, kind: str = "slab"
    ) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, mode=0o600)
        try:
            if create:
                # At least one byte: an empty segment is still mapped (below), and mmap refuses
                # a length past the end of the file.
                os.ftruncate(fd, max(size, 1))
                reserve(fd, max(size, 1), kind)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared memory {name} is smaller than {size} bytes")
            # mmap of length 0 is an error; an empty save still gets a one-byte segment.
            # MAP_POPULATE maps every page in at once, in the kernel: for a segment that
            # exists (attached), cheaper than a fault per 4 KiB page on first touch (a 1 GiB
            # slab has 262,144). Pages that do not exist yet are made
            # faster by touching them from the process (see staging.Slab), and not at all
            # for a segment that a read fills at once: zeroing them first doubles the work.
            flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
            self.mm = mmap.mmap(fd, max(size, 1), flags=flags)
        except BaseException:
            os.close(fd)
            if create:
                unlink(name)
            raise
        os.close(fd)
        self.name = name
        self.size = size
        self.buf = memoryview(self.mm)

    @classmethod
    def create(cls, size: int, kind: str = "slab", *, populate: bool = True) -> Segment:
        return cls(new_name(kind), size, create=True, populate=populate, kind=kind)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        return cls(name, size, create=False)

    def close(self) -> None:
        """Unmap (again is a no-op). Every view of ``buf`` (numpy, torch.frombuffer) must be
        dropped first: torch.frombuffer holds ``buf`` itself, not a buffer export, so closing
        under a tensor leaves it pointing at unmapped memory. Where views may outlive their
        owner (the trainer's), drop every reference to the segment instead: the mapping is
        unmapped with the last of them."""
        self.buf.release()
        self.mm.close()

    def unlink(self) -> None:
        unlink(self.name)


def reserve(fd: int, size: int, kind: str) -> None:
    """Allocate the pages of a new segment now, so that a /dev/shm too small for it is an
    error here rather than a SIGBUS at the first write to a page it cannot back (a tmpfs
    file is sparse: ftruncate promises nothing) or EFAULT in a read into it. The pages are
    zeroed once either way, here or at the first touch."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise StagingMemoryError(_short_of(size, kind)) from e


def free_bytes() -> int | None:
    """The bytes /dev/shm has free now (None where it cannot be told)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _short_of(size: int, kind: str) -> str:
    """What to say when a segment of ``size`` bytes does not fit in /dev/shm."""
    free = free_bytes()
    has = "an unknown amount" if free is None else f"{free} bytes ({free / 2**20:.1f} MiB)"
    room = (
        f"{SHM_DIR} has {has} free. A container's /dev/shm is 64 MiB unless raised "
        "(docker run --shm-size, a memory-backed emptyDir on Kubernetes)"
    )
    need = f"{size} bytes ({size / 2**20:.1f} MiB) of shared memory"
    if kind == "load":  # the daemon's segment for the tensors load() returns
        return (
            f"load() needs {need} for the tensors it returns, and {room}; or load part of "
            "the checkpoint with keys=, or load(into=...) existing tensors, which reads "
            "through windows under staging_memory="
        )
    return (
        f"staging needs {need} for this state's shard, and {room}; or cap the staging with "
        "staging_memory= (a shard larger than its share is staged in windows), or lower "
        "max_pending (slabs held for saves in flight)"
    )


def trainer_segments(pid: int) -> list[str]:
    """Names of the segments process ``pid`` created (Linux shows them in /dev/shm)."""
    prefix = f"{PREFIX}-{pid}-"
    try:
        return [f"/{n}" for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError:
        return []


def sweep_orphans() -> dict[str, int]:
    """Unlink the segments of aiockpt processes that are gone; return their sizes by name.

    A job killed whole (SIGKILL from a scheduler) leaves its slabs behind: nobody was left to
    unlink them. A segment's name carries its creator's pid; one whose creator no longer exists
    is unlinked. A live process's segments, this one's and any other's, are never touched (a
    pid that was reused counts as live: the segment stays, which is safe). Unlinking only
    removes the name: a daemon still finishing a dead trainer's save keeps its mapping.

    Pids are this process's pid namespace's: where containers share one /dev/shm but not their
    pid namespace, a neighbour's pids look dead, so only segments owned by this user are swept
    and the sweep can be turned off with ``AIOCKPT_NO_SHM_SWEEP=1``.
    """
    if os.environ.get("AIOCKPT_NO_SHM_SWEEP") == "1":
        return {}
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return {}
    swept: dict[str, int] = {}
    for name in sorted(names):
        prefix, _, rest = name.partition("-")
        pid_text = rest.partition("-")[0]
        if prefix != PREFIX or not pid_text.isascii() or not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(OSError):
                st = os.stat(f"/dev/shm/{name}")
                if st.st_uid == os.getuid():
                    unlink(f"/{name}")
                    swept[f"/{name}"] = st.st_size
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(name)
