"""The messages between a manager and its daemon: one frozen dataclass per request and reply.

Both ends are this package, so the pipe carries pickled instances of these classes; what
comes from *storage* is never unpickled. Messages stay small: names, layouts, JSON-able trees
and replies, never tensor bytes (those travel through shared memory).

The conversation:

- The trainer sends :class:`Hello` first; the daemon answers :class:`Ready` (or ``Ready`` with
  an error, and exits). Each side checks the other's :data:`PROTOCOL`, so a daemon and a manager
  of different versions never talk past each other.
- :class:`SaveReq` goes to the daemon's writer, in order; the daemon answers
  :class:`SlabFree` once the slab's bytes are durable, then one :class:`SaveDone`. A save
  staged in windows sends its ``SaveReq`` first, then a :class:`WindowReady` per window, each
  answered by a ``SlabFree`` once the daemon has written its bytes.
- A :class:`ReadReq` (steps, records, load, …) goes to the daemon's reader and is answered by
  one :class:`Reply` with the same ``id``, whose ``value`` is the request's reply type.
- A load is one :class:`ReadReq` per mode, each naming what it reads by a :class:`LoadAsk`:
  :class:`LoadReq` (into a lent slab or a fresh segment), :class:`CappedLoadReq` then
  :class:`CappedWindowReq` per window (in windows, every checksum checked first),
  :class:`StreamReq` then :class:`StreamWindowReq` per window (each checked as it is read),
  and :class:`CollectReq` for the end of a load answered early.
- :class:`EventMsg` carries the daemon's events up, in order; :class:`Stop` asks it to finish
  what is queued and exit.

- ``common.py``: the handshake, saves, the small requests, the daemon's answers;
- ``load.py``: the load requests and :class:`LoadReply`.

This package imports nothing from aiockpt or outside the standard library.
"""

from __future__ import annotations

from .common import (
    PROTOCOL,
    Box,
    CheckpointInfo,
    CollectPartialsReq,
    DeleteReq,
    DTensorEntry,
    EventMsg,
    Hello,
    LayoutEntry,
    LayoutMsg,
    LeaseGrant,
    LeaseSpec,
    ProtocolMismatch,
    PublishFailureReq,
    ReadReq,
    Ready,
    RecordsReq,
    Reply,
    SaveDone,
    SaveReq,
    SlabFree,
    StepRecord,
    StepsReq,
    Stop,
    TensorAt,
    TierBindReq,
    ToDaemon,
    ToTrainer,
    Wanted,
    WarmReq,
    WindowReady,
    check_protocol,
)
from .load import (
    CappedLoadReq,
    CappedWindowReq,
    CollectReq,
    DirectRead,
    LoadAsk,
    LoadReply,
    LoadReq,
    SafetensorsInfo,
    SafetensorsReq,
    SlabRef,
    StreamReq,
    StreamWindowReq,
)

__all__ = [
    "PROTOCOL",
    "Box",
    "CappedLoadReq",
    "CappedWindowReq",
    "CheckpointInfo",
    "CollectPartialsReq",
    "CollectReq",
    "DTensorEntry",
    "DeleteReq",
    "DirectRead",
    "EventMsg",
    "Hello",
    "LayoutEntry",
    "LayoutMsg",
    "LeaseGrant",
    "LeaseSpec",
    "LoadAsk",
    "LoadReply",
    "LoadReq",
    "ProtocolMismatch",
    "PublishFailureReq",
    "ReadReq",
    "Ready",
    "RecordsReq",
    "Reply",
    "SafetensorsInfo",
    "SafetensorsReq",
    "SaveDone",
    "SaveReq",
    "SlabFree",
    "SlabRef",
    "StepRecord",
    "StepsReq",
    "Stop",
    "StreamReq",
    "StreamWindowReq",
    "TensorAt",
    "TierBindReq",
    "ToDaemon",
    "ToTrainer",
    "Wanted",
    "WarmReq",
    "WindowReady",
    "check_protocol",
]
