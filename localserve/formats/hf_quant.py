"""GPTQ and AWQ checkpoints (HF layout) re-packed into QuantWeight.

Facts (the GPTQ and AWQ packers' formats): GPTQ packs 32/bits consecutive *input* rows per int32
word of ``qweight [K*bits/32, N]`` and consecutive output columns per word of
``qzeros``; v1 (``checkpoint_format: gptq``) stores zero - 1. AWQ (gemm) packs eight
output columns per word of ``qweight [K, N/8]`` in the nibble order 0, 2, 4, 6, 1, 3, 5, 7.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..errors import LocalserveError
from ..kernels.quant_weight import QuantWeight, pack_codes
from .hf import QuantConfig

# Column 8c + j of an AWQ word sits in nibble AWQ_NIBBLE_OF_COLUMN[j].
AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 into 32/bits fields (lowest bits first), spreading them along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:  # rows: word r holds rows r*per_word .. r*per_word + per_word - 1
        fields = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask
        return fields.reshape(words.shape[0] * per_word, words.shape[1])
    fields = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask
    return fields.reshape(words.shape[0], words.shape[1] * per_word)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise LocalserveError(f"{name}: shape {tuple(tensor.shape)}, expected {expected}")


def gptq_to_quant_weight(prefix: str, parts: dict[str, torch.Tensor], config: QuantConfig) -> QuantWeight:
    bits = config.bits
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise LocalserveError(f"{prefix}: GPTQ qweight/qzeros must be int32")
    in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group_size = in_features if config.group_size == -1 else config.group_size
    if group_size <= 0 or in_features % group_size:
        raise LocalserveError(f"{prefix}: group size {group_size} does not divide {in_features} inputs")
    groups = in_features // group_size
    _check_shape(f"{prefix}.qzeros", qzeros, (groups, out_features * bits // 32))
    _check_shape(f"{prefix}.scales", scales, (groups, out_features))

    codes = _unpack_words(qweight, bits, dim=0).t()  # [N, K]
    zeros = _unpack_words(qzeros, bits, dim=1).t() + (1 if config.zeros_minus_one else 0)  # [N, groups]
    perm = None
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check_shape(f"{prefix}.g_idx", g_idx, (in_features,))
        g_idx = g_idx.long()
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise LocalserveError(f"{prefix}.g_idx: group index out of range")
        if not torch.equal(g_idx, torch.arange(in_features) // group_size):
            # Act-order: store columns sorted by group so groups are contiguous runs.
            if not torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), group_size)):
                raise LocalserveError(f"{prefix}.g_idx: groups of unequal size are not supported")
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[:, perm]
    return QuantWeight(
        bits=bits,
        group_size=group_size,
        codes=pack_codes(codes, bits),
        scales=scales.t().contiguous(),
        # v1's +1 turns a stored 255 into 256: keep such zeros exact in int16.
        zeros=zeros.to(torch.uint8 if zeros.max() <= 255 else torch.int16).contiguous(),
        perm=perm,
    )


def awq_to_quant_weight(prefix: str, parts: dict[str, torch.Tensor], config: QuantConfig) -> QuantWeight:
    qweight, scales = parts["qweight"], parts["scales"]
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    group_size = in_features if config.group_size == -1 else config.group_size
    if group_size <= 0 or in_features % group_size:
        raise LocalserveError(f"{prefix}: group size {group_size} does not divide {in_features} inputs")
    groups = in_features // group_size
    _check_shape(f"{prefix}.scales", scales, (groups, out_features))
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN)

    def unpack(words: torch.Tensor) -> torch.Tensor:
        fields = _unpack_words(words, 4, dim=1).view(words.shape[0], -1, 8)
        return fields[:, :, order].reshape(words.shape[0], -1)

    codes = unpack(qweight).t()  # [N, K]
    if config.zero_point:
        qzeros = parts["qzeros"]
        _check_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // 8))
        zeros = unpack(qzeros).t()
    else:
        zeros = torch.full((out_features, groups), 8)
    return QuantWeight(
        bits=4,
        group_size=group_size,
        codes=pack_codes(codes, 4),
        scales=scales.t().contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
    )


def convert_quantized(
    tensors: Iterable[tuple[str, torch.Tensor]], config: QuantConfig
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Pass dense tensors through; gather each quantized layer's parts (they may sit in
    different shards) and yield every layer as ``(<layer>.weight, QuantWeight)``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part in config.parts:
            pending.setdefault(prefix, {})[part] = tensor
        else:
            yield name, tensor
    required = {"qweight", "scales"} | ({"qzeros"} if config.zero_point else set())
    convert = gptq_to_quant_weight if config.method == "gptq" else awq_to_quant_weight
    for prefix, parts in pending.items():
        missing = sorted(required - parts.keys())
        if missing:
            raise LocalserveError(f"{prefix}: incomplete {config.method.upper()} layer (missing {', '.join(missing)})")
        yield f"{prefix}.weight", convert(prefix, parts, config)
