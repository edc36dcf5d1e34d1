"""A local tier's tie to the root it serves (see docs/tiers.md, "A tier belongs to one root").

``_tier.json`` in the tier's directory names the root by its id (``_core/identity.py``), made
once when the tier first serves a root and never replaced: a tier opened for another root is
refused, whatever the two roots' paths or URLs are. At ``open()`` on several ranks the
host's first rank ties (or checks) the tier and leaves a probe file there, and the host's
other ranks check that their tier directory holds both: that they share it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .._core.catalog import Catalog
from .._core.identity import is_id
from .._core.protocol import TierBindReq
from ..errors import TierMismatchError
from ..storage._local import LocalStorage

__all__ = ["TIE", "Tie"]

#: The tie: ``{"format": "aiockpt-tier", "root": <root id>, "url": <the root's URL when it
#: was tied, for messages>}``.
TIE = "_tier.json"


class Tie:
    """The tie of the tier in ``storage`` to its root; ``say(name, detail)`` tells events."""

    def __init__(
        self, storage: LocalStorage, catalog: Catalog, say: Callable[[str, str], None]
    ) -> None:
        self.storage = storage
        self.catalog = catalog
        self.say = say

    def bind(self, req: TierBindReq, root_url: str) -> str:
        """The tier's part of ``open()`` (see :class:`TierBindReq`): its directory."""
        if req.role == "claim":
            self.claim(req.root_id, root_url)
            self.storage.put_if_absent(_probe(req.probe), b"")
        elif req.role == "check":
            self.check(req.root_id, root_url)
            if not self.storage.exists(_probe(req.probe)):
                raise TierMismatchError(
                    f"the local tier {self.storage.root} is not the directory this host's "
                    "first rank uses: its probe is not there"
                )
        else:
            self.storage.delete(_probe(req.probe))
        return self.storage.root

    def claim(self, root_id: str, root_url: str) -> None:
        """Tie the tier to root ``root_id``, or check that it is tied to it; a tier tied to
        another root is a :class:`TierMismatchError` naming both."""
        if self.tied_to() is None:
            if self.catalog.listed_steps():
                # Written before tiers were tied to their root: the first root to open it
                # for writing takes it, as every root did then; said by an event.
                self.say(
                    "tier.adopted",
                    f"the local tier {self.storage.root}, untied, now serves {root_url}",
                )
            tie = {"format": "aiockpt-tier", "root": root_id, "url": root_url}
            self.storage.put_if_absent(TIE, json.dumps(tie).encode())
        self.check(root_id, root_url)

    def check(self, root_id: str, root_url: str) -> None:
        """That the tier is tied to root ``root_id``: a :class:`TierMismatchError` if not."""
        tie = self.tied_to()
        if tie is None:
            raise TierMismatchError(
                f"the local tier {self.storage.root} serves no root: it is not the directory "
                "this host's first rank uses"
            )
        if tie[0] != root_id:
            raise TierMismatchError(
                f"the local tier {self.storage.root} serves the root {tie[1]} (id {tie[0]}), "
                f"not {root_url} (id {root_id}): give this run a tier directory of its own, "
                "or remove that one if its checkpoints are no longer wanted"
            )

    def tied_to(self) -> tuple[str, str] | None:
        """The id and URL of the root the tier is tied to; None where it is not tied."""
        if not self.storage.exists(TIE):
            return None
        where = f"{self.storage.root}/{TIE}"
        size = self.storage.size(TIE)
        try:
            doc = json.loads(self.storage.read_range(TIE, 0, min(size, 1 << 16)))
            ok = (
                isinstance(doc, dict)
                and doc.get("format") == "aiockpt-tier"
                and is_id(doc.get("root"))
                and isinstance(doc.get("url"), str)
            )
        except (UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            raise TierMismatchError(f"{where} is not a local tier's tie to its root")
        return doc["root"], doc["url"]


def _probe(name: str) -> str:
    """The probe file a host's first rank leaves for the others to find at ``open()``."""
    if not name.isalnum():
        raise ValueError(f"not a probe's name: {name!r}")
    return f".host-probe-{name}"
