"""aiockpt for PyTorch Lightning: a ``CheckpointIO`` plugin that saves through aiockpt.

``Trainer(plugins=[AiockptCheckpointIO(root)])``: the Trainer's checkpoints are snapshotted
into aiockpt's shared memory and written by its daemon while training goes on.
"""

from __future__ import annotations

from ._io import SAVES_PER_GLOBAL_STEP, AiockptCheckpointIO

__all__ = ["SAVES_PER_GLOBAL_STEP", "AiockptCheckpointIO"]
__version__ = "0.1.0"
