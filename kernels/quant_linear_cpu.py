"""Matmuls on the CPU through the compiled kernels (``cpu_library``).

Three paths, each batch-invariant (a row's result is the same bits at any row count):

- ``TiledWeight``: GGUF's quantized types, re-laid at load for the int8 kernel
  (``csrc/int8_matmul.cpp``). x is rounded to int8 per block as llama.cpp's CPU backend
  rounds it, and the dot products are integer work (VNNI where the CPU has it).
- ``float_matmul``: every other QuantWeight (GPTQ, AWQ, and all weights when the engine
  asks for exact CPU matmuls): x stays fp32, codes are dequantized in registers.
- ``dense_linear``: dense fp32 weights (HF checkpoints, an LM head or a router kept in
  fp32), where a BLAS GEMM would sum a row differently at another batch size.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from . import cpu_library
from .quant_weight import QuantWeight, unpack_codes

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 4}


@dataclass(slots=True, eq=False)
class TiledWeight:
    """A QuantWeight laid out for the int8 kernel (``ls_tiled_weight`` in csrc/api.h):
    output rows in tiles of ``lanes``, codes as four-input words per lane, fp16 scales
    per group and lane (times int8 sub-scales for two-level types), a constant zero point
    or fp16 mins (times uint8 sub-mins); a codebook weight's 16 values as integer levels,
    bytes ``level + 128`` (``levels``, zero 128), each worth ``level_scale`` (a power of
    two). It replaces the QuantWeight it was made from."""

    out_features: int
    in_features: int
    bits: int
    group_size: int
    groups_per_super: int
    zero: int  # -1: the mins form
    x_block: int
    codes: torch.Tensor
    high: torch.Tensor | None  # the top bits of 5- and 6-bit codes
    super_scales: torch.Tensor
    sub_scales: torch.Tensor | None
    super_mins: torch.Tensor | None
    sub_mins: torch.Tensor | None
    levels: torch.Tensor | None = None  # uint8 [16]: a codebook's levels + 128
    level_scale: float = 1.0
    desc: cpu_library.TiledWeightDesc = field(init=False)

    def __post_init__(self) -> None:
        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self.desc = cpu_library.TiledWeightDesc(
            self.out_features, self.in_features, self.bits, self.group_size, self.groups_per_super, self.zero,
            self.x_block, address(self.codes), address(self.high), address(self.super_scales), address(self.sub_scales),
            address(self.super_mins), address(self.sub_mins), address(self.levels), self.level_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        # The 16 levels, like a QuantWeight's codebook, are a per-type constant: not counted.
        tensors = (self.codes, self.high, self.super_scales, self.sub_scales, self.super_mins, self.sub_mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def lanes(self) -> int:
        return self.codes.shape[2]

    # The tensor fields and the number fields, as stored (models/prepared.py).
    TENSORS = ("codes", "high", "super_scales", "sub_scales", "super_mins", "sub_mins", "levels")
    NUMBERS = ("out_features", "in_features", "bits", "group_size", "groups_per_super", "zero", "x_block",
               "level_scale")

    def stored(self) -> tuple[dict[str, int | float], dict[str, torch.Tensor]]:
        """(number fields, tensor fields present): what ``restore`` takes back."""
        tensors = {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}
        return {name: getattr(self, name) for name in self.NUMBERS}, tensors

    @classmethod
    def restore(cls, numbers: dict[str, int | float], tensors: dict[str, torch.Tensor], lanes: int) -> TiledWeight:
        """A weight from ``stored``'s parts, every tensor's dtype and shape checked against
        what ``tile`` makes for these numbers (the kernel trusts them): ValueError if not."""
        try:
            n, k, bits, group = (int(numbers[name]) for name in ("out_features", "in_features", "bits", "group_size"))
            per_super, zero, x_block = (int(numbers[name]) for name in ("groups_per_super", "zero", "x_block"))
            level_scale = float(numbers["level_scale"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a stored tiled weight's numbers are incomplete: {exc}") from None
        if not (n > 0 and k > 0 and bits in (2, 3, 4, 5, 6, 8) and group > 0 and per_super > 0 and x_block > 0
                and k % x_block == 0 and x_block % group == 0 and (group == 16 or group % 32 == 0)
                and (k // group) % per_super == 0 and -1 <= zero <= 255 and lanes > 0):
            raise ValueError(f"a stored tiled weight's numbers make no weight: {numbers}")
        tiles, groups = -(-n // lanes), k // group
        two_level = "sub_scales" in tensors
        supers = groups // per_super if two_level else groups
        u8, f16 = torch.uint8, torch.float16
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "codes": ((tiles, k // (8 if bits <= 6 else 4), lanes, 4), u8),
            "super_scales": ((tiles, supers, lanes), f16)}
        if 4 < bits <= 6:
            expected["high"] = ((tiles, k // 32, bits - 4, lanes, 4), u8)
        if two_level:
            expected["sub_scales"] = ((tiles, groups, lanes), torch.int8)
        if zero < 0:
            expected["super_mins"] = ((tiles, supers, lanes), f16)
            if two_level:
                expected["sub_mins"] = ((tiles, groups, lanes), u8)
        if "levels" in tensors:
            expected["levels"] = ((16,), u8)
        if set(tensors) != set(expected):
            raise ValueError(f"a stored tiled weight has tensors {sorted(tensors)}, expected {sorted(expected)}")
        for name, (shape, dtype) in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"a stored tiled weight's {name} is {t.dtype} {list(t.shape)}, expected {dtype} "
                                 f"{list(shape)}")
        return cls(n, k, bits, group, per_super if two_level else 1, zero, x_block, tensors["codes"],
                   tensors.get("high"), tensors["super_scales"], tensors.get("sub_scales"), tensors.get("super_mins"),
                   tensors.get("sub_mins"), tensors.get("levels"), level_scale)

    def row_range(self, start: int, stop: int) -> TiledWeight:
        """Output rows ``start:stop`` as views (one expert of a stack), no copy: ``start``
        begins a tile and ``stop`` ends one or the weight."""
        if start % self.lanes or (stop % self.lanes and stop != self.out_features) or not 0 <= start < stop:
            raise ValueError(f"rows {start}:{stop} do not fall on tiles of {self.lanes}")
        t0, t1 = start // self.lanes, -(-stop // self.lanes)

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[t0:t1]

        return TiledWeight(stop - start, self.in_features, self.bits, self.group_size, self.groups_per_super,
                           self.zero, self.x_block, self.codes[t0:t1], part(self.high), self.super_scales[t0:t1],
                           part(self.sub_scales), part(self.super_mins), part(self.sub_mins), self.levels,
                           self.level_scale)

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` as dense ``[len(index), in_features]`` (an embedding lookup),
        exactly the values the QuantWeight's ``dequantize`` gives."""
        flat = index.reshape(-1).to(torch.int64).contiguous()
        if flat.numel():
            low, high = flat.aminmax()  # one op: a decode step's torch calls run cold
            if not (0 <= int(low) and int(high) < self.out_features):
                raise IndexError(f"row index out of range for {self.out_features} rows")
        out = torch.empty(flat.numel(), self.in_features)
        _library().ls_tiled_dequantize_rows(ctypes.byref(self.desc), flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*index.shape, self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.out_features), dtype)


def for_int8_kernel(weight: QuantWeight) -> QuantWeight | TiledWeight:
    """The weight tiled for the int8 kernel where it can take it (see ``can_tile``) and
    the kernels are built; else the weight itself."""
    return tile(weight) if cpu_library.available() and can_tile(weight) else weight


def can_tile(weight: QuantWeight) -> bool:
    """Whether ``tile`` takes this weight: an ``int8_block`` (GGUF's quantized types), a
    constant zero point, the mins form or a 4-bit codebook of small integers times a power
    of two (the IQ types, MXFP4), fp16-exact scales and mins, no act-order; two-level
    scales in super-blocks of an even number of groups that are the int8 block (the
    K-quants and IQ4_XS: 256 inputs)."""
    block, group = weight.int8_block, weight.group_size
    if weight.codebook is not None and _levels(weight.codebook) is None:
        return False
    if not (weight.bits in (2, 3, 4, 5, 6, 8) and block > 0 and block % 32 == 0 and weight.in_features % block == 0 and weight.perm is None
            and (group == 16 or group % 32 == 0) and block % group == 0 and weight.codes.device.type == "cpu"):
        return False
    if weight.zeros is not None:
        zeros = weight.zeros
        if not (zeros.numel() and int(zeros.min()) == int(zeros.max()) and 0 <= int(zeros.min()) <= 255):
            return False
    two_level = weight.super_scales is not None
    if two_level:
        # The kernel sums a super-block's groups in integers (exact within 256 inputs) two
        # groups at a time, and applies the row's scale once per super-block.
        if not (weight.groups_per_super % 2 == 0 and group * weight.groups_per_super == block <= 256):
            return False
        sub = weight.scales
        if sub.dtype not in (torch.int8, torch.uint8) or (sub.dtype == torch.uint8 and int(sub.max()) > 127):
            return False
        if weight.mins is not None and weight.mins.dtype != torch.uint8:
            return False
    else:
        if not _fp16_exact(weight.scales) or (weight.mins is not None and not _fp16_exact(weight.mins)):
            return False
    return True


def tile(weight: QuantWeight, lanes: int | None = None) -> TiledWeight:
    """``weight`` in the int8 kernel's layout (see ``can_tile``), laid out a few million
    codes at a time so that converting a large matrix (a 128k-row LM head) needs little
    memory beyond its result."""
    lanes = lanes or cpu_library.lanes()
    n, k = weight.shape
    tiles = -(-n // lanes)
    nibbles = weight.bits <= 6  # chunks of 8 inputs: byte i holds input i (low nibble) and i + 4 (high)
    codes = torch.empty(tiles, k // (8 if nibbles else 4), lanes, 4, dtype=torch.uint8)
    high = torch.empty(tiles, k // 32, weight.bits - 4, lanes, 4, dtype=torch.uint8) if 4 < weight.bits <= 6 else None
    step = max(1, (1 << 22) // (lanes * k))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        rows = unpack_codes(weight, rows=slice(t0 * lanes, min(n, t1 * lanes)))
        part = _pad_rows(rows, (t1 - t0) * lanes).view(t1 - t0, lanes, k)
        if nibbles:
            pairs = (part & 0x0F).view(t1 - t0, lanes, k // 8, 2, 4)
            codes[t0:t1] = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).permute(0, 2, 1, 3)
            if high is not None:
                high[t0:t1] = _high_plane(part, weight.bits - 4)
        else:  # chunks of 4 inputs, one per byte
            codes[t0:t1] = part.view(t1 - t0, lanes, k // 4, 4).permute(0, 2, 1, 3)
    two_level = weight.super_scales is not None
    super_scales = weight.super_scales if two_level else weight.scales
    mins = weight.mins
    levels, level_scale = None, 1.0
    if weight.codebook is not None:
        found = _levels(weight.codebook)
        assert found is not None, "can_tile refuses such a codebook"
        levels, level_scale = found
    zero = _LEVEL_ZERO if levels is not None else int(weight.zeros.flatten()[0]) if weight.zeros is not None else -1
    return TiledWeight(
        out_features=n, in_features=k, bits=weight.bits, group_size=weight.group_size,
        groups_per_super=weight.groups_per_super if two_level else 1, zero=zero, x_block=weight.int8_block,
        codes=codes, high=high,
        super_scales=_per_lane(super_scales.to(torch.float16), tiles, lanes),
        sub_scales=_per_lane(weight.scales.to(torch.int8), tiles, lanes) if two_level else None,
        super_mins=(None if mins is None else
                    _per_lane((weight.super_mins if two_level else mins).to(torch.float16), tiles, lanes)),
        sub_mins=_per_lane(mins, tiles, lanes) if mins is not None and two_level else None, levels=levels,
        level_scale=level_scale)


# A codebook's levels are stored shifted by this, as the unsigned bytes the kernel multiplies.
_LEVEL_ZERO = 128


def _levels(codebook: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """A 16-value codebook as the kernel's level bytes (``level + 128``) and what a level
    is worth: the values as integers in -128..127 times 1, 1/2, ... 1/8 (IQ1's and IQ2's
    eighths), or None."""
    if codebook.numel() != 16:
        return None
    for shift in range(4):
        levels = codebook * (1 << shift)
        if torch.equal(levels, levels.round()) and levels.abs().max() <= 127:
            return (levels.to(torch.int16) + _LEVEL_ZERO).to(torch.uint8).contiguous(), 1.0 / (1 << shift)
    return None


def int8_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.empty(flat.shape[0], weight.out_features)
    if flat.shape[0]:
        _library().ls_int8_matmul(ctypes.byref(weight.desc), flat.data_ptr(), flat.shape[0], out.data_ptr())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features).to(x.dtype)


def weight_table(weights: list[TiledWeight]) -> ctypes.Array:
    """The weights' descriptors as the array ``grouped_int8_linear`` takes (keep the
    weights alive as long as the table)."""
    forms = {(w.shape, w.bits, w.group_size, w.groups_per_super, w.zero, w.x_block, w.lanes,
              w.high is None, w.sub_scales is None, w.super_mins is None, w.sub_mins is None, w.levels is None,
              w.level_scale)
             for w in weights}
    if len(forms) != 1:
        raise ValueError("a weight table holds weights of one shape and form")
    return (ctypes.POINTER(cpu_library.TiledWeightDesc) * len(weights))(*[ctypes.pointer(w.desc) for w in weights])


def grouped_int8_linear(x: torch.Tensor, table: ctypes.Array, ids: list[int], counts: list[int],
                        out_features: int) -> torch.Tensor:
    """Groups of rows of ``x [rows, k]``, one after another, each through its own weight
    of ``table`` (all of one shape and form): group ``i``'s ``counts[i]`` rows through
    ``table[ids[i]]``. One call for every group (a mixture of experts' chosen experts);
    each row as ``int8_linear`` computes it alone. ``ids`` and ``counts`` are a few Python
    ints, checked here without a torch op (a decode step makes two such calls per layer)."""
    flat = x.float().contiguous()
    if len(ids) != len(counts) or min(counts, default=0) < 0 or sum(counts) != flat.shape[0]:
        raise ValueError(f"groups of {counts} rows do not make up {flat.shape[0]}")
    if not all(0 <= i < len(table) for i in ids):
        raise IndexError(f"a weight index is outside the table of {len(table)}")
    out = torch.empty(flat.shape[0], out_features)
    _library().ls_grouped_int8_matmul(table, (ctypes.c_int64 * len(ids))(*ids), (ctypes.c_int64 * len(counts))(*counts),
                                      len(ids), flat.data_ptr(), out.data_ptr())
    return out


def float_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.empty(flat.shape[0], weight.out_features)
    if flat.shape[0]:
        desc = cpu_library.QuantWeightDesc(
            weight.out_features, weight.in_features, weight.bits, weight.group_size, weight.groups_per_super,
            int(weight.mins is not None), weight.codes.data_ptr(), _factors(weight.scales),
            _factors(weight.zeros if weight.zeros is not None else weight.mins), _factors(weight.super_scales),
            _factors(weight.super_mins))
        _library().ls_float_matmul(ctypes.byref(desc), flat.data_ptr(), flat.shape[0], out.data_ptr())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features).to(x.dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a dense fp32 weight, each row summed the same way at
    any row count (``csrc/dense_matmul.cpp``)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(flat.shape[0], weight.shape[0])
    if flat.shape[0]:
        _library().ls_dense_matmul(weight.data_ptr(), weight.shape[0], weight.shape[1], flat.data_ptr(),
                                   flat.shape[0], out.data_ptr())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def supports_dense(weight: torch.Tensor) -> bool:
    return cpu_library.available() and weight.dim() == 2 and weight.is_contiguous()


def supports(weight: QuantWeight) -> bool:
    """Every QuantWeight layout the float kernel reads (contiguous, CPU tensors)."""
    return (cpu_library.available() and weight.codebook is None
            and all(t.is_contiguous() for t in weight._tensors().values()))


def _library() -> ctypes.CDLL:
    lib = cpu_library.library()
    assert lib is not None, "the CPU kernels are not available"
    return lib


def _factors(t: torch.Tensor | None) -> cpu_library.Factors:
    if t is None:
        return cpu_library.Factors(None, 0, 0)
    assert t.dim() == 2 and t.is_contiguous() and t.dtype in _DTYPES
    return cpu_library.Factors(t.data_ptr(), _DTYPES[t.dtype], t.shape[1])


def _fp16_exact(t: torch.Tensor) -> bool:
    return t.dtype == torch.float16 or (t.is_floating_point() and torch.equal(t.to(torch.float16).to(t.dtype), t))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def _high_plane(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The bits above the low four of ``codes [tiles, lanes, k]``, as csrc/api.h lays them
    out: per 32-input block, input 8j + 4h + i's at word h, byte i, bits 2j (two bits) or
    at the one word's byte i, bit j + 4h (one bit); ``[tiles, blocks, words, lanes, 4]``."""
    tiles, lanes, k = codes.shape
    top = (codes >> 4).view(tiles, lanes, k // 32, 4, 2, 4)  # [.., block, j, h, i]
    if bits == 2:
        plane = top[:, :, :, 0] | top[:, :, :, 1] << 2 | top[:, :, :, 2] << 4 | top[:, :, :, 3] << 6
    else:
        plane = torch.zeros_like(top[:, :, :, 0, 0])
        for j in range(4):
            plane |= top[:, :, :, j, 0] << j | top[:, :, :, j, 1] << (j + 4)
        plane = plane.unsqueeze(3)
    return plane.permute(0, 2, 3, 1, 4)  # [tiles, block, h, lanes, i]


def _per_lane(t: torch.Tensor, tiles: int, lanes: int) -> torch.Tensor:
    """``[n, width]`` factors as ``[tiles, width, lanes]``."""
    return _pad_rows(t, tiles * lanes).view(tiles, lanes, -1).transpose(1, 2).contiguous()
