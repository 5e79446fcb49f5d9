"""The decoder layers of a CPU model as one C++ call (kernels/decoder_cpu.py).

A model whose every layer the stack kernel can compute (a dense MLP, or a mixture of
SwiGLU experts tiled for the int8 kernel without biases or a shared expert; tiled or fp32
dense weights; fp32, fp16 or bf16 caches; per-head q/k norms or none; no q/k/v clipping)
runs its layers through it: a step is then one call instead of some twenty torch ops and
ctypes calls per layer (a mixture of experts': some forty). Others, and engines that keep
the torch references, run the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from localserve.kernels import KVCache, cpu_library
from localserve.kernels.decoder_cpu import MAX_TOP_K, DecoderLayerWeights, DecoderShape, DecoderStack, MoEWeights, \
    Projection, takes_cache, takes_weight
from localserve.kernels.experts import SWIGLU

from .layers import ACTIVATIONS, MLP, Linear, RMSNorm
from .moe import SparseMoE

_ACTIVATION_NAMES = {fn: name for name, fn in ACTIVATIONS.items()}


def stack_for(model: nn.Module, caches: list[KVCache]) -> DecoderStack | None:
    """A LlamaForCausalLM's layers over these caches as one stack, or None where a layer is
    one the kernel does not compute (then the modules run). Read by attribute (llama.py
    calls this; importing it back would tie the two modules in a circle)."""
    if not (model.dtype == torch.float32 and cpu_library.available() and caches
            and len(caches) == len(model.layers) and all(takes_cache(c) for c in caches)):
        return None
    if len({tuple(c.key.shape) for c in caches}) != 1:
        return None
    spec = model.spec
    rotary_dim = model.rotary.rotary_dim
    if rotary_dim % 2 or (model.local_rotary is not None and model.local_rotary.rotary_dim != rotary_dim):
        return None
    if not _plain_norm(model.norm, spec.rms_norm_eps):
        return None
    dense = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MLP)]
    layers = []
    for layer, cache in zip(model.layers, caches):
        weights = _layer_weights(layer, cache)
        if weights is None:
            return None
        layers.append(weights)
    if len({mlp.intermediate_size for mlp in dense}) > 1:
        return None
    shape = DecoderShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary_dim,
                         dense[0].intermediate_size if dense else 0, spec.rms_norm_eps)
    return DecoderStack(shape, layers, final_norm=model.norm.weight.data)


def _projection(linear: Linear) -> Projection | None:
    if not all(takes_weight(w) for w in linear.weights) or not 1 <= len(linear.weights) <= 4:
        return None
    return Projection(list(linear.weights), linear.bias)


def _norm(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight.data


def _plain_norm(norm: RMSNorm | None, eps: float) -> bool:
    """An RMS norm the kernel computes: fp32 gain, offset folded in, the model's eps."""
    return norm is None or (norm.offset == 0 and norm.weight.dtype == torch.float32 and norm.eps == eps)


def _moe_weights(moe: SparseMoE) -> MoEWeights | None:
    """The experts as the kernel takes them: SwiGLU experts tiled for the int8 kernel, gate
    and up fused, no biases; no shared expert."""
    experts = moe.experts.mlp
    router = _projection(moe.router)
    if (experts is None or router is None or moe.shared_expert is not None or not experts.tiled
            or experts.gate_up_bias is not None or experts.down_bias is not None or experts.activation != SWIGLU
            or not 1 <= moe.top_k <= min(experts.num_experts, MAX_TOP_K)):
        return None
    return MoEWeights(router, experts.gate_up[0], experts.down, moe.top_k, moe.renormalize)


def _layer_weights(layer: nn.Module, cache: KVCache) -> DecoderLayerWeights | None:
    attn, mlp = layer.attn, layer.mlp
    eps = layer.input_norm.eps
    norms = (layer.input_norm, layer.pre_mlp_norm, layer.attn_out_norm, layer.mlp_out_norm, attn.q_norm, attn.k_norm)
    if attn.clip_qkv is not None or attn.qk_norm_whole or not all(_plain_norm(n, eps) for n in norms):
        return None
    if (attn.q_norm is not None and attn.q_norm.weight.shape != (attn.head_dim,)):
        return None
    qkv, o = _projection(attn.qkv), _projection(attn.o_proj)
    if qkv is None or o is None:
        return None
    if isinstance(mlp, SparseMoE):
        moe = _moe_weights(mlp)
        if moe is None:
            return None
        gate_up, down, activation = Projection([]), Projection([]), "silu"
    elif isinstance(mlp, MLP) and mlp.act in _ACTIVATION_NAMES:
        moe, activation = None, _ACTIVATION_NAMES[mlp.act]
        gate_up, down = _projection(mlp.gate_up), _projection(mlp.down)  # type: ignore[assignment]
        if gate_up is None or down is None:
            return None
    else:
        return None
    return DecoderLayerWeights(
        input_norm=layer.input_norm.weight.data, qkv=qkv, q_norm=_norm(attn.q_norm), k_norm=_norm(attn.k_norm), o=o,
        attn_out_norm=_norm(layer.attn_out_norm), pre_mlp_norm=layer.pre_mlp_norm.weight.data, gate_up=gate_up,
        down=down, mlp_out_norm=_norm(layer.mlp_out_norm), cache=cache, scale=attn.scale, window=attn.window,
        softcap=attn.softcap, sinks=attn.sinks, rope=attn.rope_index, activation=activation,
        residual_scale=layer.residual_scale, moe=moe)
