"""What the daemon holds of the trainer's caches: layouts and state-tree fragments.

The daemon keeps every layout and fragment it was sent, so a save sends only those it lacks.
When the layout cache evicts a layout or the flattener retires a fragment, the daemon may
forget it too, once no save that has not reached the daemon yet still refers to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._core.protocol import LayoutMsg, SaveReq
from .staging import Layout, LayoutCache
from .state import Flat, Flattener


@dataclass(frozen=True, slots=True)
class Delta:
    """What a save must tell the daemon besides its own data."""

    #: The layout, when the daemon does not hold it yet.
    layout: LayoutMsg | None
    #: The fragments the daemon does not hold yet, by id.
    fragments: dict[int, Any]
    #: Fragments and layouts no later request will refer to.
    forget_fragments: tuple[int, ...]
    forget_layouts: tuple[int, ...]


class DaemonMirror:
    """The layouts and fragments the current daemon holds, and those it may forget."""

    def __init__(self, flattener: Flattener, layouts: LayoutCache) -> None:
        self._flattener = flattener
        self._layouts = layouts
        #: The flat and layout id of each save between flatten and its request reaching the
        #: daemon, by uuid: what the daemon must not be told to forget yet.
        self._unsent: dict[str, tuple[Flat, int | None]] = {}
        self._retired_fragments: set[int] = set()
        self._retired_layouts: set[int] = set()
        #: Ids of the layouts and fragments the current daemon holds.
        self.layouts_sent: set[int] = set()
        self.fragments_sent: set[int] = set()

    def new_daemon(self) -> None:
        """A new daemon started: it holds nothing yet."""
        self.layouts_sent = set()
        self.fragments_sent = set()

    def hold(self, uuid: str, flat: Flat, layout_id: int | None = None) -> None:
        """Save ``uuid`` will refer to ``flat``'s fragments and this layout."""
        self._unsent[uuid] = (flat, layout_id)

    def release(self, uuid: str) -> None:
        """Save ``uuid`` reached the daemon, or never will."""
        self._unsent.pop(uuid, None)

    def delta(self, flat: Flat, layout: Layout) -> Delta:
        """What the daemon lacks for a save of ``flat`` in ``layout``, and may drop."""
        fragments = {i: node for i, node in flat.fragments.items() if i not in self.fragments_sent}
        forget_fragments, forget_layouts = self._forgettable()
        return Delta(
            layout.message() if layout.id not in self.layouts_sent else None,
            fragments,
            forget_fragments,
            forget_layouts,
        )

    def sent(self, req: SaveReq) -> None:
        """``req`` reached the daemon: it holds what it carried and dropped what it named."""
        self.layouts_sent.add(req.layout_id)
        self.layouts_sent.difference_update(req.forget_layouts)
        self.fragments_sent.update(req.fragments)
        self.fragments_sent.difference_update(req.forget_fragments)

    def _forgettable(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Fragments and layouts the daemon may drop: retired by the flattener or evicted from
        the layout cache, and not referred to by a save that has not reached the daemon yet."""
        self._retired_fragments.update(self._flattener.take_retired())
        self._retired_layouts.update(self._layouts.take_evicted())
        live_fragments: set[int] = set()
        live_layouts: set[int | None] = set()
        for flat, layout_id in self._unsent.values():
            live_fragments.update(flat.fragments)
            live_layouts.add(layout_id)
        fragments = self._retired_fragments - live_fragments
        layouts = self._retired_layouts - live_layouts
        self._retired_fragments -= fragments
        self._retired_layouts -= layouts
        return (
            tuple(sorted(fragments & self.fragments_sent)),
            tuple(sorted(layouts & self.layouts_sent)),
        )
