"""The daemon's half of a load: one rank's tensors of a step, read and verified into shared
memory, a module per step.

- plan.py: what a load reads and where each tensor goes in its output;
- graft.py: one namespace of keys, what a rank did not save read from the ranks that did;
- verify.py: the checksums of what was read, and the tree and header checks;
- read.py: reading a plan into a slab or segment;
- answer.py: loads answered before their bytes are read;
- windows.py: loads in windows, and streamed loads;
- reader.py: :class:`Reader`, which serves the load requests.
"""

from .reader import Reader

__all__ = ["Reader"]
