"""Every public name has a docstring: the modules users import, their classes and methods."""

from __future__ import annotations

import importlib
import inspect

import pytest

from aiockpt.retention import RetentionPolicy
from aiockpt.storage import Storage

PUBLIC_MODULES = [
    "aiockpt",
    "aiockpt.errors",
    "aiockpt.events",
    "aiockpt.retention",
    "aiockpt.storage",
    "aiockpt.storage.objects",
    "aiockpt.storage.parts",
    "aiockpt.storage.testing",
]


def public_names(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module_name} has no __all__"
    return [(f"{module_name}.{n}", getattr(module, n)) for n in names]


#: A method implementing one of these protocols is documented by the protocol.
PROTOCOLS = (Storage, RetentionPolicy)


def documented_by_protocol(cls: type, name: str) -> bool:
    """Whether ``cls`` has every method of a protocol whose ``name`` has a docstring."""
    for proto in PROTOCOLS:
        methods = {n for n in dir(proto) if not n.startswith("_") and callable(getattr(proto, n))}
        if name in methods and inspect.getdoc(getattr(proto, name)) and methods <= set(dir(cls)):
            return True
    return False


def undocumented(qualname: str, obj: object) -> list[str]:
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return []  # constants and type aliases document themselves with a comment
    missing = [] if inspect.getdoc(obj) else [qualname]
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith(("_", "test_")):  # tests are named as sentences
                continue
            if not (callable(member) or isinstance(member, (property, staticmethod, classmethod))):
                continue
            if documented_by_protocol(obj, name):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if not inspect.getdoc(member):
                missing.append(f"{qualname}.{name}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring(module_name):
    missing = [m for q, obj in public_names(module_name) for m in undocumented(q, obj)]
    assert missing == []


def test_the_package_exports_what_it_lists():
    """``aiockpt``'s lazy exports and its ``__all__`` name the same things, each importable:
    the classes, the errors, and ``load_safetensors``, a coroutine function."""
    import aiockpt

    assert sorted(aiockpt._EXPORTS) == sorted(aiockpt.__all__)
    for name in aiockpt.__all__:
        assert getattr(aiockpt, name) is not None, name
    assert inspect.iscoroutinefunction(aiockpt.load_safetensors)
