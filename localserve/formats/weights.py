"""A checkpoint's weights, read from its files: the one part of the readers that needs
torch, used when a model is loaded (and by ``localserve fit`` for the loaded sizes).

GGUF block-quantized tensors become QuantWeights without loss (``gguf_quants``), GPTQ
and AWQ layers too (``hf_quant``). llama.cpp's converter stores the Q and K projections
of arch ``llama`` with rotary pairs interleaved (rows permuted per head); the rows go
back in HF's half-split order so one rotary implementation serves every format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from ..errors import LocalserveError
from ..kernels.quant_weight import QuantWeight, concat_rows, dequantize
from . import embedding, gpt_oss, hf, mmproj, multimodal
from .gguf import LAYER_TENSOR, MOE_NAMES, ROPE_TENSORS, hf_name
from .gguf_file import GGUFFile
from .gguf_quants import gguf_to_weight, loaded_nbytes
from .hf_quant import convert_quantized
from .architectures import ARCHITECTURES
from .spec import ModelSpec

if TYPE_CHECKING:
    from . import Checkpoint

NamedWeight = tuple[str, torch.Tensor | QuantWeight]


def iter_weights(checkpoint: Checkpoint) -> Iterator[NamedWeight]:
    """(HF name, weight) for every weight of the checkpoint, read as iterated."""
    if checkpoint.gguf is not None:
        return _gguf_weights(checkpoint.gguf, checkpoint.spec)
    # An image-text checkpoint's vision tensors are skipped unread.
    rename = multimodal.text_name if checkpoint.image_text else embedding.bare_name if checkpoint.bare else None
    tensors = safetensors_tensors(checkpoint.files, rename)
    if ARCHITECTURES[checkpoint.spec.architecture].packed_experts:
        return gpt_oss.canonical_weights(tensors)
    return convert_quantized(tensors, checkpoint.quant) if checkpoint.quant else tensors


def iter_vision_weights(checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(name, tensor) of an image-text checkpoint's vision tower and projector
    (``multimodal.vision_name``'s names), the text model's tensors skipped unread; a GGUF
    model's from its projector file (``mmproj.vision_name``'s names), its quantized
    matrices as QuantWeights (vision/quantized.py runs them so)."""
    if checkpoint.mmproj is not None:
        return _projector_weights(checkpoint.mmproj)
    return safetensors_tensors(checkpoint.files, multimodal.vision_name)


def _projector_weights(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    kind, deepstack = mmproj.projector_type(gguf), mmproj.deepstack_blocks(gguf)
    pieces: dict[str, dict[int, torch.Tensor | QuantWeight]] = {}
    for info in gguf.tensors.values():
        target = mmproj.vision_name(info.name, kind, deepstack)
        if target is None:
            raise LocalserveError(f"{gguf.path}: tensor {info.name} is not part of a "
                                  f"{mmproj.SUPPORTED_TYPES[kind]} vision projector")
        weight = gguf_to_weight(info.name, gguf.tensor_bytes(info.name), info.ggml_type, info.shape)
        # Quantized matrices stay so (vision/quantized.py); a norm shifted by one, or a
        # quantized convolution kernel, is used widened.
        if info.name in mmproj.SHIFTED_BY_ONE:
            weight = _dense(weight, info.shape) - 1
        elif len(info.shape) != 2:
            weight = _dense(weight, info.shape)
        pieces.setdefault(target[0], {})[target[1]] = weight
    for name, parts in pieces.items():
        join = mmproj.joined(name, kind)
        if join is None:
            yield name, parts[0]
            continue
        ordered = [parts[index] for index in sorted(parts)]
        if sorted(parts) != list(range(len(parts))) or len(parts) < 2:
            raise LocalserveError(f"{gguf.path}: the projector holds pieces {sorted(parts)} of {name}")
        how, dim = join
        shapes = [list(part.shape) for part in ordered]
        try:
            if how == "cat" and dim == 0 and all(isinstance(p, QuantWeight) for p in ordered):
                yield name, concat_rows(ordered)  # type: ignore[arg-type]  # rows of one matrix (q, k, v)
                continue
            dense = [_dense(part, tuple(part.shape)) for part in ordered]
            yield name, torch.cat(dense, dim) if how == "cat" else torch.stack(dense, dim)
        except (RuntimeError, ValueError):
            raise LocalserveError(f"{gguf.path}: the pieces of {name} do not fit together ({shapes})") from None


def _dense(weight: torch.Tensor | QuantWeight, shape: tuple[int, ...]) -> torch.Tensor:
    return dequantize(weight).reshape(shape) if isinstance(weight, QuantWeight) else weight


def safetensors_tensors(files: list[Path], rename: Callable[[str], str | None] | None = None,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the shards, under ``rename``'s names (None:
    skipped unread). safetensors validates the header and every offset against the file
    size before handing out data."""
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name in seen:
                        raise LocalserveError(f"{path}: tensor {name} appears in two shards")
                    seen.add(name)
                    renamed = rename(name) if rename is not None else name
                    if renamed is not None:
                        yield renamed, handle.get_tensor(name)
        except SafetensorError as exc:
            raise LocalserveError(f"{path}: not a valid safetensors file ({exc})") from exc


def _gguf_weights(gguf: GGUFFile, spec: ModelSpec) -> Iterator[NamedWeight]:
    # Arch llama (Mixtral included) has its Q/K rows permuted by the converter.
    permuted = ARCHITECTURES[spec.architecture].gguf_permuted_qk
    permuted_heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads} if permuted else {}
    for info in gguf.tensors.values():
        if info.name in ROPE_TENSORS:
            continue  # read with the metadata, into the spec
        name = hf_name(info.name, spec.architecture)
        if name is None:
            raise LocalserveError(f"{gguf.path}: tensor {info.name} is not part of a {spec.architecture} model")
        weight = gguf_to_weight(info.name, gguf.tensor_bytes(info.name), info.ggml_type, info.shape)
        gguf.drop_pages(info.name)  # the weight is a copy
        match = LAYER_TENSOR.fullmatch(info.name)
        if match and isinstance(weight, torch.Tensor) and match[2] in MOE_NAMES:
            # Stacked experts [E, N, K] -> rows expert after expert, as quantized ones
            # come; the shared expert's gate, a vector in GGUF, is HF's [1, hidden].
            if weight.dim() == 3 or match[2] == "ffn_gate_inp_shexp":
                weight = weight.reshape(-1, weight.shape[-1])
        heads = permuted_heads.get(match[2]) if match else None
        if heads is not None:
            rows = weight.shape[0]
            if rows % (2 * heads):
                raise LocalserveError(f"{gguf.path}: {info.name} has {rows} rows, not a multiple of 2 x {heads} heads")
            order = _interleaved_to_half_split(rows, heads)
            weight = weight.rows(order) if isinstance(weight, QuantWeight) else weight.index_select(0, order)
        yield name, weight


def _interleaved_to_half_split(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: GGUF row i holds HF row
    ``forward[i]``, so HF row j is GGUF row ``argsort(forward)[j]``."""
    forward = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(forward)


@dataclass(slots=True, frozen=True)
class TensorSize:
    name: str  # as in the file
    parameters: int  # model weights it holds (0 for quantization metadata)
    file_bytes: int
    loaded_bytes: int  # once loaded by localserve


def tensor_sizes(checkpoint: Checkpoint, dtype: torch.dtype) -> Iterator[TensorSize]:
    """Every tensor's parameters and bytes, from the file headers alone (no weights are
    read); ``loaded_bytes`` assumes unquantized tensors become ``dtype``."""
    item_bytes = torch.empty((), dtype=dtype).element_size()
    if checkpoint.gguf is not None:
        gguf = checkpoint.gguf
        for info in gguf.tensors.values():
            if info.name in ROPE_TENSORS:
                continue
            loaded = loaded_nbytes(info.name, info.ggml_type, info.shape, item_bytes)
            yield TensorSize(info.name, info.n_elements, gguf.tensor_nbytes(info.name), loaded)
        if checkpoint.mmproj is not None:  # its projector's, loaded dense
            for info in checkpoint.mmproj.tensors.values():
                yield TensorSize(info.name, info.n_elements, checkpoint.mmproj.tensor_nbytes(info.name),
                                 info.n_elements * item_bytes)
        return
    quant = checkpoint.quant
    for name, shape, stored in [*checkpoint.headers, *checkpoint.vision_headers]:  # the vision side's too
        if name == "lm_head.weight" and checkpoint.spec.tie_word_embeddings:
            continue  # the embeddings serve as the head
        if stored == gpt_oss.MXFP4:
            file_bytes, loaded = gpt_oss.mxfp4_bytes(*shape)
            yield TensorSize(name, math.prod(shape), file_bytes, loaded)
            continue
        if stored not in hf.SAFETENSORS_ITEM_BYTES:
            raise LocalserveError(f"tensor {name!r} has safetensors dtype {stored}, which localserve cannot load")
        numel = math.prod(shape)
        file_bytes = numel * hf.SAFETENSORS_ITEM_BYTES[stored]
        floating = stored.startswith(("F", "BF"))
        # GPTQ/AWQ integer tensors keep their size (codes stay packed). A qweight word
        # holds 32 / bits weights; scales, qzeros and g_idx are quantization metadata.
        if quant is not None and name.endswith(".qweight"):
            parameters = numel * 32 // quant.bits
        elif floating and not (quant is not None and name.endswith(".scales")):
            parameters = numel
        else:
            parameters = 0
        yield TensorSize(name, parameters, file_bytes, numel * item_bytes if floating else file_bytes)


@dataclass(slots=True, frozen=True)
class WeightSizes:
    parameters: int  # all of them, every expert counted
    file_bytes: int
    loaded_bytes: int  # as localserve holds them (see tensor_sizes)
    expert_bytes_by_layer: dict[int, int]  # loaded bytes of each MoE layer's routed experts

    def host_expert_bytes(self, layers: int) -> int:
        """Loaded bytes of the experts that ``cpu_moe`` keeps in host memory."""
        return sum(size for layer, size in self.expert_bytes_by_layer.items() if layer < layers)


# HF: model.layers.3.mlp.experts.7.down_proj / ...block_sparse_moe.experts.7.w2; GGUF: blk.3.ffn_down_exps.
_EXPERT_TENSOR = re.compile(r"(?:model\.layers|blk)\.(\d+)\..*(?:\.experts\.|_exps\.)")


def weight_sizes(checkpoint: Checkpoint, dtype: torch.dtype) -> WeightSizes:
    parameters = file_bytes = loaded_bytes = 0
    expert_bytes: dict[int, int] = {}
    for tensor in tensor_sizes(checkpoint, dtype):
        parameters += tensor.parameters
        file_bytes += tensor.file_bytes
        loaded_bytes += tensor.loaded_bytes
        expert = _EXPERT_TENSOR.match(tensor.name)
        if expert:
            layer = int(expert[1])
            expert_bytes[layer] = expert_bytes.get(layer, 0) + tensor.loaded_bytes
    return WeightSizes(parameters, file_bytes, loaded_bytes, expert_bytes)
