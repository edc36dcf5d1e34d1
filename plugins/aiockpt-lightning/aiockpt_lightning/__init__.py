"""aiockpt for PyTorch Lightning: a ``CheckpointIO`` plugin that saves through aiockpt.

``Trainer(plugins=[AiockptCheckpointIO(root)])``: the Trainer's checkpoints are snapshotted
into aiockpt's shared memory and written by its daemon while training goes on. With
``strategy=AiockptFSDPStrategy()`` an FSDP run saves sharded, every rank its own part.
"""

from __future__ import annotations

from ._fsdp import AiockptFSDPStrategy
from ._io import SAVES_PER_GLOBAL_STEP, AiockptCheckpointIO

__all__ = ["SAVES_PER_GLOBAL_STEP", "AiockptCheckpointIO", "AiockptFSDPStrategy"]
__version__ = "0.1.0"
