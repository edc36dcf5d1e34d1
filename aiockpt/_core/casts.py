"""Floating-point casts of raw little-endian tensor bytes, without torch or numpy: what
``aiockpt export --dtype`` writes (a model trained in fp32 is usually published in bf16).

The results are bit for bit torch's ``.to(dtype)``: round to nearest, ties to even; fp16
overflows to infinity; a NaN becomes bf16 ``0x7FC0`` (torch's) or fp16's quiet NaN keeping
its sign. Every cast goes through fp32, as torch's does from fp64.

- fp32 -> bf16 works on 32-bit lanes of one large Python int (SIMD within a register): the
  rounding carry, the NaN test and the result are a few big-int operations per piece, which
  CPython runs in C, and the halves are picked out by strided byte slicing.
- fp16 goes through ``struct``'s ``e`` format, which rounds as IEEE does; values it refuses as
  too large become infinities, as torch's cast makes them.

Shared, pure code: the CLI uses it.
"""

from __future__ import annotations

import math
import struct

__all__ = ["FLOATING", "cast_bytes"]

#: The dtypes cast (safetensors names); the others are written as they are.
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})
#: Elements cast at a time: bounds the memory of a cast to a few times this many bytes.
PIECE = 1 << 20

_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def cast_bytes(data: bytes | memoryview, src: str, dst: str) -> bytes:
    """The elements of ``data`` (dtype ``src``) as ``dst``; both in :data:`FLOATING`."""
    if src == dst:
        return bytes(data)
    view = memoryview(data).cast("B")
    step = PIECE * _ITEM[src]
    return b"".join(
        _from_f32(_to_f32(view[i : i + step], src), dst) for i in range(0, len(view), step)
    )


def _pack(fmt: str, values: tuple[float, ...] | list[float]) -> bytes:
    """``struct.pack`` of ``values``; one too large for the format becomes an infinity."""
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except OverflowError:
        out = []
        for v in values:
            try:
                out.append(struct.pack(f"<{fmt}", v))
            except OverflowError:
                out.append(struct.pack(f"<{fmt}", math.copysign(math.inf, v)))
        return b"".join(out)


def _to_f32(data: memoryview, src: str) -> bytes:
    n = len(data) // _ITEM[src]
    if src == "F32":
        return bytes(data)
    if src == "BF16":  # the upper half of an fp32: exact
        out = bytearray(4 * n)
        out[2::4] = data[0::2]
        out[3::4] = data[1::2]
        return bytes(out)
    unpacked = struct.unpack(f"<{n}{'d' if src == 'F64' else 'e'}", data)
    return _pack("f", unpacked)


def _from_f32(data: bytes, dst: str) -> bytes:
    n = len(data) // 4
    if dst == "F32":
        return data
    if dst == "F64":
        return struct.pack(f"<{n}d", *struct.unpack(f"<{n}f", data))
    if dst == "F16":
        return _pack("e", struct.unpack(f"<{n}f", data))
    return _f32_to_bf16(data, n)


def _lanes(n: int, value: int) -> int:
    """``value`` in each of ``n`` 32-bit lanes."""
    return int.from_bytes(value.to_bytes(4, "little") * n, "little")


def _f32_to_bf16(data: bytes, n: int) -> bytes:
    x = int.from_bytes(data, "little")
    one, low16 = _lanes(n, 1), _lanes(n, 0xFFFF)
    low, high = x & low16, (x >> 16) & low16
    # Round to nearest even: the carry out of the low half plus 0x7FFF and the high half's
    # last bit (17 bits at most: no lane spills into the next).
    carry = ((low + _lanes(n, 0x7FFF) + (high & one)) >> 16) & one
    # NaN: |x| > 0x7F800000, so |x| + 0x7FFFFF reaches bit 31 (and stays under 2**32).
    nan = (((x & _lanes(n, 0x7FFFFFFF)) + _lanes(n, 0x007FFFFF)) >> 31) & one
    rounded = high + (carry & ~nan)  # under 0x10000 for every lane that is not NaN
    result = (rounded & ~(nan * 0xFFFF)) | (nan * 0x7FC0)
    lanes = result.to_bytes(4 * n, "little")
    out = bytearray(2 * n)
    out[0::2] = lanes[0::4]
    out[1::2] = lanes[1::4]
    return bytes(out)
