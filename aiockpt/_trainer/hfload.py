"""``load_safetensors``: Hugging Face safetensors weights, read through the daemon into new
tensors or in place into a module or a mapping of tensors and DTensors.

The daemon reads and checks the source's headers (``SafetensorsReq`` without ``read``); this
side matches the file's names (after ``rename``) against the target, checks every shape and
dtype, and says per tensor what to read: the whole of it, or, for a DTensor, the box of the
global tensor this rank holds (``dtensor.check_placements``). The daemon reads only those
byte ranges into a new segment (``_daemon/hfread.py``); the tensors are then read from it into
the targets (:class:`Opened`), none of which changed before every check passed and every byte
was read. Under a
process group the ranks agree before anything is copied (``dist.LoadAgreement``), so what
fails on one rank fails on all.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import ctypes
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import torch

from .._core.protocol import LoadReply, SafetensorsInfo, SafetensorsReq
from ..errors import LoadMismatchError, SavedKeyNotFoundError, UnsupportedValueError
from ..storage._registry import split_protocol
from . import dist as _dist
from .load.views import map_loaded, views
from .staging import copy_pairs
from .state import ST_TO_TORCH, _dtensor_type

__all__ = ["SafetensorsLoading", "load_safetensors", "load_with"]

Rename = Callable[[str], "str | None"]
#: The targets' bytes are read from the segment this much at a time, READERS at once.
PIECE = 8 * 1024 * 1024
READERS = 2


def source_url(source: Any, root_url: str, options: Mapping[str, Any]) -> tuple[str, dict]:
    """The URL the daemon opens for ``source`` (a local path made absolute), and the storage
    options it gets: the manager's when the source is of the root's protocol, else none."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a path or URL, not {type(source).__name__}")
    text = os.fspath(source)
    if not isinstance(text, str) or not text:
        raise TypeError(f"source must be a non-empty str path or URL, not {source!r}")
    protocol, url = split_protocol(text)
    same = protocol == split_protocol(root_url)[0] and protocol != "file"
    return url, dict(options) if same else {}


def check_args(rename: Any, dtype: Any) -> None:
    if rename is not None and not callable(rename):
        raise TypeError(f"rename must be a callable name -> key or None, not {rename!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, not {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype casts floating tensors: give a floating dtype, not {dtype}")


def renamed(info: SafetensorsInfo, rename: Rename | None) -> dict[str, str]:
    """key -> the file's tensor name, ``rename`` applied (None skips a tensor); two names
    given one key are a LoadMismatchError naming both."""
    keys: dict[str, str] = {}
    for name in info.tensors:
        key = name if rename is None else rename(name)
        if key is None:
            continue
        if not isinstance(key, str):
            raise TypeError(f"rename({name!r}) returned {key!r}, not a str or None")
        if key in keys:
            raise LoadMismatchError(
                f"{key}: rename gives this key to two tensors of {info.url}: "
                f"{keys[key]!r} and {name!r}"
            )
        keys[key] = name
    return keys


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when both are floating; as it is otherwise."""
    if dtype is None or not t.is_floating_point() or not dtype.is_floating_point:
        return t
    return t.to(dtype)


def targets_of(into: Any) -> dict[str, torch.Tensor]:
    """The tensors to fill, by key: a module's state dict (parameters and buffers as they
    are), or a mapping's values, each a tensor or DTensor."""
    if isinstance(into, torch.nn.Module):
        return dict(into.state_dict(keep_vars=True))
    if not isinstance(into, Mapping):
        raise TypeError(
            f"into must be None, an nn.Module or a mapping of tensors, not {type(into).__name__}"
        )
    out = {}
    for key, value in into.items():
        if not isinstance(key, str):
            raise UnsupportedValueError(repr(key), "a target's keys must be str")
        if not isinstance(value, torch.Tensor):
            raise UnsupportedValueError(
                key, f"{type(value).__name__} is not a tensor to load safetensors into"
            )
        out[key] = value
    return out


def _ident(t: torch.Tensor) -> Any:
    """What two keys holding one tensor share (tied weights): the object, or its memory."""
    if _is_dtensor(t) or t.numel() == 0:
        return id(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def _is_dtensor(t: Any) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def match(
    keys: dict[str, str], targets: dict[str, torch.Tensor], url: str
) -> dict[str, torch.Tensor]:
    """The targets to fill, by key, once every key is both in the file and in the target; a
    target key the file lacks is filled through a tied twin (the same tensor under another
    key) when it has one. Raises, naming the keys, when any is left over on either side."""
    extra = sorted(k for k in keys if k not in targets)
    filled = {_ident(t) for k, t in targets.items() if k in keys}
    missing = sorted(k for k, t in targets.items() if k not in keys and _ident(t) not in filled)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"in the target but not in the file: {', '.join(missing)}")
        if extra:
            parts.append(f"in the file but not in the target: {', '.join(extra)}")
        error = SavedKeyNotFoundError if missing else LoadMismatchError
        raise error(
            f"{url} and the target hold different tensors ({'; '.join(parts)}); rename= maps "
            "the file's names to the target's keys, None leaving a tensor out"
        )
    return {k: t for k, t in targets.items() if k in keys}


def plan_reads(
    info: SafetensorsInfo,
    keys: dict[str, str],
    fill: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
) -> list[tuple[str, str, str, tuple[int, ...], int, Any]]:
    """What to read for each target: the whole tensor, or this rank's box of a DTensor's;
    every shape and dtype checked first (LoadMismatchError naming the key)."""
    from .dtensor import check_placements  # DTensor support, imported only when needed

    reads = []
    for key, target in fill.items():
        name = keys[key]
        file, st, shape, start, _ = info.tensors[name]
        saved = ST_TO_TORCH[st]
        after = dtype if dtype is not None and saved.is_floating_point else saved
        if tuple(target.shape) != shape:
            raise LoadMismatchError(
                f"{key}: the file holds {name!r} of shape {list(shape)}, the target's is "
                f"{list(target.shape)}"
            )
        if after != target.dtype:
            hint = " (dtype= casts floating tensors)" if saved.is_floating_point else ""
            raise LoadMismatchError(
                f"{key}: the file holds {name!r} as {saved}, the target's dtype is "
                f"{target.dtype}{hint}"
            )
        box = None
        if _is_dtensor(target):
            chunk = check_placements(target, key)  # type: ignore[arg-type]
            if chunk is None or not chunk.numel:
                continue
            box = (chunk.offsets, chunk.sizes)
        reads.append((name, file, st, shape, start, box))
    return reads


async def load_safetensors(
    source: str | os.PathLike[str],
    into: Any = None,
    *,
    rename: Rename | None = None,
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Load Hugging Face safetensors weights with no manager and no checkpoint root: as
    :meth:`AsyncCheckpointManager.load_safetensors` does, through a daemon started for this
    call alone and stopped before it returns. ``source`` is a ``.safetensors`` file, a folder
    holding ``model.safetensors``, ``model.safetensors.index.json`` and its shards, or other
    ``.safetensors`` shards, or a URL of any of them; ``storage_options`` go to the storage
    that reads a URL (a local path takes none). Under ``torch.distributed`` every rank of the
    default group calls it, as every rank opens a manager. A coroutine function: ``await``
    it, or ``asyncio.run(aiockpt.load_safetensors(...))`` from blocking code. See
    docs/safetensors.md."""
    from .manager import AsyncCheckpointManager  # it imports this module

    check_args(rename, dtype)
    url, _ = source_url(source, "", {})
    protocol, _ = split_protocol(url)
    options = dict(storage_options or {})
    if protocol == "file" and options:
        raise ValueError(f"a local source takes no storage_options (got {sorted(options)})")
    folder, sep, name = url.rstrip("/").rpartition("/")
    root = (folder or "/") if sep and name.endswith(".safetensors") else url
    # A manager that writes nothing, on the source's own folder: the daemon it starts
    # creates nothing there, and the source, of the root's protocol, gets the options.
    async with AsyncCheckpointManager(root, storage_options=options, read_only=True) as mgr:
        return await mgr.load_safetensors(url, into, rename=rename, dtype=dtype)


async def load_with(
    mgr: Any,
    source: Any,
    into: Any,
    rename: Rename | None,
    dtype: torch.dtype | None,
) -> Any:
    """See AsyncCheckpointManager.load_safetensors; ``mgr`` is the open manager."""
    check_args(rename, dtype)
    url, options = source_url(source, mgr.url, mgr.storage_options)
    op, t0 = uuid.uuid4().hex, time.monotonic()
    mgr._emit("load.start", uuid=op, step=None, detail=url)
    agreement = _dist.LoadAgreement(mgr._loader.group, None)
    try:
        client: Any = await mgr._daemons.live()
        info: SafetensorsInfo = await client.request(
            SafetensorsReq, source=url, storage_options=options
        )
        keys = renamed(info, rename)
        if into is None:
            whole = {k: info.tensors[n] for k, n in keys.items()}
            reads = [(keys[k], f, st, sh, s, None) for k, (f, st, sh, s, _) in whole.items()]
        else:
            fill = match(keys, targets_of(into), info.url)
            reads = plan_reads(info, keys, fill, dtype)
        reply: LoadReply = await client.request(
            SafetensorsReq, source=url, storage_options=options, read=tuple(reads)
        )
        if into is None:
            loaded = map_loaded(reply)
            agreement.checked(0)
            result: Any = {k: cast(loaded[keys[k]], dtype) for k in keys}
        else:
            with Opened(reply) as segment:
                agreement.checked(0)
                await anyio.to_thread.run_sync(segment.copy_into, fill, keys, dtype)
            result = into
        agreement.restored(0)
    except Exception as e:
        raised: BaseException = e
        try:
            agreement.failed(e)  # the other ranks learn of it, and raise too
        except Exception as told:
            raised = told
        mgr._emit("load.exception", uuid=op, step=None, error=raised, detail=url)
        if raised is e:
            raise
        raise raised from e
    mgr._emit(
        "load.end",
        uuid=op,
        step=None,
        duration_s=time.monotonic() - t0,
        nbytes=reply.nbytes,
        read_nbytes=reply.read_nbytes,
        detail=url,
    )
    return result


class Opened:
    """The segment of a ``load_safetensors(into=...)`` read, opened (and unlinked: it goes
    with the descriptor) but not mapped: :meth:`copy_into` reads most targets' bytes from
    it with ``preadv``, a copy from the segment's pages straight into the targets', which
    costs less than mapping them first (a fault or a page-table entry per 4 KiB page) and
    copying from the mapping."""

    def __init__(self, reply: LoadReply) -> None:
        assert reply.segment is not None
        self.reply = reply
        self.fd = _posixshmem.shm_open(reply.segment, os.O_RDWR, mode=0o600)
        _posixshmem.shm_unlink(reply.segment)

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        # The last reference to the segment gone, its pages are freed: tens of milliseconds
        # for hundreds of MiB, which a thread of its own spends after the targets are filled.
        threading.Thread(
            target=os.close, args=(self.fd,), name="aiockpt-hf-free", daemon=True
        ).start()

    def copy_into(
        self, fill: dict[str, torch.Tensor], keys: dict[str, str], dtype: torch.dtype | None
    ) -> None:
        """Copy each tensor read into its target: read straight into a contiguous CPU
        target of the same dtype, in pieces over READERS threads; through a mapping of the
        segment and ``copy_`` (a cast, a strided target, a GPU's) otherwise."""
        jobs: list[tuple[int, int, int]] = []  # (segment offset, address, bytes)
        mapped: dict[str, torch.Tensor] = {}
        for key, target in fill.items():
            spec = self.reply.tensors.get(keys[key])
            if spec is None:  # a DTensor of which this rank holds nothing
                continue
            local = target._local_tensor if _is_dtensor(target) else target  # type: ignore[attr-defined]
            st, _, at = spec
            if (
                local.device.type == "cpu"
                and local.is_contiguous()
                and ST_TO_TORCH[st] == local.dtype
            ):
                n = local.numel() * local.element_size()
                jobs += [
                    (at + a, local.data_ptr() + a, min(PIECE, n - a)) for a in range(0, n, PIECE)
                ]
                _bump(local)
            else:
                mapped[key] = local
        if jobs:
            with ThreadPoolExecutor(READERS, thread_name_prefix="aiockpt-hf-copy") as pool:
                for done in pool.map(lambda j: self._pread(*j), jobs):
                    del done
        if mapped:
            self._copy_mapped(mapped, keys, dtype)

    def _pread(self, at: int, address: int, n: int) -> None:
        with memoryview((ctypes.c_char * n).from_address(address)).cast("B") as out:
            got = 0
            while got < n:
                step = os.preadv(self.fd, [out[got:]], at + got)
                if step <= 0:
                    raise OSError(f"{self.reply.segment}: short read of the loaded segment")
                got += step

    def _copy_mapped(
        self, mapped: dict[str, torch.Tensor], keys: dict[str, str], dtype: torch.dtype | None
    ) -> None:
        size = max(self.reply.size, 1)
        mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        u8 = torch.frombuffer(mm, dtype=torch.uint8) if self.reply.size else torch.empty(0)
        loaded = views(u8, {keys[k]: self.reply.tensors[keys[k]] for k in mapped})
        srcs = [cast(loaded[keys[k]], dtype) for k in mapped]
        with torch.no_grad():
            copy_pairs(list(mapped.values()), srcs)


def _bump(t: torch.Tensor) -> None:
    """Count the write autograd would see from ``copy_`` (the bytes come from preadv)."""
    with contextlib.suppress(AttributeError, RuntimeError):
        torch.autograd.graph.increment_version(t)


class SafetensorsLoading:
    """``load_safetensors`` of :class:`~aiockpt.AsyncCheckpointManager` (its base class)."""

    async def load_safetensors(
        self,
        source: str | os.PathLike[str],
        into: Any = None,
        *,
        rename: Rename | None = None,
        dtype: torch.dtype | None = None,
    ) -> Any:
        """Load Hugging Face safetensors weights: ``source`` a ``.safetensors`` file, a folder
        holding ``model.safetensors`` or ``model.safetensors.index.json`` and its shards, or
        a URL of either. Without ``into``, a dict of new plain tensors by name (every rank
        gets them whole); with ``into`` (an ``nn.Module``, or a mapping of tensors and
        DTensors), each tensor filled in place, each rank reading only the bytes of its own
        pieces, and ``into`` returned. ``rename(name)`` gives a file's tensor its key (None
        leaves it out); ``dtype`` casts floating tensors. Strict: names on one side only, a
        shape or dtype that differs, a malformed file: a CheckpointError naming the key, and
        ``into`` unchanged. See docs/safetensors.md."""
        mgr: Any = self
        mgr._check_open()
        return await load_with(mgr, source, into, rename, dtype)
