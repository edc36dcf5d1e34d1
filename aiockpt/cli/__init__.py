"""The ``aiockpt`` command: list, inspect, verify, export, copy and prune a checkpoint root.

``aiockpt ls ROOT [--json]``, ``aiockpt show ROOT STEP|latest [--all] [--json]``, ``aiockpt
verify ROOT [STEP] [--json]``, ``aiockpt prune ROOT [--keep-…] [--yes]``, ``aiockpt export
ROOT OUT --step N`` (whole tensors as plain safetensors, see :mod:`aiockpt._export`) and
``aiockpt copy ROOT STEP DEST``; ``aiockpt --version``. ROOT is a local path or any URL the
storage registry serves. Exit codes: 0 done (and intact), 1 corruption found or the storage
failed, 2 a mistake in the command line, a root that does not exist or (except for ``ls``)
one without checkpoints. It imports neither torch, nor the manager, nor the daemon: manifests
are read (and validated as untrusted) and bytes checked through the catalog and storage layer
the daemon uses, so it starts fast.

One module per command (:mod:`.ls`, :mod:`.show`, :mod:`.verify`, :mod:`.export`,
:mod:`.copy`, :mod:`.prune`), each with its ``add_arguments`` and ``run``; :mod:`.parser`
builds the command line from them; :mod:`.common`, :mod:`.args` and :mod:`.output` are what
they share.
"""

from __future__ import annotations

from .parser import main

__all__ = ["main"]
