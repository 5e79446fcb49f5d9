"""The dense Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

One module serves them all; the spec's flags switch the differences. Q/K/V and
gate/up projections are fused into single matmuls (fewer, larger GEMMs), filled
slice by slice from the checkpoint's separate tensors at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localserve.formats.spec import ModelSpec
from localserve.kernels import AttentionMetadata, paged_attention, write_kv

from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, spec.hidden_size)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size), requires_grad=False)
            if spec.attention_bias
            else None
        )
        self.o_weight = _weight(spec.hidden_size, self.q_size)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, *rope), self.rotary.apply(k, *rope)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return F.linear(out.reshape(-1, self.q_size), self.o_weight)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_weight = _weight(2 * spec.intermediate_size, spec.hidden_size)
        self.down_weight = _weight(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, rotary)
        self.post_attention_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_position, device)
        self.embed_weight = _weight(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head_weight = self.embed_weight if spec.tie_word_embeddings else _weight(
            spec.vocab_size, spec.hidden_size
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` for a flat batch; writes this step's K/V."""
        x = F.embedding(input_ids, self.embed_weight)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, rope, k_cache, v_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF tensor name -> (our tensor, first row it fills, rows it fills).
        Fused tensors are filled by several checkpoint tensors, one row range each."""
        slots: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, tensor: torch.Tensor) -> None:
            slots[name] = (tensor, 0, tensor.shape[0])

        whole("model.embed_tokens.weight", self.embed_weight)
        whole("model.norm.weight", self.norm.weight)
        if not self.spec.tie_word_embeddings:
            whole("lm_head.weight", self.lm_head_weight)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            for part, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                slots[f"{prefix}self_attn.{part}_proj.weight"] = (attn.qkv_weight, start, rows)
                if attn.qkv_bias is not None:
                    slots[f"{prefix}self_attn.{part}_proj.bias"] = (attn.qkv_bias, start, rows)
            whole(f"{prefix}self_attn.o_proj.weight", attn.o_weight)
            if attn.q_norm is not None:
                whole(f"{prefix}self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{prefix}self_attn.k_norm.weight", attn.k_norm.weight)
            size = mlp.intermediate_size
            slots[f"{prefix}mlp.gate_proj.weight"] = (mlp.gate_up_weight, 0, size)
            slots[f"{prefix}mlp.up_proj.weight"] = (mlp.gate_up_weight, size, size)
            whole(f"{prefix}mlp.down_proj.weight", mlp.down_weight)
            whole(f"{prefix}input_layernorm.weight", layer.input_norm.weight)
            whole(f"{prefix}post_attention_layernorm.weight", layer.post_attention_norm.weight)
        return slots
