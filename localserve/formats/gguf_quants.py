"""GGUF tensor data -> dense tensors or lossless ``QuantWeight`` re-packs.

Every supported GGUF block type is a group quantization in disguise: each block holds
fixed-width integer codes plus per-sub-block scales (and offsets). This module unpacks
the codes into ``QuantWeight``'s layout and keeps the scales in a form whose fp32
operations are exactly those of ggml's reference dequantization (as mirrored by gguf-py's
``gguf.quants``), so ``dequantize(gguf_to_weight(...))`` is bit-identical to the
reference. Which reference expression each type reproduces:

- Q4_0: ``d * (q - 8)``, q 4-bit -> zeros 8, fp16 scales d (group 32)
- Q4_1: ``d * q + m``, q 4-bit -> mins ``-m``, fp16 scales d (group 32)
- Q5_0: ``d * (q - 16)``, q 5-bit -> zeros 16, fp16 scales d (group 32)
- Q5_1: ``d * q + m``, q 5-bit -> mins ``-m``, fp16 scales d (group 32)
- Q8_0: ``d * q``, q int8 -> codes ``q + 128``, zeros 128, fp16 scales d (group 32)
- Q2_K: ``(d*sc) * q - (dmin*m)``, q 2-bit -> mins form (group 16)
- Q3_K: ``(d*(sc-32)) * q``, q in -4..3 -> codes ``q + 4``, zeros 4 (group 16)
- Q4_K: ``(d*sc) * q - (dmin*m)``, q 4-bit -> mins form (group 32)
- Q5_K: ``(d*sc) * q - (dmin*m)``, q 5-bit -> mins form (group 32)
- Q6_K: ``(d*sc) * (q - 32)``, q 6-bit -> zeros 32 (group 16)
- MXFP4: ``e8m0_half(e) * kvalues[q]``, q 4-bit -> the codebook form: ``kvalues`` (e2m1
  doubled to integers) as the codebook, the power-of-two scale held exactly in bf16 (group 32)

``code - zero`` is an exact small integer and negating ``m`` is exact, so QuantWeight's
``scales * (code - zero)`` and ``scales * code - mins`` round exactly like the
reference's single multiply (and multiply-then-add). The K-quant products ``d * sc``
do not fit fp16's mantissa, so K-quants keep them factored as QuantWeight's two-level
scales (fp16 ``d``/``dmin`` per 256 inputs, integer ``sc``/``m`` per group), multiplied in
fp32 when dequantizing: the weights stay at about their file size.

Decoding is vectorised over whole blocks and runs over bounded chunks of rows, so a
multi-GiB tensor never needs more than a few tens of MiB of temporaries.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from ..errors import LocalserveError
from ..kernels.quant_weight import QuantWeight, pack_codes
from .gguf_file import GGML_TYPES, LOADABLE_TYPES
from .gguf_blocks import BlockType, Decoded, fp16
from .gguf_iquants import IQ_TYPES

# ggml type ids (stable across llama.cpp versions; names and sizes live in GGML_TYPES).
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
MXFP4 = 39

# MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4): every code's value is an integer,
# and the block's e8m0 scale is halved to match.
MXFP4_VALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)

_DENSE: dict[int, tuple[torch.dtype, int]] = {
    F32: (torch.float32, 4),
    F16: (torch.float16, 2),
    BF16: (torch.bfloat16, 2),
}

# Blocks decoded per step: bounds the unpacked temporaries (a few bytes per element)
# while keeping each step large enough that per-call overhead is negligible.
_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------
# Field helpers. ``blocks`` is always uint8 [n_blocks, block_bytes].


def _split_bits(x: torch.Tensor, width: int, count: int, dim: int) -> torch.Tensor:
    """Fields ``(x >> (width * i)) & mask`` for ``i < count``, stacked on a new axis ``dim``.

    ggml lays sub-fields out so that one byte's fields belong to elements a fixed stride
    apart; choosing where the new axis goes reproduces that element order on reshape.
    """
    shape = [1] * (x.dim() + 1)
    shape[dim] = count
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8).view(shape)
    return (x.unsqueeze(dim) >> shifts) & ((1 << width) - 1)


def _nibbles_halves(qs: torch.Tensor) -> torch.Tensor:
    """Legacy 32-element blocks: the 16 low nibbles are elements 0..15, the high ones 16..31."""
    return _split_bits(qs, 4, 2, 1).reshape(qs.shape[0], -1)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32-bit little-endian mask: bit i (byte i // 8, bit i % 8) is element i's 5th bit."""
    return _split_bits(qh, 1, 8, 2).reshape(qh.shape[0], -1)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high).
    """
    sc_lo, m_lo, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((sc_lo & 0x3F, (mixed & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=1)
    mins = torch.cat((m_lo & 0x3F, (mixed >> 4) | ((m_lo >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 nibble bytes: 32-byte chunk c holds elements 64c..64c+31 in its low
    nibbles and 64c+32..64c+63 in its high nibbles."""
    return _split_bits(qs.reshape(-1, 4, 32), 4, 2, 2).reshape(qs.shape[0], -1)


# ---------------------------------------------------------------------------
# Decoders, one per type. Byte layouts follow ggml's block structs (see gguf-py's
# ``gguf/quants.py``); each comment gives the struct field order.


def _decode_q4_0(blocks: torch.Tensor) -> Decoded:
    # d fp16 | 16 bytes of nibbles
    return Decoded(codes=_nibbles_halves(blocks[:, 2:18]), scales=fp16(blocks, 0))


def _decode_q4_1(blocks: torch.Tensor) -> Decoded:
    # d fp16 | m fp16 | 16 bytes of nibbles; w = d*q + m == d*q - (-m) exactly
    return Decoded(codes=_nibbles_halves(blocks[:, 4:20]), scales=fp16(blocks, 0), mins=-fp16(blocks, 2).float())


def _decode_q5_0(blocks: torch.Tensor) -> Decoded:
    # d fp16 | qh u32 (5th bits) | 16 bytes of nibbles
    codes = _nibbles_halves(blocks[:, 6:22]) | (_high_bits_32(blocks[:, 2:6]) << 4)
    return Decoded(codes=codes, scales=fp16(blocks, 0))


def _decode_q5_1(blocks: torch.Tensor) -> Decoded:
    # d fp16 | m fp16 | qh u32 | 16 bytes of nibbles
    codes = _nibbles_halves(blocks[:, 8:24]) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return Decoded(codes=codes, scales=fp16(blocks, 0), mins=-fp16(blocks, 2).float())


def _decode_q8_0(blocks: torch.Tensor) -> Decoded:
    # d fp16 | 32 int8. Flipping the sign bit maps int8 q to the unsigned code q + 128.
    return Decoded(codes=blocks[:, 2:34] ^ 0x80, scales=fp16(blocks, 0))


def _decode_q2_k(blocks: torch.Tensor) -> Decoded:
    # 16 scale bytes (low nibble scale, high nibble min) | 64 bytes of 2-bit codes | d | dmin.
    # Code byte j of 32-byte half h holds elements 128h + 32s + j at bits 2s..2s+1.
    sc = blocks[:, 0:16]
    codes = _split_bits(blocks[:, 16:80].reshape(-1, 2, 32), 2, 4, 2).reshape(blocks.shape[0], -1)
    return Decoded(codes=codes, scales=sc & 0x0F, mins=sc >> 4, super_scales=fp16(blocks, 80),
                    super_mins=fp16(blocks, 82))


def _decode_q3_k(blocks: torch.Tensor) -> Decoded:
    # hmask 32 bytes | 64 bytes of 2-bit low codes | 12 bytes of 6-bit scales | d.
    n = blocks.shape[0]
    # Low 2 bits: laid out like Q2_K's codes.
    low = _split_bits(blocks[:, 32:96].reshape(-1, 2, 32), 2, 4, 2).reshape(n, -1)
    # Bit k of hmask byte j belongs to element 32k + j. ggml's q is low - 4 when the bit
    # is clear and low when it is set, so code = low + 4*bit = q + 4 spans 0..7, zero 4.
    high = _split_bits(blocks[:, 0:32], 1, 8, 1).reshape(n, -1)
    codes = low | (high << 2)
    # Scales: bytes 0-7 give the low nibbles of scales 0-7 (low nibble) and 8-15 (high
    # nibble); bytes 8-11 give their top 2 bits, scale 4s + j at bits 2s of byte 8 + j.
    packed = blocks[:, 96:108]
    low_sc = _split_bits(packed[:, 0:8], 4, 2, 1).reshape(n, 16)
    high_sc = _split_bits(packed[:, 8:12], 2, 4, 1).reshape(n, 16)
    signed = (low_sc | (high_sc << 4)).to(torch.int8) - 32  # 6-bit offset-32 scale
    return Decoded(codes=codes, scales=signed, super_scales=fp16(blocks, 108))


def _decode_q4_k(blocks: torch.Tensor) -> Decoded:
    # d | dmin | 12 bytes of scales/mins | 128 bytes of nibbles
    sc, m = _k_scale_min(blocks[:, 4:16])
    return Decoded(codes=_k_low_nibbles(blocks[:, 16:144]), scales=sc, mins=m, super_scales=fp16(blocks, 0),
                    super_mins=fp16(blocks, 2))


def _decode_q5_k(blocks: torch.Tensor) -> Decoded:
    # d | dmin | 12 bytes of scales/mins | qh 32 bytes | 128 bytes of nibbles.
    # Bit k of qh byte j is the 5th bit of element 32k + j.
    sc, m = _k_scale_min(blocks[:, 4:16])
    high = _split_bits(blocks[:, 16:48], 1, 8, 1).reshape(blocks.shape[0], -1)
    codes = _k_low_nibbles(blocks[:, 48:176]) | (high << 4)
    return Decoded(codes=codes, scales=sc, mins=m, super_scales=fp16(blocks, 0), super_mins=fp16(blocks, 2))


def _decode_q6_k(blocks: torch.Tensor) -> Decoded:
    # ql 128 bytes | qh 64 bytes | 16 int8 scales | d.
    n = blocks.shape[0]
    # ql: 64-byte half h holds elements 128h + j (low nibble) and 128h + 64 + j (high).
    low = _split_bits(blocks[:, 0:128].reshape(-1, 2, 64), 4, 2, 2).reshape(n, -1)
    # qh: 32-byte half h holds the top 2 bits of elements 128h + 32s + j at bits 2s.
    high = _split_bits(blocks[:, 128:192].reshape(-1, 2, 32), 2, 4, 2).reshape(n, -1)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    return Decoded(codes=low | (high << 4), scales=scales, super_scales=fp16(blocks, 208))


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """ggml's ``e8m0_to_fp32_half``: 2 ** (e - 128) per uint8 exponent, exactly, as bf16
    (whose range is fp32's, subnormals down to 2**-133 included)."""
    return torch.ldexp(torch.ones(exponents.shape), exponents.to(torch.int32) - 128).to(torch.bfloat16)


def _decode_mxfp4(blocks: torch.Tensor) -> Decoded:
    # e (e8m0) | 16 bytes of nibbles, laid out as Q4_0's
    return Decoded(codes=_nibbles_halves(blocks[:, 1:17]), scales=e8m0_half(blocks[:, 0:1]))


_BLOCK_TYPES: dict[int, BlockType] = {
    Q4_0: BlockType(32, 18, 4, 32, 8, torch.float16, _decode_q4_0),
    Q4_1: BlockType(32, 20, 4, 32, None, torch.float16, _decode_q4_1),
    Q5_0: BlockType(32, 22, 5, 32, 16, torch.float16, _decode_q5_0),
    Q5_1: BlockType(32, 24, 5, 32, None, torch.float16, _decode_q5_1),
    Q8_0: BlockType(32, 34, 8, 32, 128, torch.float16, _decode_q8_0),
    Q2_K: BlockType(256, 84, 2, 16, None, torch.uint8, _decode_q2_k),
    Q3_K: BlockType(256, 110, 3, 16, 4, torch.int8, _decode_q3_k),
    Q4_K: BlockType(256, 144, 4, 32, None, torch.uint8, _decode_q4_k),
    Q5_K: BlockType(256, 176, 5, 32, None, torch.uint8, _decode_q5_k),
    Q6_K: BlockType(256, 210, 6, 16, 32, torch.int8, _decode_q6_k),
    MXFP4: BlockType(32, 17, 4, 32, None, torch.bfloat16, _decode_mxfp4, codebook=MXFP4_VALUES),
    **IQ_TYPES,  # gguf_iquants.py: codebook forms, TQ linear with zero point 1
}


assert set(_DENSE) | set(_BLOCK_TYPES) == LOADABLE_TYPES, "gguf_file.LOADABLE_TYPES must name what converts"


def _type_name(ggml_type: int) -> str:
    known = GGML_TYPES.get(ggml_type)
    return known[0] if known is not None else f"unknown type id {ggml_type}"


def _byte_view(name: str, raw: np.ndarray) -> np.ndarray:
    if not isinstance(raw, np.ndarray):
        raise LocalserveError(f"tensor {name!r}: data must be a numpy byte array, got {type(raw).__name__}")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        # A reader hands over flat bytes; accept any contiguous buffer by reinterpreting it.
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return raw


def _check_size(name: str, raw: np.ndarray, expected: int, what: str) -> None:
    if raw.size != expected:
        raise LocalserveError(
            f"tensor {name!r}: {what} needs exactly {expected} bytes of data but has {raw.size}; "
            "the file is truncated or its tensor table is corrupt"
        )


def _rows_and_width(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row_elements)``: a 1-D tensor is one row; leading dimensions of a >2-D
    tensor (stacked MoE experts) fold into rows, since blocks run along the last one."""
    try:
        dims = [operator.index(d) for d in shape]  # numpy ints are fine, floats are not
    except TypeError:
        dims = []
    if len(dims) == 0 or len(dims) != len(shape) or any(d < 0 for d in dims):
        raise LocalserveError(f"tensor {name!r}: invalid shape {shape}")
    shape = tuple(dims)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _dense(name: str, raw: np.ndarray, dtype: torch.dtype, item_bytes: int, shape: tuple[int, ...]) -> torch.Tensor:
    rows, width = _rows_and_width(name, shape)
    _check_size(name, raw, rows * width * item_bytes, f"{str(dtype).removeprefix('torch.')} shape {shape}")
    # Copy: ``raw`` is a read-only view of a memory-mapped file that may be closed later.
    data = torch.from_numpy(np.array(raw))
    return data.view(dtype).reshape(shape)


def _quantized(name: str, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantWeight:
    bt = _BLOCK_TYPES[ggml_type]
    type_name = _type_name(ggml_type)
    rows, width = _rows_and_width(name, shape)
    if width % bt.block_elements:
        raise LocalserveError(
            f"tensor {name!r}: {type_name} rows must be a multiple of {bt.block_elements} elements, "
            f"but shape {shape} has rows of {width}"
        )
    blocks_per_row = width // bt.block_elements
    row_bytes = blocks_per_row * bt.block_bytes
    _check_size(name, raw, rows * row_bytes, f"{type_name} shape {shape}")

    groups = width // bt.group_size
    codes = torch.empty((rows, width // 2 if bt.bits <= 4 else width), dtype=torch.uint8)
    scales = torch.empty((rows, groups), dtype=bt.scale_dtype)
    mins_form = bt.zero is None and bt.codebook is None
    mins = torch.empty((rows, groups), dtype=torch.uint8 if bt.two_level else torch.float32) if mins_form else None
    # Two-level scales: one fp16 super-scale (and super-min) per block.
    super_scales = torch.empty((rows, blocks_per_row), dtype=torch.float16) if bt.two_level else None
    super_mins = super_scales.clone() if super_scales is not None and mins_form else None

    # Loop over chunks of whole rows (not over blocks): each step decodes every block of
    # its rows with vectorised tensor ops.
    step = max(1, _CHUNK_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        n_rows = stop - start
        # Copy just this chunk out of the (read-only, memory-mapped) source.
        chunk = torch.from_numpy(np.array(raw[start * row_bytes:stop * row_bytes]))
        decoded = bt.decode(chunk.view(n_rows * blocks_per_row, bt.block_bytes))
        codes[start:stop] = pack_codes(decoded.codes.reshape(n_rows, width), bt.bits)
        scales[start:stop] = decoded.scales.reshape(n_rows, groups)
        if mins is not None:
            assert decoded.mins is not None
            mins[start:stop] = decoded.mins.reshape(n_rows, groups)
        if super_scales is not None:
            assert decoded.super_scales is not None
            super_scales[start:stop] = decoded.super_scales.reshape(n_rows, blocks_per_row)
        if super_mins is not None:
            assert decoded.super_mins is not None
            super_mins[start:stop] = decoded.super_mins.reshape(n_rows, blocks_per_row)

    zeros = torch.full((rows, groups), bt.zero, dtype=torch.uint8) if bt.zero is not None else None
    codebook = torch.tensor(bt.codebook, dtype=torch.float32) if bt.codebook is not None else None
    return QuantWeight(bits=bt.bits, group_size=bt.group_size, codes=codes, scales=scales, zeros=zeros, mins=mins,
                       codebook=codebook,
                       super_scales=super_scales, super_mins=super_mins,
                       groups_per_super=bt.block_elements // bt.group_size if bt.two_level else 1,
                       # ggml's CPU dot products round x to 8 bits for every quantized type, per
                       # block of the type's own size (Q8_0/Q8_1: 32, Q8_K: 256); so do ours.
                       int8_block=bt.block_elements)


def loaded_nbytes(name: str, ggml_type: int, shape: tuple[int, ...], dense_item_bytes: int) -> int:
    """Bytes a tensor of this type and shape takes once loaded, read from nothing but its
    type and shape: dense types at ``dense_item_bytes`` per element (the model dtype),
    block types as the QuantWeight that one all-zero row decodes to, times the rows
    (every QuantWeight field has one row per output)."""
    rows, width = _rows_and_width(name, tuple(shape))
    if ggml_type in _DENSE:
        return rows * width * dense_item_bytes
    bt = _BLOCK_TYPES.get(ggml_type)
    if bt is None:
        raise _unsupported_type(name, ggml_type)
    # A width that is not whole blocks fails in _quantized with the loader's message.
    zero_row = np.zeros(width // bt.block_elements * bt.block_bytes, np.uint8)
    return rows * _quantized(name, zero_row, ggml_type, (1, width)).nbytes


def gguf_to_weight(name: str, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor | QuantWeight:
    """One GGUF tensor as a dense tensor (F32/F16/BF16, in ``shape``) or a ``QuantWeight``.

    ``raw`` is the tensor's bytes (a read-only memmap view is fine: what is kept is
    copied); ``shape`` is in torch order, ``(rows, row_elements)`` for a matrix or
    ``(n,)`` for a vector, which becomes a one-row QuantWeight when quantized. The
    QuantWeight dequantizes bit-exactly to ggml's reference. Other types (Q8_1, Q8_K,
    integer types, unknown ids) raise ``LocalserveError``.
    """
    raw = _byte_view(name, raw)
    shape = tuple(shape)
    dense = _DENSE.get(ggml_type)
    if dense is not None:
        return _dense(name, raw, dense[0], dense[1], shape)
    if ggml_type in _BLOCK_TYPES:
        return _quantized(name, raw, ggml_type, shape)
    raise _unsupported_type(name, ggml_type)


def _unsupported_type(name: str, ggml_type: int) -> LocalserveError:
    supported = ", ".join(_type_name(t) for t in (*_DENSE, *_BLOCK_TYPES))
    return LocalserveError(
        f"tensor {name!r} has GGUF type {_type_name(ggml_type)}, which localserve cannot load "
        f"(supported: {supported}); re-quantize the model to one of those types"
    )
