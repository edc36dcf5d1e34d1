"""The order a load's restore makes its changes in: one global order, the same on every rank.

A module's ``load_state_dict`` may run collectives (a sharded module gathering its pieces, a
model broadcasting buffers): every rank must call them in the same order, or they pair up
wrongly and hang. The walk of a target follows each rank's own saved key order, which the
ranks need not share; so the ``load_state_dict`` calls are made in the order of their key
paths, and generators are restored after them all (as torchsnapshot does), so a module that
draws random numbers as it loads does not move a generator off the state it was saved with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from . import restore
from .restore import Restored, Target, _Restorer


class OrderedRestorer(_Restorer):
    """A restore planned as :class:`~aiockpt._trainer.load.restore._Restorer` plans it, carried out
    in the global order: copies and items set first, then the ``load_state_dict`` calls by
    key path, then the generators' states by key path."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        fresh: Mapping[str, torch.Tensor],
        held: Mapping[str, Any],
    ) -> None:
        super().__init__(tensors, fresh, held)
        #: The key path of each planned load_state_dict call, by its place in ``loads``.
        self.load_paths: list[str] = []
        #: (key path, call) of each generator restored in place.
        self.generators: list[tuple[str, Callable[[], object]]] = []

    def restore(self, target: Any, tree: Any, path: str) -> Any:
        loads, calls = len(self.loads), len(self.calls)
        value = super().restore(target, tree, path)
        if len(self.loads) == loads + 1 and len(self.load_paths) == loads:
            self.load_paths.append(path)  # the target itself is loaded, not an item of it
        if isinstance(target, torch.Generator) and len(self.calls) == calls + 1:
            self.generators.append((path, self.calls.pop()))
        return value

    def finish(self, copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> Restored:
        order = sorted(range(len(self.loads)), key=self.load_paths.__getitem__)
        self.loads = [self.loads[i] for i in order]
        restored = super().finish(copy)
        for _, call in sorted(self.generators, key=lambda item: item[0]):
            call()
        return restored


def plan_restore(
    target: Target,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    fresh: Mapping[str, torch.Tensor],
) -> OrderedRestorer:
    """:func:`aiockpt._trainer.load.restore.plan_restore`, carried out in the global order."""
    planned = restore.plan_restore(target, tree, tensors, fresh, make=OrderedRestorer)
    return cast(OrderedRestorer, planned)
