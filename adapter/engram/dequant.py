"""Dequantisation of a packed Engram row: FP8-E4M3 weights times 2^(E8M0 scale - 127) per 32 values.

E4M3 here is the "fn" variant the checkpoint uses: 1 sign, 4 exponent (bias 7), 3 mantissa bits,
no infinities, S.1111.111 is NaN. E8M0 is a bare biased exponent, 0xFF is NaN. Results are float32
(IEEE rounding: a product beyond float32 range becomes inf). The rank itself dequantises on the GPU;
this is the reference it and the tests agree with.
"""

from __future__ import annotations

import math
import struct
from array import array

from dsv41.engram_format import ROW_BYTES, SCALE_BYTES, VALUES_PER_SCALE, WEIGHT_BYTES


def _e4m3_bits_to_float(b: int) -> float:
    # Re-bias the fields into a float32 bit pattern (normals) or scale the mantissa (subnormals).
    sign, exp, man = b >> 7, (b >> 3) & 0xF, b & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        value = man / 8.0 * 2.0 ** -6
        return -value if sign else value
    bits = (sign << 31) | ((exp - 7 + 127) << 23) | (man << 20)
    return struct.unpack("<f", bits.to_bytes(4, "little"))[0]


E4M3_VALUES: tuple[float, ...] = tuple(_e4m3_bits_to_float(b) for b in range(256))
"""float value of each E4M3 byte, indexable by the byte (usable as a gather table on a GPU)."""


def e8m0_exponent(scale_byte: int) -> float:
    """2^(byte-127) as a Python float (NaN for 0xFF)."""
    return math.nan if scale_byte == 0xFF else math.ldexp(1.0, scale_byte - 127)


def dequantize_row(row: bytes | bytearray | memoryview) -> array:
    """256 float32 values of one 264-byte packed row (weights, then the 8 scales)."""
    if len(row) != ROW_BYTES:
        raise ValueError(f"a packed row is {ROW_BYTES} bytes, got {len(row)}")
    out = array("f", bytes(4 * WEIGHT_BYTES))
    for block in range(SCALE_BYTES):
        factor = e8m0_exponent(row[WEIGHT_BYTES + block])
        base = block * VALUES_PER_SCALE
        for i in range(base, base + VALUES_PER_SCALE):
            out[i] = E4M3_VALUES[row[i]] * factor
    return out
