"""Dequantisation against a reference written here from the FP8 bit layouts (OCP FP8 E4M3 "fn"
and the E8M0 scale), not from the module under test."""

from __future__ import annotations

import math
import struct

import pytest

from adapter.engram.dequant import E4M3_VALUES, dequantize_row

pytestmark = pytest.mark.unit


def e4m3_reference(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0b1111, byte & 0b111
    if exponent == 0b1111 and mantissa == 0b111:
        return math.nan
    if exponent == 0:  # subnormal: 0.mmm x 2^(1 - bias)
        return sign * mantissa * 2.0 ** (1 - 7 - 3)
    return sign * (8 + mantissa) * 2.0 ** (exponent - 7 - 3)  # 1.mmm x 2^(e - bias)


def as_float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.mark.parametrize("byte", range(256))
def test_every_e4m3_code(byte: int) -> None:
    want, got = e4m3_reference(byte), E4M3_VALUES[byte]
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want and math.copysign(1, got) == math.copysign(1, want)


def test_spec_anchor_values() -> None:
    assert E4M3_VALUES[0x7E] == 448.0  # largest finite
    assert E4M3_VALUES[0x08] == 2.0 ** -6  # smallest normal
    assert E4M3_VALUES[0x01] == 2.0 ** -9  # smallest subnormal
    assert E4M3_VALUES[0xB8] == -1.0
    assert math.isnan(E4M3_VALUES[0x7F]) and math.isnan(E4M3_VALUES[0xFF])
    assert sum(math.isnan(v) for v in E4M3_VALUES) == 2  # no infinities in the fn variant


def test_row_uses_one_scale_per_32_values() -> None:
    weights = bytes((i * 37 + 11) % 256 for i in range(256))
    scales = bytes([127, 128, 120, 0, 134, 127, 140, 255])
    got = dequantize_row(weights + scales)
    assert len(got) == 256 and got.itemsize == 4
    for i in range(256):
        want = as_float32(e4m3_reference(weights[i]) * 2.0 ** (scales[i // 32] - 127)) \
            if scales[i // 32] != 255 else math.nan
        if math.isnan(want):
            assert math.isnan(got[i]), i
        else:
            assert got[i] == want, i


def test_row_length_is_checked() -> None:
    with pytest.raises(ValueError, match="264 bytes, got 256"):
        dequantize_row(bytes(256))
