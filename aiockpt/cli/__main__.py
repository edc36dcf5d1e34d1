"""``python -m aiockpt.cli``: the ``aiockpt`` command."""

import sys

from .parser import main

sys.exit(main())
