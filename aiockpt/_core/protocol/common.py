"""The messages of the handshake, the saves, the small requests and the daemon's answers (see
the package's docstring).

This module imports nothing from aiockpt or outside the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Bumped on any change to these messages; checked by both ends in the handshake.
PROTOCOL = 19

#: How a loaded tensor lies in shared memory: (safetensors dtype, shape, byte offset).
TensorAt = tuple[str, tuple[int, ...], int]
#: A shard layout entry: (name, safetensors dtype, shape, start, end), offsets relative to the
#: data section.
LayoutEntry = tuple[str, str, tuple[int, ...], int, int]
#: A box of a global tensor: (offsets, sizes).
Box = tuple[tuple[int, ...], tuple[int, ...]]
#: A DTensor of a layout: (name, safetensors dtype, global shape, placements as text, mesh
#: shape, the box of the chunk this rank writes under ``name`` or None when it writes none).
DTensorEntry = tuple[str, str, tuple[int, ...], tuple[str, ...], tuple[int, ...], Box | None]
#: What a load wants of a distributed tensor it restores into: the target's safetensors dtype,
#: global shape, and the box this rank holds of it (None: it holds none).
Wanted = tuple[str, tuple[int, ...], Box | None]


class ProtocolMismatch(Exception):
    """The two ends speak different protocol versions (the message names both)."""


def check_protocol(theirs: object, who: str) -> None:
    """Raise :class:`ProtocolMismatch` unless ``theirs`` is this module's :data:`PROTOCOL`."""
    if theirs != PROTOCOL:
        raise ProtocolMismatch(
            f"the {who} speaks aiockpt daemon protocol {theirs!r}, this side speaks {PROTOCOL}: "
            "the trainer and the daemon must come from the same aiockpt installation"
        )


# --------------------------------------------------------------------------- shared records


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint: what ``await handle`` returns."""

    step: int
    url: str
    created_at: float
    nbytes: int
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What retention and ``best_step`` see of a committed checkpoint."""

    step: int
    created_at: float
    metrics: dict[str, Any]


# --------------------------------------------------------------------------- trainer -> daemon


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    """How a writing manager holds its root's lease (see _core.lease)."""

    #: The manager's id: a respawned daemon of the same manager resumes the lease.
    owner: str
    ttl: float
    renew_every: float
    takeover: bool = False
    #: The job the manager belongs to and its attempt (see _core.lease.job_identity): a later
    #: attempt of the same job takes the lease of an earlier one at once.
    job: str | None = None
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The lease a daemon took: its generation, whether the storage made the taking atomic,
    and what it took over (an expired or, with takeover, a live lease), if anything."""

    generation: int
    guaranteed: bool
    taken_from: str | None = None


@dataclass(frozen=True, slots=True)
class Hello:
    """Everything the daemon needs to start; sent once, answered by :class:`Ready`."""

    url: str
    storage_options: dict[str, Any]
    retention: Any  # a retention policy or None; pickled by reference
    rank: int = 0
    world_size: int = 1
    trainer_pid: int = 0
    collect_partials: bool = True
    #: Seconds the ranks of a multi-rank save wait for each other; None on one rank.
    dist_timeout: float | None = None
    #: The lease to hold (rank 0 of a writing manager); None: take none.
    lease: LeaseSpec | None = None
    #: Whether saves refer to the blocks a kept checkpoint already holds (see _daemon/dedup).
    dedup: bool = True
    #: On several ranks: the inherited file descriptor of the pipe to the trainer's relay of
    #: the job's c10d store (see _core/storeops.py); None: the ranks signal through storage.
    store_fd: int | None = None
    protocol: int = PROTOCOL
    #: The retention policy pickled on its own (``retention`` is then None): the daemon
    #: unpickles it once ``sys_path`` is on its path, so a policy of a module the trainer
    #: imports from beside its script imports in the daemon too.
    retention_pickle: bytes | None = None
    #: The trainer's ``sys.path`` (its working directory for ""), searched by the daemon
    #: after aiockpt's own folder when it unpickles the retention policy.
    sys_path: tuple[str, ...] = ()
    #: The local tier every save is committed to (an aiockpt.tiers.LocalTier), or None; then
    #: only steps with ``step % persist_every == 0`` go to the root too (docs/tiers.md).
    local: Any = None
    persist_every: int = 1
    #: With a local tier on several ranks: each rank's host (aiockpt.tiers.host_id), by rank.
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LayoutMsg:
    """A shard layout, sent once per daemon and then named by ``id``."""

    id: int
    data_start: int
    file_size: int
    #: The tensors in file order.
    specs: tuple[LayoutEntry, ...]
    #: The DTensors of the state, in tree order.
    dtensors: tuple[DTensorEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveReq:
    """Write the staged slab as this rank's shard of ``step`` and commit it."""

    uuid: str
    step: int
    slab: str
    slab_size: int
    layout_id: int
    layout: LayoutMsg | None
    tree: Any
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    #: Slabs the trainer unlinked: unmap them.
    forget: tuple[str, ...] = ()
    #: State-tree fragments the daemon does not hold yet, by id: the tree refers to a fragment
    #: by a reference string and the daemon splices in its encoded text (format.encode_tree).
    fragments: dict[int, Any] = field(default_factory=dict)
    #: Fragments and layouts no later request will refer to.
    forget_fragments: tuple[int, ...] = ()
    forget_layouts: tuple[int, ...] = ()
    #: On ranks other than 0 of a writing manager: the generation of the lease rank 0 holds,
    #: checked before this rank writes (None: rank 0, which holds it, or no lease).
    lease_generation: int | None = None
    #: A save staged in windows (see _core/windows.py): the shard file's byte ranges, in
    #: order, each sent as a :class:`WindowReady` once copied; ``slab`` is then unused.
    windows: tuple[tuple[int, int], ...] = ()
    #: With ``skip_unchanged``: the slab's copy count with this save's copy (see
    #: _trainer/staging/slabs.py: Slab.gen; 0 without it), and the tensors (indices in
    #: ``layout.specs``) this copy left as the previous one put them: the daemon may take
    #: their checksums from that save.
    copy_gen: int = 0
    unchanged: tuple[int, ...] = ()
    #: ``save(..., overwrite=True)``: a committed ``step`` is replaced, its manifest last
    #: (see docs/format.md#replacing-a-step); otherwise a committed step is refused.
    overwrite: bool = False


@dataclass(frozen=True, slots=True)
class WindowReady:
    """Window ``index`` of save ``uuid`` is staged in ``slab``, at its start; answered by a
    :class:`SlabFree` once the daemon has handed its bytes to storage. With ``error`` the
    trainer gave up staging the save: no later window comes, the save fails with it."""

    uuid: str
    index: int
    slab: str = ""
    slab_size: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ReadReq:
    """A request for the daemon's reader, answered by a :class:`Reply` with the same ``id``;
    each kind says what the reply's ``value`` holds."""

    id: int


@dataclass(frozen=True, slots=True)
class StepsReq(ReadReq):
    """The committed steps, fresh from storage: a tuple of ints, ascending."""


@dataclass(frozen=True, slots=True)
class RecordsReq(ReadReq):
    """A tuple of :class:`StepRecord`, one per committed checkpoint whose manifest reads."""


@dataclass(frozen=True, slots=True)
class CollectPartialsReq(ReadReq):
    """Remove partial step directories that no save can still be writing: a tuple of the
    root's steps removed. ``root=False``: the local tier's alone (another host's first rank:
    each host's tier is its own)."""

    root: bool = True


@dataclass(frozen=True, slots=True)
class TierBindReq(ReadReq):
    """The local tier's tie to its root, at ``open()`` (see docs/tiers.md): ``"claim"``, by
    a host's first rank, checks that the tier serves root ``root_id`` (or, new, makes it
    do so) and leaves a probe named ``probe``; ``"check"``, by the host's other ranks,
    checks that their tier is that one: the same root and the probe there; ``"done"``
    removes the probe. Value: the tier's directory as this daemon sees it."""

    root_id: str
    probe: str
    role: str = "claim"


@dataclass(frozen=True, slots=True)
class PublishFailureReq(ReadReq):
    """Tell the other ranks that this rank's save of ``step`` failed (value: None)."""

    step: int
    uuid: str
    message: str


@dataclass(frozen=True, slots=True)
class DeleteReq(ReadReq):
    """Delete the committed ``step`` as retention would, manifest first, keeping the bytes a
    kept step reads (value: whether it was anywhere). Queued behind the saves sent before
    it, on the writer's thread; the newest committed step is refused unless
    ``allow_latest``. Where there is a local tier the step goes from it and the root alike;
    ``root=False``: from the tier alone (another host's first rank); ``missing_ok``: a step
    in neither is no error (another host may hold it)."""

    step: int
    allow_latest: bool = False
    root: bool = True
    missing_ok: bool = False


@dataclass(frozen=True, slots=True)
class WarmReq(ReadReq):
    """Ready what a load of ``rank``'s tensors of ``step`` (latest when None) will check, and
    read nothing else: the manifest read and parsed, the shard's records and the rank's tree
    checked (value: None). Sent as a load(into=) starts, the daemon does this while the
    trainer walks its target; the load after it finds it done (the catalog keeps a
    manifest parsed while its bytes stay the same) and raises any error it meets."""

    step: int | None
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish what is queued, then exit."""


# --------------------------------------------------------------------------- daemon -> trainer


@dataclass(frozen=True, slots=True)
class Ready:
    """The daemon started (``error`` None) or could not (and exits)."""

    pid: int
    protocol: int = PROTOCOL
    error: BaseException | None = None
    lease: LeaseGrant | None = None
    #: The root's id (``_root.json``, see _core/identity.py): made by a writer's daemon as
    #: it takes the lease, read by the others; None where the root has none (yet).
    root_id: str | None = None


@dataclass(frozen=True, slots=True)
class SlabFree:
    """The slab's bytes are durable: the trainer may fill it again."""

    slab: str


@dataclass(frozen=True, slots=True)
class SaveDone:
    """The end of one save: committed (``info``), failed (``error``), or committed with a
    retention failure (both)."""

    uuid: str
    info: CheckpointInfo | None = None
    #: Steps retention deleted after this commit.
    deleted: tuple[int, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the :class:`ReadReq` with the same ``id``."""

    id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class EventMsg:
    """An event made in the daemon, delivered by the trainer's event dispatcher."""

    name: str
    uuid: str | None
    step: int | None
    fields: dict[str, Any]


ToDaemon = Hello | SaveReq | ReadReq | Stop
ToTrainer = Ready | SlabFree | SaveDone | Reply | EventMsg
