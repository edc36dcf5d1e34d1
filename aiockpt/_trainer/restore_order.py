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
from typing import Any

import torch

from .._core.gc import no_gc
from .._core.tree import KeyPaths
from ..errors import LoadMismatchError
from .state import Restored, _Restorer


class OrderedRestorer(_Restorer):
    """A restore planned as :class:`~aiockpt._trainer.state._Restorer` plans it, carried out
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


@no_gc  # the walk's lists and sizes, as state.plan_restore's
def plan_restore(
    target: Any,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    fresh: Mapping[str, torch.Tensor],
    held: Mapping[str, Any] | None,
    strict: bool,
    scope: tuple[str, ...] | None,
) -> OrderedRestorer:
    """:func:`aiockpt._trainer.state.plan_restore`, carried out in the global order."""
    restorer = OrderedRestorer(tensors, fresh, held or {})
    restorer.result = restorer.restore(target, tree, "")
    if scope is not None:  # target keys outside the selection read were not asked for
        asked = KeyPaths(scope)
        restorer.only_target = [p for p in restorer.only_target if asked.selects(p)]
    if strict and (restorer.only_saved or restorer.only_target):
        raise LoadMismatchError(restorer.key_difference())
    return restorer
