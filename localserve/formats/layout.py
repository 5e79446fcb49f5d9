"""Which tensors a model of a given spec is made of, and their shapes: the one statement of
it, which the weight loader checks each tensor against, and which ``check_tensors`` holds a
checkpoint's files to from their headers alone (no weights read, no torch), so that
``localserve pull`` registers only a model the engine can load.

Names and shapes are HF's, dense: ``[out_features, in_features]`` for a projection, all
experts of a projection stacked as ``[num_experts * out, in]`` or each expert on its own
(experts with biases, GPT-OSS's: stacked, biases ``[num_experts, out]``), and a GPTQ/AWQ
layer by the shape of the weight it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from .architectures import ARCHITECTURES
from .gguf import LAYER_TENSOR, MOE_NAMES, ROPE_TENSORS, hf_name
from .gguf_file import GGML_TYPES, LOADABLE_TYPES
from .gpt_oss import MXFP4
from .hf import SAFETENSORS_ITEM_BYTES, QuantConfig
from .spec import ModelSpec

if TYPE_CHECKING:
    from . import Checkpoint

# Tensors some HF checkpoints carry that the model does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PROJECTIONS = ("gate", "up", "down")


@dataclass(slots=True)
class Layout:
    """``shapes``: every tensor name the model takes and its shape. ``experts``: per MoE
    layer and projection, the stacked name and the per-expert names, of which a checkpoint
    holds one form or the other; every other name is required."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    experts: list[tuple[str, list[str]]] = field(default_factory=list)

    def missing(self, present: set[str]) -> list[str]:
        alternatives = {name for stacked, each in self.experts for name in (stacked, *each)}
        missing = [name for name in self.shapes if name not in alternatives and name not in present]
        for stacked, each in self.experts:
            if stacked not in present:
                missing += [name for name in each if name not in present]
        return missing


def layout(spec: ModelSpec) -> Layout:
    """The tensors of a model of ``spec`` (see the module doc)."""
    hidden, heads, kv_heads, head_dim = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    arch = ARCHITECTURES[spec.architecture]
    result = Layout()
    shapes = result.shapes
    shapes["model.embed_tokens.weight"] = (spec.vocab_size, hidden)
    shapes["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        q, kv = heads * head_dim, kv_heads * head_dim
        projections = [("qkv", q + 2 * kv)] if arch.fused_projections else [("q", q), ("k", kv), ("v", kv)]
        for name, rows in projections:
            _linear(shapes, f"{prefix}self_attn.{name}_proj.", rows, hidden, spec.attention_bias)
        _linear(shapes, f"{prefix}self_attn.o_proj.", hidden, q, spec.attention_out_bias)
        if spec.attention_sinks:
            shapes[f"{prefix}self_attn.sinks"] = (heads,)
        if spec.qk_norm:
            shapes[f"{prefix}self_attn.q_norm.weight"] = (spec.qk_norm_size(q),)
            shapes[f"{prefix}self_attn.k_norm.weight"] = (spec.qk_norm_size(kv),)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if spec.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        shapes.update((f"{prefix}{norm}.weight", (hidden,)) for norm in norms)
        if not spec.is_moe_layer(layer):
            _mlp(shapes, f"{prefix}mlp.", hidden, spec.intermediate_size, spec.mlp_bias, arch.fused_projections)
            continue
        block = f"{prefix}{arch.moe_block}."
        _linear(shapes, f"{block}gate.", spec.num_experts, hidden, spec.expert_bias)
        width = spec.moe_intermediate_size
        for projection, name in zip(PROJECTIONS, arch.expert_names):
            rows, columns = (hidden, width) if projection == "down" else (width, hidden)
            stacked = f"{block}experts.{projection}_proj.weight"
            shapes[stacked] = (spec.num_experts * rows, columns)
            if spec.expert_bias:  # stacked checkpoints only (GPT-OSS, its GGUF)
                shapes[f"{block}experts.{projection}_proj.bias"] = (spec.num_experts, rows)
                continue
            each = [f"{block}experts.{e}.{name}.weight" for e in range(spec.num_experts)]
            shapes.update((expert, (rows, columns)) for expert in each)
            result.experts.append((stacked, each))
        if spec.shared_expert_intermediate_size:
            _mlp(shapes, f"{block}shared_expert.", hidden, spec.shared_expert_intermediate_size)
            shapes[f"{block}shared_expert_gate.weight"] = (1, hidden)
    return result


def _linear(shapes: dict[str, tuple[int, ...]], prefix: str, rows: int, columns: int, bias: bool) -> None:
    shapes[f"{prefix}weight"] = (rows, columns)
    if bias:
        shapes[f"{prefix}bias"] = (rows,)


def _mlp(shapes: dict[str, tuple[int, ...]], prefix: str, hidden: int, width: int, bias: bool = False,
         fused: bool = False) -> None:
    if fused:  # Phi-3: gate and up stacked in one tensor
        _linear(shapes, f"{prefix}gate_up_proj.", 2 * width, hidden, bias)
    else:
        _linear(shapes, f"{prefix}gate_proj.", width, hidden, bias)
        _linear(shapes, f"{prefix}up_proj.", width, hidden, bias)
    _linear(shapes, f"{prefix}down_proj.", hidden, width, bias)


# -- a checkpoint's files against the layout --------------------------------------------------

def check_tensors(checkpoint: Checkpoint) -> None:
    """Every tensor in the checkpoint's files belongs to the model, has the shape the
    spec gives it and a type localserve loads, and none is missing: from the GGUF tensor
    directory or the safetensors headers, reading no weights."""
    expected = layout(checkpoint.spec)
    present: set[str] = set()
    where = checkpoint.path
    for name, called, shape, kind in _file_tensors(checkpoint):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and checkpoint.spec.tie_word_embeddings:
            continue  # tied: the embeddings serve as the head
        want = expected.shapes.get(name)
        if want is None:
            raise LocalserveError(f"{where}: tensor {called} does not belong to a {checkpoint.spec.architecture} model")
        if name in present:
            raise LocalserveError(f"{where}: tensor {called} appears twice")
        if shape != want:
            raise LocalserveError(f"{where}: tensor {called} has shape {shape}, expected {want}")
        if kind is not None:
            raise LocalserveError(f"{where}: tensor {called} is {kind}, which localserve cannot load")
        present.add(name)
    missing = expected.missing(present)
    if missing:
        raise LocalserveError(f"{where}: the checkpoint is missing {len(missing)} tensors, e.g. "
                              f"{', '.join(missing[:3])}")


FileTensor = tuple[str, str, tuple[int, ...], str | None]


def _file_tensors(checkpoint: Checkpoint) -> Iterator[FileTensor]:
    """(HF name, the file's own name for it, shape as loaded, None or why its type cannot
    be loaded) per tensor."""
    if checkpoint.gguf is not None:
        yield from _gguf_tensors(checkpoint)
    elif checkpoint.quant is not None:
        yield from _quantized_tensors(checkpoint, checkpoint.quant)
    else:
        for name, shape, dtype in checkpoint.headers:
            yield name, name, shape, _safetensors_problem(dtype)


def _gguf_tensors(checkpoint: Checkpoint) -> Iterator[FileTensor]:
    gguf, architecture = checkpoint.gguf, checkpoint.spec.architecture
    assert gguf is not None
    for info in gguf.tensors.values():
        if info.name in ROPE_TENSORS:
            continue  # read with the metadata
        name = hf_name(info.name, architecture)
        if name is None:
            raise LocalserveError(f"{checkpoint.path}: tensor {info.name} is not part of a {architecture} model")
        shape = tuple(info.shape)
        match = LAYER_TENSOR.fullmatch(info.name)
        if match and match[2] in MOE_NAMES:
            if len(shape) == 3:  # stacked experts [E, N, K] load as rows expert after expert
                shape = (shape[0] * shape[1], shape[2])
            elif match[2] == "ffn_gate_inp_shexp":  # the shared expert's gate, a vector in GGUF, is HF's [1, hidden]
                shape = (1, shape[0])
        problem = None
        if info.ggml_type not in LOADABLE_TYPES:
            known = GGML_TYPES.get(info.ggml_type)
            problem = f"of GGML type {known[0] if known else info.ggml_type}"
        yield name, info.name, shape, problem


def _quantized_tensors(checkpoint: Checkpoint, quant: QuantConfig) -> Iterator[FileTensor]:
    """GPTQ/AWQ: each quantized layer's parts, by the format facts, as the weight they
    hold (``qweight`` gives the shape, the others are checked against it)."""
    layers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for name, shape, dtype in checkpoint.headers:
        prefix, _, part = name.rpartition(".")
        if part in quant.parts:
            layers.setdefault(prefix, {})[part] = (shape, dtype)
        else:
            yield name, name, shape, _safetensors_problem(dtype)
    pack = 32 // quant.bits
    required = {"qweight", "scales"} | ({"qzeros"} if quant.zero_point else set())
    for prefix, parts in layers.items():
        missing = sorted(required - parts.keys())
        if missing:
            raise LocalserveError(f"{checkpoint.path}: {prefix}: incomplete {quant.method.upper()} layer (missing "
                                  f"{', '.join(missing)})")
        if len(parts["qweight"][0]) != 2:
            raise LocalserveError(f"{checkpoint.path}: {prefix}.qweight is not a matrix ({parts['qweight'][0]})")
        rows, columns = parts["qweight"][0]
        # GPTQ packs inputs along the rows of qweight [K / pack, N]; AWQ outputs along its
        # columns [K, N / pack].
        out_features, in_features = (columns, rows * pack) if quant.method == "gptq" else (columns * pack, rows)
        groups = 1 if quant.group_size == -1 else in_features // max(quant.group_size, 1)
        wanted = {"qweight": (rows, columns), "scales": (groups, out_features),
                  "qzeros": (groups, out_features // pack), "g_idx": (in_features,)}
        for part, (shape, dtype) in parts.items():
            if shape != wanted[part]:
                raise LocalserveError(f"{checkpoint.path}: {prefix}.{part} has shape {shape}, expected {wanted[part]} "
                                      f"for a {quant.method.upper()} {quant.bits}-bit layer")
            if dtype not in SAFETENSORS_ITEM_BYTES:
                raise LocalserveError(f"{checkpoint.path}: {prefix}.{part} has safetensors dtype {dtype}")
        yield f"{prefix}.weight", f"{prefix}.qweight", (out_features, in_features), None


def _safetensors_problem(dtype: str) -> str | None:
    """Why a tensor of this dtype cannot be a weight, or None (MXFP4: GPT-OSS's experts,
    as formats/gpt_oss.py names them)."""
    return None if dtype in _FLOAT_DTYPES or dtype == MXFP4 else f"of safetensors dtype {dtype} (dense weights are floats)"


_FLOAT_DTYPES = frozenset({"F16", "F32", "BF16", "F64"})
