"""What a refused state is walked again with: one error naming every key path at fault."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._core.tree import VALUE
from ..errors import UnsupportedValueError
from .state import _Walk


class Collecting(_Walk):
    """A walk that records every value it refuses and goes on: what a refused state is walked
    again with, so that one error names every key path at fault, not one per attempt."""

    __slots__ = ("problems",)
    collecting = True

    def __init__(self) -> None:
        super().__init__(None, None)
        self.problems: list[UnsupportedValueError] = []

    def walk(self, value: Any, path: str, depth: int) -> Any:
        try:
            return super().walk(value, path, depth)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return {VALUE: None}

    def tensor_node(self, t: torch.Tensor, path: str) -> dict[str, str]:
        try:
            return super().tensor_node(t, path)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return {VALUE: None}  # type: ignore[dict-item]

    def add_tensor(self, t: torch.Tensor, path: str, *, alias: bool = True) -> str:
        try:
            return super().add_tensor(t, path, alias=alias)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return path

    def key_ok(self, key: Any, path: str) -> bool:
        try:
            return super().key_ok(key, path)
        except UnsupportedValueError as e:
            self.problems.append(e)
            return False


def every_problem(state: Any, first: UnsupportedValueError) -> UnsupportedValueError:
    """One error naming every value of ``state`` that cannot be saved (``first`` was the
    first found)."""
    walk = Collecting()
    with contextlib.suppress(Exception):  # a state_dict() failing the second time
        walk.walk(state, "", 0)
    found = [(p, m) for e in walk.problems for p, m in e.problems] or first.problems
    return UnsupportedValueError(found[0][0], found[0][1], more=found[1:])
