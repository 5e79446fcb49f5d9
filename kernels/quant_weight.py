"""The quantized weight layout, ``QuantWeight``, and its definition.

Every quantized on-disk format (GPTQ, AWQ, GGUF block types) is re-packed at load
time into this one layout without loss: the values ``dequantize`` produces equal the
format's own dequantization exactly (same fp32 operations). The layers that multiply by
it are in quant_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(slots=True)
class QuantWeight:
    """A weight ``[out_features, in_features]`` in groups of ``group_size`` inputs.

    Element ``(n, k)``, group ``g = k // group_size``, code ``q``:

    - ``scales[n, g] * (q - zeros[n, g])`` when ``zeros`` is set (GPTQ, AWQ, Q4_0, Q6_K, ...)
    - ``scales[n, g] * q - mins[n, g]`` when ``mins`` is set (Q4_1, Q4_K, ...)
    - ``scales[n, g] * codebook[q]`` when ``codebook`` is set: a non-linear 4-bit code
      (MXFP4's e2m1 values, doubled to the integers ggml uses, under power-of-two scales;
      the IQ types' levels and lattice values), under one or two levels of scales

    computed in fp32. Codes of up to 4 bits are stored two per byte (input ``2j`` in
    the low nibble, ``2j + 1`` in the high one), wider codes one per byte.
    With ``perm`` (GPTQ act-order) the columns are stored in group order and the layer
    computes ``x[..., perm] @ W.T``.

    Two-level scales (GGUF K-quants): with ``super_scales`` set, ``scales`` holds small
    integer sub-scales and a group's scale is the fp32 product
    ``super_scales[n, g // groups_per_super] * scales[n, g]``; likewise ``super_mins``
    times integer ``mins``. That is the product ggml computes, kept factored so the
    weight stays at its file size instead of carrying an fp32 scale per 16 inputs.

    ``int8_block`` (set for GGUF's quantized types): on the CPU, x is rounded to int8 per
    block of this many inputs before the dot products, as llama.cpp's CPU backend computes
    them: 32 (its Q8_0/Q8_1) for the simple types, 256 (Q8_K) for the K-quants
    (``quantize_activations`` is that rounding in torch; ``quant_linear_cpu.tile`` lays
    such a weight out for the int8 kernel). 0: x stays fp32.
    """

    bits: int
    group_size: int
    codes: torch.Tensor  # uint8 [N, K // 2] (bits <= 4) or [N, K]
    scales: torch.Tensor  # [N, K // group_size], fp16 or fp32 (int8/uint8 under super_scales)
    zeros: torch.Tensor | None = None  # uint8 (int16 if a zero exceeds 255) [N, groups]
    mins: torch.Tensor | None = None  # fp32 [N, groups] (uint8 under super_mins)
    perm: torch.Tensor | None = None  # int64 [K]
    super_scales: torch.Tensor | None = None  # fp16 [N, groups // groups_per_super]
    super_mins: torch.Tensor | None = None  # fp16, as super_scales (mins form only)
    groups_per_super: int = 1
    int8_block: int = 0
    codebook: torch.Tensor | None = None  # fp32 [2 ** bits]: each code's value (shared by every row)

    def __post_init__(self) -> None:
        if sum(t is not None for t in (self.zeros, self.mins, self.codebook)) != 1:
            raise ValueError("a QuantWeight has one of zeros, mins or a codebook")
        if self.codebook is not None and self.codebook.shape != (1 << self.bits,):
            raise ValueError(f"a codebook holds 2**{self.bits} values")
        if (self.super_mins is not None) and (self.super_scales is None or self.mins is None):
            raise ValueError("super_mins needs super_scales and the mins form")
        if self.super_scales is not None and self.mins is not None and self.super_mins is None:
            raise ValueError("two-level scales in the mins form need super_mins too")

    def _tensors(self) -> dict[str, torch.Tensor]:
        fields = ("codes", "scales", "zeros", "mins", "perm", "super_scales", "super_mins")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}

    @property
    def packed(self) -> bool:
        return self.bits <= 4

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * (2 if self.packed else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def to(self, device: torch.device) -> QuantWeight:
        codebook = None if self.codebook is None else self.codebook.to(device)
        return replace(self, codebook=codebook, **{f: t.to(device) for f, t in self._tensors().items()})

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The given output rows (an embedding lookup)."""
        per_row = {f: t.index_select(0, index) for f, t in self._tensors().items() if f != "perm"}
        return replace(self, **per_row)

    def row_range(self, start: int, stop: int) -> QuantWeight:
        """Output rows ``start:stop`` as views (one expert of a stack), no copy."""
        per_row = {f: t[start:stop] for f, t in self._tensors().items() if f != "perm"}
        return replace(self, **per_row)

    def layout(self) -> tuple:
        """Everything two QuantWeights must share for their rows to be concatenated."""
        def dtype(t: torch.Tensor | None) -> torch.dtype | None:
            return None if t is None else t.dtype

        codebook = None if self.codebook is None else tuple(self.codebook.tolist())
        return (self.bits, self.group_size, self.groups_per_super, self.in_features, dtype(self.scales),
                dtype(self.zeros), dtype(self.mins), dtype(self.super_scales), dtype(self.super_mins), codebook)

    def group_scales(self) -> torch.Tensor:
        """Each group's scale ``[N, groups]``: the stored scales, or the fp32 products of
        two-level scales."""
        return _expand_two_level(self.super_scales, self.scales, self.groups_per_super)

    def group_offsets(self) -> torch.Tensor:
        """Each group's zero point or min ``[N, groups]``, as ``group_scales`` (the affine
        forms only)."""
        if self.zeros is not None:
            return self.zeros
        assert self.mins is not None
        return _expand_two_level(self.super_mins, self.mins, self.groups_per_super)


def _expand_two_level(outer: torch.Tensor | None, inner: torch.Tensor, groups_per_outer: int) -> torch.Tensor:
    if outer is None:
        return inner
    return outer.float().repeat_interleave(groups_per_outer, dim=1) * inner.float()


def concat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """One QuantWeight holding the rows of ``weights`` in order (same ``layout()``; the
    input order ``perm`` is not concatenated, so it must be None or handled by the caller)."""
    if any(w.layout() != weights[0].layout() for w in weights):
        raise ValueError("QuantWeights of different layouts cannot be concatenated")

    def cat(field: str) -> torch.Tensor | None:
        parts = [getattr(w, field) for w in weights]
        return None if parts[0] is None else torch.cat(parts)

    fields = ("codes", "scales", "zeros", "mins", "super_scales", "super_mins")
    return replace(weights[0], perm=None, **{f: cat(f) for f in fields})


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` into QuantWeight's storage."""
    codes = codes.to(torch.uint8)
    if bits > 4:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(weight: QuantWeight, dtype: torch.dtype = torch.uint8, rows: slice = slice(None)) -> torch.Tensor:
    """Codes ``[N, K]`` (or those ``rows``) in ``dtype``, written straight into one tensor."""
    codes = weight.codes[rows]
    if not weight.packed:
        return codes.to(dtype)
    n, half = codes.shape
    out = torch.empty(n, half, 2, dtype=dtype, device=codes.device)
    out[..., 0].copy_(codes & 0xF)
    out[..., 1].copy_(codes >> 4)
    return out.view(n, 2 * half)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[N, K]`` (columns in stored order; see ``perm``).

    One fp32 buffer, updated in place: the same fp32 operations as the formats' own
    dequantizers (``(q - zero) * scale``, ``scale * q - min`` or ``scale * codebook[q]``),
    so results are exact.
    """
    n, k = weight.shape
    if weight.codebook is not None:
        values = weight.codebook[unpack_codes(weight, torch.int64)].view(n, -1, weight.group_size)
        return values.mul_(weight.group_scales().float().unsqueeze(-1)).view(n, k).to(dtype)
    q = unpack_codes(weight, torch.float32).view(n, -1, weight.group_size)
    scales = weight.group_scales().unsqueeze(-1)
    offsets = weight.group_offsets().unsqueeze(-1)
    if weight.zeros is not None:
        q.sub_(offsets).mul_(scales)
    else:
        q.mul_(scales).sub_(offsets)
    return q.view(n, k).to(dtype)


def dequantize_in_input_order(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight with columns in the layer's input order (undoing ``perm``)."""
    dense = dequantize(weight, dtype)
    if weight.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, weight.perm] = dense
    return out
