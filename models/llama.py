"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), and their
mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (a SparseMoE block in place of
the MLP).

One module serves them all; the spec's flags switch the differences. Q/K/V and
gate/up projections are fused into single matmuls where the weights' layouts allow,
filled part by part from the checkpoint's separate tensors at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from localserve.formats.spec import ModelSpec
from localserve.kernels import AttentionMetadata, KVCache, paged_attention, write_kv

from localserve.formats.architectures import ARCHITECTURES
from localserve.formats.layout import PROJECTIONS

from .layers import MLP, Embedding, Linear, RMSNorm
from .moe import Experts, SparseMoE
from .rope import RotaryEmbedding

# Where each checkpoint tensor goes: (module, part, is bias), or a plain tensor.
Slot = tuple[Linear, int, bool] | tuple[Experts, tuple[str, int | None], bool] | torch.Tensor
# Mixtral's HF names for the expert projections.


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, index: int) -> None:
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
        self.window = spec.window_of(index)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Q and K heads side by side in each row: one rotation for both (fewer small ops
            # per layer, which is what a decode step at batch 1 spends most of its time on).
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary.apply(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim))
            q, k = self.rotary.apply(q, *rope), self.rotary.apply(k, *rope)
        write_kv(k, v, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, rotary, index)
        self.post_attention_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (SparseMoE(spec) if spec.is_moe_layer(index)
                                     else MLP(spec.hidden_size, spec.intermediate_size))

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
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary, i) for i in range(spec.num_layers))
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

    def experts(self) -> list[tuple[int, Experts]]:
        """(layer index, its experts) of every MoE layer."""
        return [(i, layer.mlp.experts) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)]

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
            if isinstance(mlp, SparseMoE):
                slots |= self._moe_slots(f"{prefix}{ARCHITECTURES[self.spec.architecture].moe_block}.", mlp)
            else:
                slots |= _mlp_slots(f"{prefix}mlp.", mlp)
            slots[f"{prefix}input_layernorm.weight"] = layer.input_norm.weight
            slots[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_norm.weight
        return slots

    def _moe_slots(self, prefix: str, moe: SparseMoE) -> dict[str, Slot]:
        """The router, each expert's projections (HF, GPTQ, AWQ) or each projection of
        all experts stacked (``experts.gate_proj.weight``: GGUF), the shared expert."""
        experts = moe.experts
        slots: dict[str, Slot] = {f"{prefix}gate.weight": (moe.router, 0, False)}
        expert_names = dict(zip(PROJECTIONS, ARCHITECTURES[self.spec.architecture].expert_names))
        for projection in PROJECTIONS:
            slots[f"{prefix}experts.{projection}_proj.weight"] = (experts, (projection, None), False)
            name = expert_names[projection]
            for e in range(experts.num_experts):
                slots[f"{prefix}experts.{e}.{name}.weight"] = (experts, (projection, e), False)
        if moe.shared_expert is not None:
            slots |= _mlp_slots(f"{prefix}shared_expert.", moe.shared_expert)
            slots[f"{prefix}shared_expert_gate.weight"] = (moe.shared_expert_gate, 0, False)
        return slots


def _mlp_slots(prefix: str, mlp: MLP) -> dict[str, Slot]:
    return {f"{prefix}gate_proj.weight": (mlp.gate_up, 0, False), f"{prefix}up_proj.weight": (mlp.gate_up, 1, False),
            f"{prefix}down_proj.weight": (mlp.down, 0, False)}
