"""The safetensors dtypes a checkpoint may hold, by name, with their item sizes.

The one table of them: the shard and manifest checks read it here, and the trainer's torch
mapping (``_trainer.dtypes``) is built from it.
"""

from __future__ import annotations

#: safetensors dtype name -> item size in bytes. The fixed list a checkpoint may use.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "C64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
}
