"""GGUF's non-linear types (IQ4_NL, IQ4_XS, the IQ1/IQ2/IQ3 lattice types) and the
ternary ones (TQ1_0, TQ2_0), decoded into QuantWeight's terms without loss.

Every IQ type's weight is a per-group scale times one of at most 16 values: IQ4's 16
non-uniform levels; or, for the lattice types, a grid entry's value with a sign (IQ2: 3
magnitudes, IQ3: 8) or plus a per-group offset of +-1/8 (IQ1: 3 values and 2 offsets).
Decoding the grids at load turns each into QuantWeight's codebook form: 4-bit codes into a
16-value codebook under the block's fp16 ``d`` times an integer sub-scale per 16 or 32
(IQ4_NL: its fp16 scale alone). ggml's sub-scale ``d * (0.5 + s) * step`` becomes the
integer ``2s + 1`` with ``step / 2`` folded into the codebook (IQ2: grid values / 8, IQ3_XXS:
/ 4), a power of two; every product involved has at most 22 significant bits, so
``super * sub * codebook[code]`` is exactly gguf-py's fp32 ``scale * grid * sign`` (or
``scale * (grid + delta)``) whatever the order. TQ1_0/TQ2_0 are linear: 2-bit codes with
zero point 1 under an fp16 scale per 256.

Byte layouts follow ggml's block structs, as gguf-py's ``gguf/quants.py`` mirrors them.
"""

from __future__ import annotations

import base64
import zlib
from functools import cache

import numpy as np
import torch

from .gguf_blocks import BlockType, Decoded, fp16
from .iq_grids import GRIDS

IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29
TQ1_0, TQ2_0 = 34, 35

# ggml's kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 levels.
IQ4_VALUES = (-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0)
IQ1_DELTA = 0.125  # ggml's IQ1S_DELTA

# ggml's ksigns_iq2xs: 7 stored sign bits, the 8th making the count of minus signs even.
_KSIGNS = torch.tensor([i | (0x80 if bin(i).count("1") % 2 else 0) for i in range(128)], dtype=torch.uint8)


@cache
def _grid(name: str) -> torch.Tensor:
    """The grid's entries as indices into its values, uint8 ``[rows, width]``."""
    _, rows, width, data = GRIDS[name]
    raw = zlib.decompress(base64.b64decode("".join(data)))
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(rows, width)


def _signed_codebook(name: str, unit: float) -> tuple[float, ...]:
    """A lattice type's values times ``unit``, then their negatives, padded to 16 (code =
    index + n if negative)."""
    values = [v * unit for v in GRIDS[name][0]]
    return (*values, *(-v for v in values), *([0.0] * (16 - 2 * len(values))))


# IQ1: the grid's -1, 0, 1 plus the group's delta, then minus it (code = index + 3 if negative delta).
_IQ1_CODEBOOK = (*(v + IQ1_DELTA for v in GRIDS["IQ1_S"][0]), *(v - IQ1_DELTA for v in GRIDS["IQ1_S"][0]),
                 *([0.0] * 10))


def _words(blocks: torch.Tensor, start: int, stop: int, width: int) -> torch.Tensor:
    """Little-endian ``width``-byte unsigned fields of bytes ``start:stop``, as int64."""
    fields = blocks[:, start:stop].to(torch.int64).view(blocks.shape[0], -1, width)
    return sum(fields[..., i] << (8 * i) for i in range(width))  # type: ignore[return-value]


def _bits(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Fields ``(x >> width * i) & mask`` for ``i < count`` on a new last axis."""
    shifts = torch.arange(0, width * count, width, dtype=torch.int64)
    return (x.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def _lattice(name: str, index: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Codes for grid entries ``index [blocks, entries]`` with per-element sign bits
    ``negative [blocks, entries * width]``."""
    values = _grid(name)[index].reshape(index.shape[0], -1).to(torch.int64)
    return (values + negative.to(torch.int64) * len(GRIDS[name][0])).to(torch.uint8)


def _sign_bits(sign_index: torch.Tensor) -> torch.Tensor:
    """Per-element minus flags from 7-bit ksigns indices ``[blocks, n]`` -> ``[blocks, n * 8]``."""
    return _bits(_KSIGNS[sign_index], 1, 8).reshape(sign_index.shape[0], -1)


def _odd(nibbles: torch.Tensor) -> torch.Tensor:
    """The integer sub-scales ``2s + 1`` (at most 31) of 3- or 4-bit fields ``s``."""
    return (2 * nibbles + 1).to(torch.int8)


def _decode_iq2_xxs(blocks: torch.Tensor) -> Decoded:
    # d | 8 x (u32 four grid indices, u32: four 7-bit sign indices and a 4-bit scale)
    n = blocks.shape[0]
    words = _words(blocks, 2, 66, 4).view(n, 8, 2)
    index = blocks[:, 2:66].view(n, 8, 8)[:, :, 0:4].reshape(n, 32).long()
    signs = _sign_bits(_bits(words[..., 1], 7, 4).reshape(n, 32))
    return Decoded(_lattice("IQ2_XXS", index, signs), _odd(words[..., 1] >> 28), super_scales=fp16(blocks, 0))


def _decode_iq2_xs(blocks: torch.Tensor) -> Decoded:
    # d | 32 x u16 (9-bit grid index, 7-bit sign index) | 8 bytes of two 4-bit scales (per 16)
    n = blocks.shape[0]
    qs = _words(blocks, 2, 66, 2)
    scales = _odd(_bits(blocks[:, 66:74], 4, 2).reshape(n, 16))
    return Decoded(_lattice("IQ2_XS", qs & 511, _sign_bits(qs >> 9)), scales, super_scales=fp16(blocks, 0))


def _decode_iq2_s(blocks: torch.Tensor) -> Decoded:
    # d | 32 grid index low bytes | 32 sign bytes | 8 bytes of four 2-bit index tops | 8 scale bytes (per 16)
    n = blocks.shape[0]
    index = blocks[:, 2:34].long() | (_bits(blocks[:, 66:74], 2, 4).reshape(n, 32) << 8)
    signs = _bits(blocks[:, 34:66], 1, 8).reshape(n, 256)
    scales = _odd(_bits(blocks[:, 74:82], 4, 2).reshape(n, 16))
    return Decoded(_lattice("IQ2_S", index, signs), scales, super_scales=fp16(blocks, 0))


def _decode_iq3_xxs(blocks: torch.Tensor) -> Decoded:
    # d | 64 grid indices (4 values each) | 8 x u32 (four 7-bit sign indices, a 4-bit scale)
    n = blocks.shape[0]
    words = _words(blocks, 66, 98, 4)
    signs = _sign_bits(_bits(words, 7, 4).reshape(n, 32))
    return Decoded(_lattice("IQ3_XXS", blocks[:, 2:66].long(), signs), _odd(words >> 28), super_scales=fp16(blocks, 0))


def _decode_iq3_s(blocks: torch.Tensor) -> Decoded:
    # d | 64 grid index low bytes | 8 bytes of index top bits | 32 sign bytes | 4 bytes of 4-bit scales
    n = blocks.shape[0]
    index = blocks[:, 2:66].long() | (_bits(blocks[:, 66:74], 1, 8).reshape(n, 64) << 8)
    signs = _bits(blocks[:, 74:106], 1, 8).reshape(n, 256)
    scales = _odd(_bits(blocks[:, 106:110], 4, 2).reshape(n, 8))
    return Decoded(_lattice("IQ3_S", index, signs), scales, super_scales=fp16(blocks, 0))


def _iq1_codes(index: torch.Tensor, negative_delta: torch.Tensor) -> torch.Tensor:
    """IQ1 codes: grid entries ``index [blocks, entries]`` (8 values each), each entry's
    delta sign ``negative_delta [blocks, entries]``."""
    values = _grid("IQ1_S")[index].to(torch.int64)
    return (values + 3 * negative_delta.to(torch.int64).unsqueeze(-1)).reshape(index.shape[0], -1).to(torch.uint8)


def _decode_iq1_s(blocks: torch.Tensor) -> Decoded:
    # d | 32 grid index low bytes | 8 x u16 (four 3-bit index tops, a 3-bit scale, the delta's sign)
    n = blocks.shape[0]
    qh = _words(blocks, 34, 50, 2)
    index = blocks[:, 2:34].long() | (_bits(qh, 3, 4).reshape(n, 32) << 8)
    negative = ((qh >> 15) & 1).repeat_interleave(4, dim=1)
    return Decoded(_iq1_codes(index, negative), _odd((qh >> 12) & 7), super_scales=fp16(blocks, 0))


def _decode_iq1_m(blocks: torch.Tensor) -> Decoded:
    # 32 grid index low bytes | 16 bytes, a nibble per entry (3-bit index top, the delta's sign) |
    # 4 x u16: four 3-bit scales (per 16) each, their top nibbles making up the fp16 d
    n = blocks.shape[0]
    qh = _bits(blocks[:, 32:48], 4, 2).reshape(n, 32)
    index = blocks[:, 0:32].long() | ((qh & 7) << 8)
    packed = _words(blocks, 48, 56, 2)
    d_bits = ((packed >> 12) << torch.tensor([0, 4, 8, 12])).sum(dim=1)
    d = torch.from_numpy(d_bits.numpy().astype(np.uint16).view(np.float16)).unsqueeze(1)
    return Decoded(_iq1_codes(index, qh >> 3), _odd(_bits(packed, 3, 4).reshape(n, 16)), super_scales=d)


def _decode_iq4_nl(blocks: torch.Tensor) -> Decoded:
    # d | 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones
    codes = _bits(blocks[:, 2:18], 4, 2).transpose(1, 2).reshape(blocks.shape[0], 32)
    return Decoded(codes.to(torch.uint8), fp16(blocks, 0))


def _decode_iq4_xs(blocks: torch.Tensor) -> Decoded:
    # d | u16 top 2 bits of the 8 scales | 4 bytes of low scale nibbles | 8 x 16 bytes laid out as IQ4_NL's
    n = blocks.shape[0]
    high = _bits(_words(blocks, 2, 4, 2), 2, 8).reshape(n, 8)
    low = _bits(blocks[:, 4:8], 4, 2).reshape(n, 8)
    sub = ((low | (high << 4)) - 32).to(torch.int8)
    codes = _bits(blocks[:, 8:136].reshape(n, 8, 16), 4, 2).transpose(2, 3).reshape(n, 256)
    return Decoded(codes.to(torch.uint8), sub, super_scales=fp16(blocks, 0))


def _decode_tq1_0(blocks: torch.Tensor) -> Decoded:
    # 48 bytes of five base-3 digits each (as a fraction of 256) | 4 bytes of four | d.
    # Digit j of byte b is ((b * 3**j mod 256) * 3) >> 8; element order: digit-major per run.
    n = blocks.shape[0]

    def digits(part: torch.Tensor, count: int) -> torch.Tensor:
        powers = torch.tensor([3**j for j in range(count)], dtype=torch.int64).view(1, count, 1)
        return (((part.long().unsqueeze(1) * powers) & 0xFF) * 3 >> 8).reshape(n, -1)

    codes = torch.cat((digits(blocks[:, 0:32], 5), digits(blocks[:, 32:48], 5), digits(blocks[:, 48:52], 4)), dim=1)
    return Decoded(codes.to(torch.uint8), fp16(blocks, 52))


def _decode_tq2_0(blocks: torch.Tensor) -> Decoded:
    # 64 bytes: 32-byte run r holds elements 128r + 32s + j at bits 2s | d
    n = blocks.shape[0]
    codes = _bits(blocks[:, 0:64].reshape(n, 2, 32), 2, 4).transpose(2, 3).reshape(n, 256)
    return Decoded(codes.to(torch.uint8), fp16(blocks, 64))


# Lattice and IQ4 types: codebook form (no zero point); TQ: linear, zero point 1. The
# codebook units are ggml's sub-scale step halved: (0.5 + s) * step = (2s + 1) * step / 2.
IQ_TYPES: dict[int, BlockType] = {
    IQ2_XXS: BlockType(256, 66, 4, 32, None, torch.int8, _decode_iq2_xxs, _signed_codebook("IQ2_XXS", 0.125)),
    IQ2_XS: BlockType(256, 74, 4, 16, None, torch.int8, _decode_iq2_xs, _signed_codebook("IQ2_XS", 0.125)),
    IQ2_S: BlockType(256, 82, 4, 16, None, torch.int8, _decode_iq2_s, _signed_codebook("IQ2_S", 0.125)),
    IQ3_XXS: BlockType(256, 98, 4, 32, None, torch.int8, _decode_iq3_xxs, _signed_codebook("IQ3_XXS", 0.25)),
    IQ3_S: BlockType(256, 110, 4, 32, None, torch.int8, _decode_iq3_s, _signed_codebook("IQ3_S", 1.0)),
    IQ1_S: BlockType(256, 50, 4, 32, None, torch.int8, _decode_iq1_s, _IQ1_CODEBOOK),
    IQ1_M: BlockType(256, 56, 4, 16, None, torch.int8, _decode_iq1_m, _IQ1_CODEBOOK),
    IQ4_NL: BlockType(32, 18, 4, 32, None, torch.float16, _decode_iq4_nl, IQ4_VALUES),
    IQ4_XS: BlockType(256, 136, 4, 32, None, torch.int8, _decode_iq4_xs, IQ4_VALUES),
    TQ1_0: BlockType(256, 54, 2, 256, 1, torch.float16, _decode_tq1_0),
    TQ2_0: BlockType(256, 66, 2, 256, 1, torch.float16, _decode_tq2_0),
}
