"""The trainer's half of a load, a module per step.

- request.py: how a load asks the daemon for its bytes;
- targets.py: what a target asks of a load (keys, DTensor boxes), and what it left out;
- views.py: the loaded bytes mapped and viewed as tensors;
- early.py: work done while the daemon reads, its answer collected; a load as new objects;
- restore.py, restore_order.py: the restore into existing objects, planned and carried out
  (in one order on every rank);
- windows.py: a load through two window slabs (``staging_memory``), atomic or streamed;
- loader.py: :class:`Loader`, which the manager hands each load to.
"""

from .loader import Loader
from .targets import check_keys

__all__ = ["Loader", "check_keys"]
