"""Rebuild a loaded state (:func:`unflatten`) or restore it into existing objects
(:func:`plan_restore`): everything checked before anything changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..._core.gc import no_gc
from ..._core.tree import (
    DICT,
    DTENSOR,
    FLOAT,
    GENERATOR,
    LIST,
    NDARRAY,
    NPSCALAR,
    STATEFUL,
    TENSOR,
    TUPLE,
    KeyPaths,
    decode_float,
)
from ...errors import LoadMismatchError
from ..objects import (
    _DTYPE,
    _PLAIN_TENSORS,
    _SHAPE,
    _path,
    _state_dict,
    is_stateful,
)


def unflatten(
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    held: Mapping[str, Any] | None = None,
    later: list[Callable[[], object]] | None = None,
) -> Any:
    """Rebuild the saved nesting; objects saved through state_dict() come back as their dicts.

    A distributed tensor comes back whole, as a plain tensor, unless ``held`` has a DTensor
    (dtensor.Held) of its name: then as a DTensor like that one, of this rank's chunk. With
    ``later``, a generator's state is set by a call appended there, not now (a restore
    plans before its tensors hold their bytes).
    """
    # Recursive, unlike _core.tree.walk: a rebuild needs its children's values, and the tree
    # was checked (its depth bounded) before it got here.
    tag, body = next(iter(tree.items()))
    if tag in (TENSOR, DTENSOR):
        if held and body in held:
            return _as_dtensor(held[body], tensors[body], body)
        return tensors[body]
    if tag == DICT:
        return {k: unflatten(v, tensors, held, later) for k, v in body}
    if tag == LIST:
        return [unflatten(v, tensors, held, later) for v in body]
    if tag == TUPLE:
        return tuple(unflatten(v, tensors, held, later) for v in body)
    if tag == STATEFUL:
        return unflatten(body, tensors, held, later)
    if tag == FLOAT:
        return decode_float(body)
    if tag == NDARRAY:
        return tensors[body].numpy()
    if tag == GENERATOR:
        gen = torch.Generator(device=body[0])
        # A copy of its own: set_state reads the storage from its start, ignoring the offset
        # of a view into the loaded buffer.
        state = tensors[body[1]]
        if later is None:
            gen.set_state(state.clone())
        else:
            later.append(lambda: gen.set_state(state.clone()))
        return gen
    if tag == NPSCALAR:
        import numpy as np

        value = decode_float(body[1]) if isinstance(body[1], str) else body[1]
        return np.dtype(body[0]).type(value)
    return body


def local_part(held: Any, src: torch.Tensor, path: str) -> torch.Tensor | None:
    """This rank's chunk of the DTensor ``held`` from ``src``: the chunk itself as loaded,
    or cut out of the whole tensor; None on a rank outside the mesh."""
    chunk = held.chunk
    if chunk is None:
        return None
    if tuple(src.shape) == chunk.sizes:
        return src
    if tuple(src.shape) == held.shape:
        return src[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]
    raise LoadMismatchError(
        f"{path or '<root>'}: saved {src.dtype}{list(src.shape)} does not fit the DTensor "
        f"{held.tensor.dtype}{list(held.shape)}"
    )


def _dry_run(obj: Any, value: Any, path: str, own: Any = None, strict: bool = True) -> None:
    """Raise LoadMismatchError for what ``obj.load_state_dict(value)`` would refuse, where that
    can be told without calling it: a module's missing or unexpected keys (``strict``) and
    tensor shapes (but where the module resizes as it loads, see _resizes), an optimizer's
    parameter groups and their sizes. ``own``: the module's state dict, when known."""
    where = path or "<root>"
    if isinstance(obj, torch.nn.Module) and isinstance(value, Mapping):
        own = _state_dict(obj, path) if own is None else own
        missing = [k for k in own if k not in value]
        unexpected = [k for k in value if k not in own]
        if strict and (missing or unexpected):
            raise LoadMismatchError(
                f"{where}: the module's load_state_dict would refuse the saved state dict "
                f"(missing: {_listed(missing) or 'none'}; unexpected: "
                f"{_listed(unexpected) or 'none'})"
            )
        for k, mine in own.items():
            saved = value.get(k)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(saved, torch.Tensor)
                and (is_lazy(mine) or mine.shape != saved.shape)
                and not _resizes(obj, k)
            ):
                raise LoadMismatchError(
                    f"{_path(path, k)}: saved {saved.dtype}{list(saved.shape)} does not "
                    f"fit {mine.dtype}{list(mine.shape)}"
                )
    elif isinstance(obj, torch.optim.Optimizer) and isinstance(value, Mapping):
        groups = value.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(obj.param_groups):
            n = len(groups) if isinstance(groups, list) else "no"
            raise LoadMismatchError(
                f"{where}: saved {n} parameter groups, the optimizer has {len(obj.param_groups)}"
            )
        for i, (saved, mine) in enumerate(zip(groups, obj.param_groups, strict=True)):
            params = saved.get("params") if isinstance(saved, Mapping) else None
            if not isinstance(params, list) or len(params) != len(mine["params"]):
                raise LoadMismatchError(
                    f"{where}: parameter group {i} was saved with "
                    f"{len(params) if isinstance(params, list) else 'no'} parameters, the "
                    f"optimizer's has {len(mine['params'])}"
                )


_MODULE_LOAD = torch.nn.Module.load_state_dict
_MODULE_LOAD_FROM = torch.nn.Module._load_from_state_dict


def _resizes(module: torch.nn.Module, key: str) -> bool:
    """Whether ``module``'s load_state_dict decides for itself what its state dict's ``key``
    may hold: it is not torch's own, or the submodule owning the key loads its state its own
    way (``_load_from_state_dict`` overridden, as a module resizing a buffer does), or a load
    pre-hook on the way to it may change what it gets (lazy modules materialize so). A shape
    the module would refuse is then refused by the module, when it loads."""
    if type(module).load_state_dict is not _MODULE_LOAD:
        return True
    owner: torch.nn.Module | None = module
    for name in key.split(".")[:-1]:
        assert owner is not None
        if owner._load_state_dict_pre_hooks:
            return True
        owner = owner._modules.get(name)
        if owner is None:
            return False
    assert owner is not None
    return bool(owner._load_state_dict_pre_hooks) or (
        type(owner)._load_from_state_dict is not _MODULE_LOAD_FROM
    )


class _Lenient:
    """A module to load with ``strict=False``: what the checkpoint lacks keeps its value,
    what the module lacks is left out (load(strict=False) all the way down)."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load_state_dict(self, value: Mapping[str, Any]) -> None:
        self.module.load_state_dict(value, strict=False)


def _as_dtensor(held: Any, src: torch.Tensor, path: str) -> Any:
    """A DTensor placed like ``held`` holding this rank's chunk of ``src``."""
    from torch.distributed.tensor import DTensor

    like = held.tensor
    local = local_part(held, src, path)
    if local is None:
        local = like._local_tensor.new_empty(like._local_tensor.shape)
    if src.dtype != like.dtype:
        raise LoadMismatchError(
            f"{path or '<root>'}: saved {src.dtype} does not fit the DTensor's {like.dtype}"
        )
    local = local.to(like._local_tensor.device)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


@no_gc  # the walk's lists and sizes: a full GC pass over them is long at many tensors
@dataclass(frozen=True, slots=True)
class Target:
    """What a restore goes into: ``into``, its DTensors by key path (dtensor.Held), whether
    keys must match, and the key paths the key check is limited to (None: all)."""

    into: Any
    held: Mapping[str, Any]
    strict: bool
    scope: tuple[str, ...] | None


def plan_restore(
    target: Target,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    fresh: Mapping[str, torch.Tensor],
    make: Callable[..., _Restorer] | None = None,
) -> _Restorer:
    """The plan of a restore of ``tree`` into ``target``, everything checked and nothing
    changed yet: keys (with ``target.strict``: the saved keys and the target's keys of every
    dict must be the same), tensor shapes and dtypes, and what a module's or optimizer's
    load_state_dict would refuse; a mismatch raises :class:`LoadMismatchError`. ``finish``
    then makes the changes: tensors copied into the target's tensors (a DTensor's: into its
    local tensor) from ``tensors`` (``Restorer.srcs`` are them or views of them), and
    ``fresh`` handed over instead where a value is handed over (a module's or optimizer's
    state dict, a tensor with no tensor to copy into). Without ``strict``, what both hold is
    restored and the rest left as it is: saved keys the target lacks are not added, target
    keys the checkpoint lacks keep their values; the Restored says which. ``target.scope``
    (the key paths a load selected) limits the key check to what lies under them. ``make``:
    the restorer's class (a subclass that carries the plan out in another order, say)."""
    restorer = (make or _Restorer)(tensors, fresh, target.held)
    restorer.strict = strict = target.strict
    restorer.result = restorer.restore(target.into, tree, "")
    if target.scope is not None:  # target keys outside the selection read were not asked for
        asked = KeyPaths(target.scope)
        restorer.only_target = [p for p in restorer.only_target if asked.selects(p)]
    if strict and (restorer.only_saved or restorer.only_target):
        raise LoadMismatchError(restorer.key_difference())
    return restorer


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore did: the restored value, and the key paths the checkpoint and the target
    did not share."""

    value: Any
    #: Saved key paths the target lacked (not restored).
    only_saved: tuple[str, ...] = ()
    #: Target key paths the checkpoint lacked (left as they were).
    only_target: tuple[str, ...] = ()


#: The size from which a dict is first tried as a whole by _Restorer.tensor_dict.
BATCH_MIN = 32


def _listed(paths: list[str], limit: int = 10) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", … ({len(paths)} in all)" if len(paths) > limit else "")


class _Restorer:
    """One restore: the walk of the target against the tree, checking as it goes and
    collecting what to change; nothing changes until the walk is over."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        fresh: Mapping[str, torch.Tensor],
        held: Mapping[str, Any],
    ) -> None:
        self.tensors = tensors
        self.fresh = fresh
        self.held = held
        self.result: Any = None
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        #: (container, key, value): an item to set; (object, state dict): a load_state_dict.
        self.sets: list[tuple[Any, Any, Any]] = []
        self.loads: list[tuple[Any, Any]] = []
        #: Other in-place restores (a generator's state, a numpy array's bytes).
        self.calls: list[Callable[[], object]] = []
        self.only_saved: list[str] = []
        self.only_target: list[str] = []
        #: Whether keys must match; without, a module loads with strict=False too.
        self.strict = True

    def lenient(self, module: torch.nn.Module, value: Any, path: str) -> _Lenient:
        """Plan a ``strict=False`` load of ``module``: the keys it and the checkpoint do not
        share noted, and checked as its load_state_dict(strict=False) would check them."""
        own = _state_dict(module, path)
        if isinstance(value, Mapping):
            self.only_saved.extend(_path(path, k) for k in value if k not in own)
            self.only_target.extend(_path(path, k) for k in own if k not in value)
        _dry_run(module, value, path, own, strict=False)
        return _Lenient(module)

    def finish(self, copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> Restored:
        """Make the planned changes: ``copy(dsts, srcs)``, then the items set, the in-place
        restores and the load_state_dict calls."""
        if self.dsts:
            with torch.no_grad():
                copy(self.dsts, self.srcs)
        for container, key, value in self.sets:
            container[key] = value
        for call in self.calls:
            call()
        for obj, value in self.loads:
            obj.load_state_dict(value)
        return Restored(self.result, tuple(self.only_saved), tuple(self.only_target))

    def key_difference(self) -> str:
        parts = []
        if self.only_saved:
            parts.append(f"saved but not in the target: {_listed(self.only_saved)}")
        if self.only_target:
            parts.append(f"in the target but not saved: {_listed(self.only_target)}")
        return (
            "the checkpoint and the target hold different keys ("
            + "; ".join(parts)
            + "); nothing was restored (strict=False restores what matches)"
        )

    def restore(self, target: Any, tree: Any, path: str) -> Any:
        """The restored value of ``target``, found at key path ``path``."""
        tag, body = next(iter(tree.items()))
        if isinstance(target, torch.Tensor):
            return self.tensor(target, tag, body, path)
        if isinstance(target, torch.Generator) and tag == GENERATOR:
            state = self.fresh[body[1]]
            self.calls.append(lambda: target.set_state(state.clone()))  # see unflatten
            return target
        if tag == NDARRAY and type(target).__name__ == "ndarray":
            return self.ndarray(target, body, path)
        if is_stateful(target):
            inner = body if tag == STATEFUL else tree
            value = unflatten(inner, self.fresh, self.held, self.calls)
            if self.strict or not isinstance(target, torch.nn.Module):
                _dry_run(target, value, path)
                self.loads.append((target, value))
            else:
                self.loads.append((self.lenient(target, value, path), value))
            return target
        if tag == STATEFUL:
            tag, body = next(iter(body.items()))
        if isinstance(target, dict) and tag == DICT:
            if len(body) >= BATCH_MIN and self.tensor_dict(target, body):
                return target
            saved = set()
            for k, node in body:
                saved.add(k)
                child = _path(path, k)
                if k in target:
                    value = self.restore(target[k], node, child)
                    if value is not target[k]:
                        self.sets.append((target, k, value))
                else:
                    self.only_saved.append(child)
            self.only_target.extend(_path(path, k) for k in target if k not in saved)
            return target
        if isinstance(target, list) and tag in (LIST, TUPLE) and len(target) == len(body):
            for i, node in enumerate(body):
                value = self.restore(target[i], node, _path(path, i))
                if value is not target[i]:
                    self.sets.append((target, i, value))
            return target
        return unflatten({tag: body}, self.fresh, later=self.calls)

    def tensor_dict(self, target: dict, body: list) -> bool:
        """Plan the restore of ``target``, a dict of plain tensors saved as one (a model's
        state dict), in a few passes over it instead of a walk and a check per key; most of
        what is left is reading each tensor's shape and dtype. (A load(into=) plans
        while the daemon reads, see Loader._restore_while_read: on 2 cores they compete.)
        False, nothing planned, where that does not apply: the keys differ, a value is not a
        plain tensor on either side, a shape or dtype differs, or DTensors are held (they
        are matched by key path); the walk then takes each key in turn and words what is
        wrong."""
        keys = {k for k, _ in body}
        if self.held or len(keys) != len(body) or target.keys() != keys:
            return False
        try:
            names = [node[TENSOR] for _, node in body]
            srcs = [self.tensors[name] for name in names]
        except (KeyError, TypeError):
            return False
        dsts = [target[k] for k, _ in body]
        if (
            not _PLAIN_TENSORS.issuperset(map(type, dsts))
            or not _PLAIN_TENSORS.issuperset(map(type, srcs))
            or list(map(_DTYPE, srcs)) != list(map(_DTYPE, dsts))
            or list(map(_SHAPE, srcs)) != list(map(_SHAPE, dsts))
        ):
            return False
        self.dsts += dsts
        self.srcs += srcs
        return True

    def ndarray(self, target: Any, name: str, path: str) -> Any:
        """Restore a numpy array in place (it is checked now, copied when all is checked)."""
        src = self.fresh[name].numpy()
        if src.shape != target.shape or src.dtype != target.dtype or not target.flags.writeable:
            raise LoadMismatchError(
                f"{path or '<root>'}: saved numpy {src.dtype}{list(src.shape)} does not fit "
                f"{target.dtype}{list(target.shape)}"
                + ("" if target.flags.writeable else " (read-only)")
            )
        import numpy as np

        self.calls.append(lambda: np.copyto(target, src))
        return target

    def tensor(self, target: torch.Tensor, tag: str, body: Any, path: str) -> torch.Tensor:
        if tag not in (TENSOR, DTENSOR):
            raise LoadMismatchError(f"{path or '<root>'}: the checkpoint holds no tensor here")
        src: torch.Tensor | None = self.tensors[body]
        dst = target
        held = self.held.get(path)
        if held is not None and held.tensor is target:
            assert src is not None
            if src.dtype != target.dtype:
                raise LoadMismatchError(
                    f"{path or '<root>'}: saved {src.dtype} does not fit the DTensor's "
                    f"{target.dtype}"
                )
            src = local_part(held, src, path)
            if src is None:
                return target  # this rank holds none of it
            dst = target._local_tensor
        assert src is not None
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise LoadMismatchError(
                f"{path or '<root>'}: saved {src.dtype}{list(src.shape)} does not fit "
                f"{dst.dtype}{list(dst.shape)}"
            )
        self.dsts.append(dst)
        self.srcs.append(src)
        return target
