"""The dense Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

One module serves them all; the spec's flags switch the differences. Q/K/V and
gate/up projections are fused into single matmuls where the weights' layouts allow,
filled part by part from the checkpoint's separate tensors at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localserve.formats.spec import ModelSpec
from localserve.kernels import AttentionMetadata, KVCache, paged_attention, write_kv

from .layers import Embedding, Linear, RMSNorm
from .rope import RotaryEmbedding

# Where each checkpoint tensor goes: (module, part index, is bias), or a plain tensor.
Slot = tuple[Linear, int, bool] | torch.Tensor


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = Linear(spec.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, [spec.hidden_size])
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, *rope), self.rotary.apply(k, *rope)
        write_kv(k, v, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up = Linear(spec.hidden_size, [spec.intermediate_size] * 2)
        self.down = Linear(spec.intermediate_size, [spec.hidden_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up)


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
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, cache, meta)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_position, device)
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = self.embed if spec.tie_word_embeddings else Linear(spec.hidden_size, [spec.vocab_size])
        self.dtype = torch.float32

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` for a flat batch; writes this step's K/V."""
        x = self.embed.lookup(input_ids, self.dtype)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def checkpoint_slots(self) -> dict[str, Slot]:
        """HF tensor name -> where it goes."""
        slots: dict[str, Slot] = {
            "model.embed_tokens.weight": (self.embed, 0, False),
            "model.norm.weight": self.norm.weight,
        }
        if not self.spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, False)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.attn, layer.mlp
            for part, name in enumerate(("q", "k", "v")):
                slots[f"{prefix}self_attn.{name}_proj.weight"] = (attn.qkv, part, False)
                if attn.qkv.bias_parts is not None:
                    slots[f"{prefix}self_attn.{name}_proj.bias"] = (attn.qkv, part, True)
            slots[f"{prefix}self_attn.o_proj.weight"] = (attn.o_proj, 0, False)
            if attn.q_norm is not None:
                slots[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight
                slots[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight
            slots[f"{prefix}mlp.gate_proj.weight"] = (mlp.gate_up, 0, False)
            slots[f"{prefix}mlp.up_proj.weight"] = (mlp.gate_up, 1, False)
            slots[f"{prefix}mlp.down_proj.weight"] = (mlp.down, 0, False)
            slots[f"{prefix}input_layernorm.weight"] = layer.input_norm.weight
            slots[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_norm.weight
        return slots
