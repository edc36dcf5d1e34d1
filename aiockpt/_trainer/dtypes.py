"""torch dtypes and the safetensors dtype names a checkpoint stores them under."""

from __future__ import annotations

import torch

from .._core.dtypes import DTYPE_SIZES

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}

#: safetensors dtype name -> torch dtype, for every name of the format's table (a name added
#: there without a torch dtype here fails at import).
ST_TO_TORCH: dict[str, torch.dtype] = {name: _TORCH_DTYPES[name] for name in DTYPE_SIZES}
#: torch dtype -> safetensors dtype name: the dtypes a checkpoint can hold.
TORCH_TO_ST: dict[torch.dtype, str] = {dtype: name for name, dtype in ST_TO_TORCH.items()}
