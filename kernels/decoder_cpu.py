"""A stack of decoder layers (dense MLPs or mixtures of experts) as one C++ call on the CPU (``csrc/decoder_layers.cpp``).

The model describes its layers once (``DecoderLayerWeights``: the tensors and settings of
each, as plain data); ``DecoderStack`` lays them out as the kernel's descriptors and runs
every layer of a step in one parallel region, with no Python and no thread fork and join
between a layer's steps. The matmuls are the int8 and dense kernels' own, so each row's
result is the same whatever else is in the batch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_library
from .attention_cpu import KV_TYPES, check_tables
from .experts import ExpertWeights
from .paged_kv import AttentionMetadata, KVCache
from .quant_linear_cpu import TiledWeight

ACTIVATIONS = ("silu", "gelu_tanh")  # the kernel's codes, in order
MAX_PARTS = 4


@dataclass(slots=True)
class Projection:
    """One projection: weights side by side (their outputs concatenated), and a bias."""

    weights: list[TiledWeight | torch.Tensor]
    bias: torch.Tensor | None = None


MAX_TOP_K = 64  # the kernel's kMaxTopK


@dataclass(slots=True)
class MoEWeights:
    """A mixture of experts in a layer's MLP's place (csrc/api.h, ``ls_moe``): the router,
    and every expert's gate_up and down as tiled stacks (experts.py)."""

    router: Projection
    gate_up: ExpertWeights
    down: ExpertWeights
    top_k: int
    renormalize: bool


@dataclass(slots=True)
class DecoderLayerWeights:
    """What one pre-norm layer computes with (csrc/api.h, ``ls_decoder_layer``); norms
    are fp32 gains with any offset folded in, None where the layer has none."""

    input_norm: torch.Tensor
    qkv: Projection
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Projection
    attn_out_norm: torch.Tensor | None
    pre_mlp_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    mlp_out_norm: torch.Tensor | None
    cache: KVCache
    scale: float
    window: int | None
    softcap: float
    sinks: torch.Tensor | None
    rope: int  # which rotary table
    activation: str
    residual_scale: float
    moe: MoEWeights | None = None  # then gate_up and down are not used


@dataclass(frozen=True, slots=True)
class DecoderShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate: int
    eps: float


def takes_weight(weight: object) -> bool:
    """Whether the kernel multiplies by this weight: a tiled one, or dense fp32."""
    if isinstance(weight, TiledWeight):
        return True
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.device.type == "cpu")


def takes_cache(cache: KVCache) -> bool:
    return cache.key_scale is None and cache.key.dtype in KV_TYPES and cache.key.device.type == "cpu"


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _vector(t: torch.Tensor | None, size: int, what: str) -> torch.Tensor | None:
    if t is not None and not (t.dtype == torch.float32 and t.is_contiguous() and t.shape == (size,)):
        raise ValueError(f"{what} must be contiguous float32 [{size}], not {t.dtype} {list(t.shape)}")
    return t


class DecoderStack:
    """Layers laid out for ``ls_decoder_layers``; it keeps every tensor it points to alive."""

    def __init__(self, shape: DecoderShape, layers: list[DecoderLayerWeights],
                 final_norm: torch.Tensor | None = None) -> None:
        """``final_norm``: the model's last RMS norm's fp32 gain, applied after the last layer
        (None: ``run`` returns the residual stream)."""
        if not layers:
            raise ValueError("a decoder stack needs at least one layer")
        self.shape = shape
        self.layers = layers
        self.final_norm = _vector(final_norm, shape.hidden, "final norm")
        self.cache_blocks = layers[0].cache.key.shape[0]
        self.block_size = layers[0].cache.key.shape[1]
        self._shape = cpu_library.DecoderShapeDesc(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                                                   shape.rotary_dim, shape.intermediate, shape.eps)
        self._moe_descs: list[cpu_library.MoeDesc] = []  # what the layers' descriptors point to
        self._table = (cpu_library.DecoderLayerDesc * len(layers))(*[self._describe(layer) for layer in layers])
        self.rotary_tables = 1 + max(layer.rope for layer in layers)  # how many a step must pass

    def _projection(self, projection: Projection, k: int, n: int, what: str) -> cpu_library.LinearDesc:
        weights = projection.weights
        if not 1 <= len(weights) <= MAX_PARTS or not all(takes_weight(w) for w in weights):
            raise ValueError(f"{what}: 1 to {MAX_PARTS} tiled or dense fp32 weights expected")
        if any(w.shape[1] != k for w in weights) or sum(w.shape[0] for w in weights) != n:
            raise ValueError(f"{what}: weights of {[tuple(w.shape) for w in weights]} do not make [{n}, {k}]")
        desc = cpu_library.LinearDesc()
        desc.parts = len(weights)
        for i, w in enumerate(weights):
            if isinstance(w, TiledWeight):
                desc.tiled[i] = ctypes.pointer(w.desc)
            else:
                desc.dense[i] = w.data_ptr()
            desc.n[i] = w.shape[0]
        desc.bias = _address(_vector(projection.bias, n, f"{what} bias"))
        return desc

    def _moe(self, moe: MoEWeights) -> ctypes._Pointer:
        s = self.shape
        experts, inter = moe.down.num_experts, moe.down.in_features
        stacks = (moe.gate_up, moe.down)
        if not all(isinstance(w.weight, TiledWeight) for w in stacks) or moe.gate_up.num_experts != experts:
            raise ValueError("the stack takes experts as tiled stacks of one expert count")
        if (moe.gate_up.out_features, moe.gate_up.in_features, moe.down.out_features) != (2 * inter, s.hidden, s.hidden):
            raise ValueError(f"experts' gate_up [{moe.gate_up.out_features}, {moe.gate_up.in_features}] and down "
                             f"[{moe.down.out_features}, {inter}] do not fit hidden {s.hidden}")
        if not 1 <= moe.top_k <= min(experts, MAX_TOP_K):
            raise ValueError(f"top_k {moe.top_k} must be 1 to {min(experts, MAX_TOP_K)}")
        desc = cpu_library.MoeDesc(
            router=self._projection(moe.router, s.hidden, experts, "router"), experts=experts, top_k=moe.top_k,
            intermediate=inter, renormalize=int(moe.renormalize),
            gate_up=ctypes.cast(moe.gate_up.table(), ctypes.c_void_p), down=ctypes.cast(moe.down.table(), ctypes.c_void_p))
        self._moe_descs.append(desc)
        return ctypes.pointer(desc)

    def _describe(self, layer: DecoderLayerWeights) -> cpu_library.DecoderLayerDesc:
        s = self.shape
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        if not takes_cache(layer.cache) or tuple(layer.cache.key.shape[1:]) != (self.block_size, s.kv_heads, s.head_dim):
            raise ValueError("the stack takes fp32, fp16 or bf16 caches of one block size, "
                             "[blocks, block_size, kv_heads, head_dim]")
        if layer.activation not in ACTIVATIONS or layer.rope not in (0, 1):
            raise ValueError(f"activation {layer.activation!r} (one of {ACTIVATIONS}) or rotary table {layer.rope} "
                             "(0 or 1) not taken")
        if layer.moe is None:
            mlp = (self._projection(layer.gate_up, s.hidden, 2 * s.intermediate, "gate_up"),
                   self._projection(layer.down, s.intermediate, s.hidden, "down"))
        else:
            mlp = (cpu_library.LinearDesc(), cpu_library.LinearDesc())
        return cpu_library.DecoderLayerDesc(
            input_norm=_address(_vector(layer.input_norm, s.hidden, "input norm")),
            qkv=self._projection(layer.qkv, s.hidden, q_size + 2 * kv_size, "qkv"),
            q_norm=_address(_vector(layer.q_norm, s.head_dim, "q norm")),
            k_norm=_address(_vector(layer.k_norm, s.head_dim, "k norm")),
            o=self._projection(layer.o, q_size, s.hidden, "o_proj"),
            attn_out_norm=_address(_vector(layer.attn_out_norm, s.hidden, "attention output norm")),
            pre_mlp_norm=_address(_vector(layer.pre_mlp_norm, s.hidden, "pre-MLP norm")),
            gate_up=mlp[0], down=mlp[1], moe=None if layer.moe is None else self._moe(layer.moe),
            mlp_out_norm=_address(_vector(layer.mlp_out_norm, s.hidden, "MLP output norm")),
            k_cache=layer.cache.key.data_ptr(), v_cache=layer.cache.value.data_ptr(),
            kv_type=KV_TYPES[layer.cache.key.dtype], scale=layer.scale,
            window=layer.window or 0, softcap=layer.softcap, sinks=_address(_vector(layer.sinks, s.heads, "sinks")),
            rope=layer.rope, activation=ACTIVATIONS.index(layer.activation), residual_scale=layer.residual_scale)

    def run(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
            ) -> torch.Tensor:
        """x ``[tokens, hidden]`` (fp32) through every layer and the final norm, if the stack
        has one; writes this step's K/V. ``ropes``: each rotary table's cos and sin at the rows'
        positions (``[tokens, 1, rotary_dim]``)."""
        s = self.shape
        x = x.clone(memory_format=torch.contiguous_format)
        tokens = x.shape[0]
        if x.dtype != torch.float32 or x.shape != (tokens, s.hidden):
            raise ValueError(f"x must be float32 [tokens, {s.hidden}], not {x.dtype} {list(x.shape)}")
        if meta.slot_mapping.shape != (tokens,) or meta.slot_mapping.dtype != torch.int64:
            raise ValueError("one int64 cache slot per row expected")
        slots = meta.slot_mapping.contiguous()
        if tokens and int(slots.max()) >= self.cache_blocks * self.block_size:
            raise ValueError("a cache slot is outside the cache")
        tables, query_start, seq_lens = (meta.block_tables.contiguous(), meta.query_start_loc.contiguous(),
                                         meta.seq_lens.contiguous())
        check_tables(meta, tokens, self.cache_blocks, self.block_size, tables.shape[1])
        if len(ropes) < self.rotary_tables:
            raise ValueError(f"the layers use {self.rotary_tables} rotary tables, {len(ropes)} given")
        tables_cs = [(c.reshape(tokens, -1).contiguous(), sn.reshape(tokens, -1).contiguous()) for c, sn in ropes]
        for c, sn in tables_cs:
            if c.shape != (tokens, s.rotary_dim) or sn.shape != c.shape or c.dtype != torch.float32:
                raise ValueError(f"rotary tables must be float32 [{tokens}, {s.rotary_dim}]")
        padded = tables_cs + [tables_cs[0]] * (2 - len(tables_cs))
        batch = cpu_library.DecoderBatchDesc(
            tokens=tokens, cos=(ctypes.c_void_p * 2)(*[c.data_ptr() for c, _ in padded]),
            sin=(ctypes.c_void_p * 2)(*[sn.data_ptr() for _, sn in padded]), slot_mapping=slots.data_ptr(),
            block_size=self.block_size, block_tables=tables.data_ptr(), max_blocks=tables.shape[1],
            query_start=query_start.data_ptr(), seq_lens=seq_lens.data_ptr(), batch=meta.num_seqs)
        lib = cpu_library.library()
        assert lib is not None, "the CPU kernels are not available"
        lib.ls_decoder_layers(ctypes.byref(self._shape), self._table, len(self.layers), ctypes.byref(batch),
                              _address(self.final_norm), x.data_ptr())
        return x


# The kernel's step kinds (``ls_decoder_step``), in order.
PROFILE_STEPS = ("qkv", "rotary and KV write", "attention", "o_proj", "gate_up", "down",
                 "norms, residuals, activation", "experts (router to weighted sum)")


def profile(enable: bool) -> dict[str, float]:
    """Seconds each kind of step took in the stacks run since the last call (while
    profiling was on); then profiling is turned on or off. For benchmarks."""
    lib = cpu_library.library()
    assert lib is not None, "the CPU kernels are not available"
    seconds = (ctypes.c_double * len(PROFILE_STEPS))()
    lib.ls_decoder_profile(int(enable), seconds)
    return dict(zip(PROFILE_STEPS, seconds))
