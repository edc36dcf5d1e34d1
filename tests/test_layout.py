"""The package layout shows the two processes, and these tests hold it to that.

- ``aiockpt/_trainer/``: runs in the training process, next to torch;
- ``aiockpt/_daemon/``: runs only in the daemon process;
- shared code: ``aiockpt/_core/``, ``storage/``, ``_crc``, ``errors``, ``retention``, ``events``;
  ``storage/`` is the bottom layer, which ``_core`` builds on.

The rules: the daemon side and the CLI never import torch; the trainer side never imports the
daemon side, nor does the CLI (``aiockpt/cli/``, ``_export``, ``_copy``): what it shares with
the daemon is in ``_core``; shared code imports neither torch (``events.process_group_info``
imports ``torch.distributed`` lazily, called only by the trainer side) nor either side. And
no module of ``aiockpt/`` is over 500 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "aiockpt"


def modules(*parts: str) -> list[Path]:
    base = PKG.joinpath(*parts)
    return [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))


def package_of(path: Path) -> str:
    name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(
    path: Path, *, package: str | None = None, top_level_only: bool = False
) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, a module of ``package``."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = package_of(path)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            # `from . import x` imports the submodule x
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(paths: list[Path], forbidden: tuple[str, ...], **kw: object) -> list[str]:
    out = []
    for path in paths:
        for line, name in imports(path, **kw):  # type: ignore[arg-type]
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.name}:{line} imports {name}")
    return out


SHARED = [
    *modules("_crc.py"),
    *modules("_core"),
    *modules("storage"),
    *modules("errors.py"),
    *modules("retention.py"),
]


CLI = [*modules("cli"), *modules("_export.py"), *modules("_copy.py")]


def test_the_daemon_side_and_the_cli_never_import_torch_or_the_trainer_side():
    paths = [*modules("_daemon"), *CLI]
    assert violations(paths, ("torch", "numpy", "aiockpt._trainer", "anyio")) == []


def test_the_cli_never_imports_the_daemon_side():
    """The command reads roots through the catalog and storage; what it shares with the
    daemon (the chunk assembler, the lease keeper, the commit) lives in ``_core``."""
    assert violations(CLI, ("aiockpt._daemon",)) == []


def test_the_trainer_side_never_imports_the_daemon_side():
    assert violations(modules("_trainer"), ("aiockpt._daemon",)) == []


def test_shared_code_imports_neither_side_nor_torch():
    forbidden = ("torch", "aiockpt._trainer", "aiockpt._daemon", "aiockpt.cli")
    assert violations(SHARED, forbidden) == []
    # events: torch.distributed only inside process_group_info, which the trainer calls.
    assert violations(modules("events"), forbidden, top_level_only=True) == []


def test_storage_is_the_bottom_layer():
    """The core (formats, catalog, leases) is built on storage, never the other way round;
    the crc32c arithmetic both use imports nothing of aiockpt."""
    assert violations(modules("storage"), ("aiockpt._core",)) == []
    assert [name for _, name in imports(PKG / "_crc.py") if name.startswith("aiockpt")] == []


def test_the_protocol_depends_on_nothing_but_the_standard_library():
    names = [name for path in modules("_core", "protocol") for _, name in imports(path)]
    names = [n for n in names if not n.startswith("aiockpt._core.protocol")]  # its own modules
    assert [n for n in names if n.split(".")[0] not in sys.stdlib_module_names] == []


def test_the_rules_catch_a_forbidden_import(tmp_path):
    """The checker itself finds relative and absolute imports at any depth."""
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    from .._trainer import state\n    import torch.cuda\n")
    found = violations([bad], ("torch", "aiockpt._trainer"), package="aiockpt._daemon")
    assert found == [
        "probe.py:2 imports aiockpt._trainer",
        "probe.py:2 imports aiockpt._trainer.state",
        "probe.py:3 imports torch.cuda",
    ]


@pytest.mark.parametrize("module", ["aiockpt._daemon.server", "aiockpt.cli"])
def test_loading_the_daemon_or_the_cli_loads_no_torch(module):
    code = (
        f"import sys, {module}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'anyio') "
        "or m.startswith('aiockpt._trainer')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_loading_the_cli_loads_no_daemon_module():
    code = (
        "import sys, aiockpt.cli.parser; "
        "bad = sorted(m for m in sys.modules if m.startswith('aiockpt._daemon')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_class_over_300_lines_and_no_function_over_80():
    """Small pieces: a class that outgrows this holds more than one concern."""
    roots = [PKG, PKG.parent / "plugins" / "aiockpt-s3" / "aiockpt_s3"]
    too_big = []
    for path in (p for root in roots for p in sorted(root.rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = 300 if isinstance(node, ast.ClassDef) else 80
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > limit:
                    too_big.append(f"{path.name}:{node.lineno} {node.name}")
    assert too_big == []


def test_no_module_over_500_lines():
    """A module that outgrows this mixes jobs: split it along a seam (see design.md)."""
    too_long = {
        str(path.relative_to(PKG)): n
        for path in sorted(PKG.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert too_long == {}


def test_no_function_of_the_load_wing_takes_more_than_6_parameters():
    """A load's request and its handling pass small frozen values (LoadAsk, Target, ...),
    not long lists of switches."""
    too_many = []
    for path in [*modules("_daemon", "load"), *modules("_trainer", "load")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                if len([n for n in names if n not in ("self", "cls")]) > 6:
                    too_many.append(f"{path.name}:{node.lineno} {node.name}")
    assert too_many == []
