"""``python -m aiockpt._daemon PKG_PARENT FD``: serve the pipe inherited as FD."""

from __future__ import annotations

import sys

from .server import main

sys.exit(main(sys.argv))
