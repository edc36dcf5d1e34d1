"""How the trainer asks its daemon for a load's bytes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..._core.protocol import LoadReply

#: Asks the daemon for this rank's load's bytes: the fields of a LoadReq but its rank and
#: world size (``step``, ``slab``: a slab lent to read into when large enough, else a fresh
#: segment; ``wanted``: the box of each distributed tensor restored into a DTensor, the others
#: read whole; ``select``, ``select_required``: the key paths to read, None for all;
#: ``window``, ``part``: a load in windows).
Read = Callable[..., Awaitable[LoadReply]]
