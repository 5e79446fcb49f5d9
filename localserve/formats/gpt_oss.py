"""GPT-OSS's HF checkpoint tensors under the canonical names the other readers use.

GPT-OSS keeps each layer's experts as 3-D tensors: ``mlp.experts.gate_up_proj [E, H, 2I]``
(inputs first, gate and up interleaved column by column), ``gate_up_proj_bias [E, 2I]``,
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``; the released checkpoints hold the
two weights in MXFP4 instead, as ``<name>_blocks [E, rows, K / 32, 16]`` (uint8, two
e2m1 codes a byte, the even input in the low nibble) and ``<name>_scales [E, rows, K / 32]``
(uint8 e8m0 exponents, 2 ** (e - 127)), rows being outputs. The router is ``mlp.router``.

Canonically (formats/layout.py) the router is ``mlp.gate`` and each projection of all
experts one stack, ``mlp.experts.<gate|up|down>_proj.weight [E * rows, K]`` with a bias
``[E, rows]``, as GGUF's ``*_exps`` tensors come: the interleaved gate and up columns are
taken apart, dense weights transposed, and MXFP4 blocks become a QuantWeight of the same
codes and exponents (GGUF's MXFP4 form: ``2 ** (e - 128)`` times e2m1 doubled, the same
values), never widened.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .hf import TensorHeader

if TYPE_CHECKING:
    import torch

    from ..kernels.quant_weight import QuantWeight

# What ``canonical_headers`` calls an MXFP4 weight's dtype.
MXFP4 = "MXFP4"
_BLOCK = 32  # inputs per MXFP4 block

_EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.)(?:experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
                            r"|router\.(weight|bias))")


def mxfp4_bytes(rows: int, columns: int) -> tuple[int, int]:
    """(bytes in the checkpoint, bytes once loaded) of an MXFP4 weight: half a byte per
    code, and per block of 32 a one-byte exponent on disk, a bf16 scale in memory."""
    return rows * columns // 2 + rows * columns // _BLOCK, rows * columns // 2 + 2 * rows * columns // _BLOCK


def canonical_headers(headers: Iterable[TensorHeader]) -> list[TensorHeader]:
    """The headers as ``canonical_weights`` renames the tensors (an MXFP4 pair becomes one
    weight of dtype ``MXFP4``); shapes checked only as far as renaming needs."""
    out: list[TensorHeader] = []
    pending: dict[str, dict[str, TensorHeader]] = {}
    for header in headers:
        name, shape, dtype = header
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            out.append(header)
            continue
        prefix, projection, part, router_part = match.groups()
        if router_part is not None:
            out.append((f"{prefix}gate.{router_part}", shape, dtype))
        elif part in ("_blocks", "_scales"):
            pair = pending.setdefault(f"{prefix}experts.{projection}", {})
            pair[part] = header
            if len(pair) == 2:
                del pending[f"{prefix}experts.{projection}"]
                out += _renamed(prefix, projection, _mxfp4_shape(pair["_blocks"], pair["_scales"]), MXFP4)
        else:
            out += _renamed(prefix, projection, _dense_shape(name, shape, bias=part == "_bias"), dtype,
                            bias=part == "_bias")
    _check_paired(pending)
    return out


def _renamed(prefix: str, projection: str, shape: tuple[int, ...], dtype: str, bias: bool = False
             ) -> list[TensorHeader]:
    """gate_up splits in two of half the rows; shape is the canonical one of the whole."""
    kind = "bias" if bias else "weight"
    half = (shape[0], shape[1] // 2) if bias else (shape[0] // 2, shape[1])
    shapes = [shape] if projection == "down_proj" else [half, half]
    return [(name, part, dtype) for name, part in _split(prefix, projection, kind, shapes)]


def _dense_shape(name: str, shape: tuple[int, ...], bias: bool) -> tuple[int, ...]:
    if bias:
        if len(shape) != 2:
            raise LocalserveError(f"tensor {name} has shape {shape}; expected [experts, outputs]")
        return shape
    if len(shape) != 3:
        raise LocalserveError(f"tensor {name} has shape {shape}; expected [experts, inputs, outputs]")
    experts, inputs, outputs = shape
    return (experts * outputs, inputs)


def _mxfp4_shape(blocks: TensorHeader, scales: TensorHeader) -> tuple[int, int]:
    """The canonical [E * rows, K] of an MXFP4 pair, whose headers are checked here."""
    (name, shape, dtype), (scale_name, scale_shape, scale_dtype) = blocks, scales
    if len(shape) != 4 or shape[-1] != _BLOCK // 2 or scale_shape != shape[:-1] or dtype != "U8" or scale_dtype != "U8":
        raise LocalserveError(f"tensors {name} {shape} {dtype} and {scale_name} {scale_shape} {scale_dtype} are not "
                              f"MXFP4 blocks [experts, rows, groups, 16] and scales [experts, rows, groups], uint8")
    experts, rows, groups, _ = shape
    return (experts * rows, groups * _BLOCK)


def _check_paired(pending: dict) -> None:
    if pending:
        name, parts = next(iter(pending.items()))
        raise LocalserveError(f"tensor {name}{next(iter(parts))} has no {'_scales' if '_blocks' in parts else '_blocks'}"
                              " beside it")


def canonical_weights(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """The checkpoint's (name, tensor) pairs under canonical names (see the module doc);
    an MXFP4 weight is yielded once both its blocks and its scales have been read."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, projection, part, router_part = match.groups()
        if router_part is not None:
            yield f"{prefix}gate.{router_part}", tensor
        elif part in ("_blocks", "_scales"):
            key = f"{prefix}experts.{projection}"
            pair = pending.setdefault(key, {})
            pair[part] = tensor
            if len(pair) == 2:
                del pending[key]
                yield from _split(prefix, projection, "weight", _mxfp4_weights(key, pair["_blocks"], pair["_scales"]))
        elif part == "_bias":
            shape = _dense_shape(name, tuple(tensor.shape), bias=True)
            yield from _split(prefix, projection, "bias", [tensor.reshape(shape)] if projection == "down_proj"
                              else [tensor[:, 0::2].contiguous(), tensor[:, 1::2].contiguous()])
        else:
            _dense_shape(name, tuple(tensor.shape), bias=False)
            rows = tensor.transpose(1, 2)  # [E, outputs, inputs]
            parts = [rows] if projection == "down_proj" else [rows[:, 0::2], rows[:, 1::2]]
            yield from _split(prefix, projection, "weight", [p.reshape(-1, p.shape[-1]).contiguous() for p in parts])
    _check_paired(pending)


def _split(prefix: str, projection: str, kind: str, parts: list) -> Iterator[tuple[str, object]]:
    names = ["down_proj"] if projection == "down_proj" else ["gate_proj", "up_proj"]
    for name, part in zip(names, parts, strict=True):
        yield f"{prefix}experts.{name}.{kind}", part


def _mxfp4_weights(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> list[QuantWeight]:
    """The stacked experts as QuantWeights: one for down, gate's and up's (even and odd
    rows) for gate_up. QuantWeight packs two codes a byte, the even input low, as here."""
    import torch

    from ..kernels.quant_weight import QuantWeight
    from .gguf_quants import MXFP4_VALUES, e8m0_half

    # The headers were checked when the checkpoint was opened (canonical_headers).
    codebook = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    # e2m1 value v * 2 ** (e - 127) == (2 v) * 2 ** (e - 128): GGUF's doubled codebook, halved scale.
    selections = [slice(None)] if name.endswith("down_proj") else [slice(0, None, 2), slice(1, None, 2)]
    weights = []
    for rows in selections:
        codes, exponents = blocks[:, rows], scales[:, rows]
        # x stays fp32 (int8_block 0), as transformers computes this checkpoint and as for
        # GPTQ/AWQ: GGUF's MXFP4, whose oracle is llama.cpp, takes the int8 kernel instead.
        weights.append(QuantWeight(bits=4, group_size=_BLOCK, codes=codes.reshape(-1, codes.shape[2] * 16).contiguous(),
                                   scales=e8m0_half(exponents.reshape(-1, exponents.shape[2])), codebook=codebook))
    return weights
