"""The Llama family: Llama 1/2/3 (biases optional), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k
norm), Granite (multipliers), Phi-3 (fused projections, longrope), Gemma 2 and 3 (GeGLU,
(1 + w) norms around both blocks, scaled embeddings, soft caps, local and global layers
with their own rotary bases), and the mixture-of-experts kin Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and GPT-OSS (a SparseMoE block in place of the MLP; GPT-OSS adds biases
everywhere and attention sinks).

One module serves them all; the spec's fields switch the differences. Q/K/V and
gate/up projections are fused into single matmuls where the weights' layouts allow,
filled part by part from the checkpoint's separate tensors at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from localserve.formats.spec import ModelSpec
from localserve.kernels import AttentionMetadata, KVCache, paged_attention, write_kv
from localserve.kernels.decoder_cpu import DecoderStack
from localserve.kernels.dispatch import use_cpu_kernels

from localserve.formats.architectures import ARCHITECTURES
from localserve.formats.layout import PROJECTIONS

from .cpu_stack import stack_for
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
        fused = ARCHITECTURES[spec.architecture].fused_projections
        parts = [self.q_size + 2 * self.kv_size] if fused else [self.q_size, self.kv_size, self.kv_size]
        self.qkv = Linear(spec.hidden_size, parts, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, [spec.hidden_size], bias=spec.attention_out_bias)
        offset = spec.norm_weight_offset
        self.q_norm = RMSNorm(spec.qk_norm_size(self.q_size), spec.rms_norm_eps, offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.qk_norm_size(self.kv_size), spec.rms_norm_eps, offset) if spec.qk_norm else None
        self.qk_norm_whole = ARCHITECTURES[spec.architecture].qk_norm_whole
        self.clip_qkv = spec.clip_qkv
        # GPT-OSS's sinks: one logit per head, kept in fp32 (a buffer, so cast() leaves it).
        self.register_buffer("sinks", torch.zeros(self.num_heads) if spec.attention_sinks else None)
        self.rotary = rotary
        self.scale = spec.query_scale
        self.softcap = spec.attention_softcap
        self.window = spec.window_of(index)
        # Sliding layers with rotary settings of their own (Gemma 3) take the second table.
        self.rope_index = 1 if spec.is_local_layer(index) and spec.local_rope is not None else 0

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.q_norm is None:
            qkv = self._clip(qkv)
            v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
            # Q and K heads side by side in each row: one rotation for both (fewer small ops
            # per layer, which is what a decode step at batch 1 spends most of its time on).
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary.apply(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm_whole:  # OLMoE: one norm over all heads' q, one over all k, then the clip
                q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = self._clip(q), self._clip(k), self._clip(v)
            q = q.reshape(-1, self.num_heads, self.head_dim)
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim)
            if not self.qk_norm_whole:  # Qwen3, Gemma 3: each head normalised on its own
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary.apply(q, *rope), self.rotary.apply(k, *rope)
        write_kv(k, v, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


    def _clip(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.clip_qkv is None else x.clamp(-self.clip_qkv, self.clip_qkv)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_weight_offset)

        self.input_norm = norm()
        self.attn = Attention(spec, rotary, index)
        self.pre_mlp_norm = norm()
        # Gemma normalises each block's output too, before the residual add.
        self.attn_out_norm = norm() if spec.sandwich_norms else None
        self.mlp_out_norm = norm() if spec.sandwich_norms else None
        self.residual_scale = spec.residual_scale
        fused = ARCHITECTURES[spec.architecture].fused_projections
        self.mlp: MLP | SparseMoE = (SparseMoE(spec) if spec.is_moe_layer(index)
                                     else MLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act,
                                              spec.mlp_bias, fused))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self._block_out(self.attn(self.input_norm(x), rope, cache, meta), self.attn_out_norm)
        return x + self._block_out(self.mlp(self.pre_mlp_norm(x)), self.mlp_out_norm)

    def _block_out(self, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if norm is not None:
            out = norm(out)
        return out * self.residual_scale if self.residual_scale != 1.0 else out


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_position, device)
        self.local_rotary = (RotaryEmbedding(spec.local_rope, spec.head_dim, max_position, device)
                             if spec.local_rope is not None else None)
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_weight_offset)
        self.lm_head = self.embed if spec.tie_word_embeddings else Linear(spec.hidden_size, [spec.vocab_size])
        self.dtype = torch.float32
        self.embedding_scale = spec.embedding_scale
        # The layers as one C++ call on the CPU (cpu_stack.py), made at the first forward
        # over a set of caches; None where the modules must run.
        self._stack: tuple[tuple[int, ...], DecoderStack | None] | None = None

    def cast(self, dtype: torch.dtype) -> None:
        """Parameters to ``dtype`` (the rotary cos/sin tables stay fp32, as the references
        keep them), and the embedding scale rounded to it, as transformers' Gemma rounds
        its normalizer (sqrt(2304) is exact anyway, sqrt(1152) is not; Granite's 12 is
        exact in every dtype)."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        self.dtype = dtype
        self.embedding_scale = torch.tensor(self.spec.embedding_scale, dtype=dtype).item()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        embeds_at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` for a flat batch; writes this step's K/V.
        ``embeds_at`` (rows, ``[rows, parts, hidden]``): part 0 replaces those rows' token
        embeddings (an image's tokens, from its encoder; the text scale is not applied);
        part i > 0 is added to their hidden states after layer i - 1 (Qwen3-VL's deepstack)."""
        x = self.embed.lookup(input_ids, self.dtype)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        added: torch.Tensor | None = None  # [parts - 1, rows, hidden]: what each early layer's output gets
        if embeds_at is not None:
            rows, parts = embeds_at
            x[rows] = parts[:, 0].to(x.dtype)
            added = parts[:, 1:].transpose(0, 1).to(x.dtype) if parts.shape[1] > 1 else None
        ropes = [self.rotary.lookup(positions, x.dtype)]
        if self.local_rotary is not None:
            ropes.append(self.local_rotary.lookup(positions, x.dtype))
        # The C++ stack's attention is causal only and runs its layers in one go: a step with
        # tokens that see ahead, or with features to add between layers, runs the modules.
        stack = (self._cpu_stack(kv_caches) if use_cpu_kernels(x) and not meta.bidirectional and added is None
                 else None)
        if stack is not None:
            return stack.run(x, ropes, meta)  # the final norm included
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, ropes[layer.attn.rope_index], cache, meta)
            if added is not None and index < len(added):
                x[embeds_at[0]] += added[index]  # type: ignore[index]
        return self.norm(x)

    def _cpu_stack(self, kv_caches: list[KVCache]) -> DecoderStack | None:
        key = tuple(cache.key.data_ptr() for cache in kv_caches)
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, stack_for(self, kv_caches))
        return self._stack[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits

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
            if len(attn.qkv.part_sizes) == 1:  # held whole (Phi-3)
                slots |= _linear_slots(f"{prefix}self_attn.qkv_proj.", attn.qkv, 0)
            else:
                for part, name in enumerate(("q", "k", "v")):
                    slots |= _linear_slots(f"{prefix}self_attn.{name}_proj.", attn.qkv, part)
            slots |= _linear_slots(f"{prefix}self_attn.o_proj.", attn.o_proj, 0)
            if attn.sinks is not None:
                slots[f"{prefix}self_attn.sinks"] = attn.sinks
            if attn.q_norm is not None:
                slots[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight
                slots[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight
            if isinstance(mlp, SparseMoE):
                slots |= self._moe_slots(f"{prefix}{ARCHITECTURES[self.spec.architecture].moe_block}.", mlp)
            else:
                slots |= _mlp_slots(f"{prefix}mlp.", mlp)
            slots[f"{prefix}input_layernorm.weight"] = layer.input_norm.weight
            if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
                # Gemma's names: post_attention_layernorm is the attention's output norm.
                slots[f"{prefix}post_attention_layernorm.weight"] = layer.attn_out_norm.weight
                slots[f"{prefix}pre_feedforward_layernorm.weight"] = layer.pre_mlp_norm.weight
                slots[f"{prefix}post_feedforward_layernorm.weight"] = layer.mlp_out_norm.weight
            else:
                slots[f"{prefix}post_attention_layernorm.weight"] = layer.pre_mlp_norm.weight
        return slots

    def _moe_slots(self, prefix: str, moe: SparseMoE) -> dict[str, Slot]:
        """The router, each expert's projections (HF, GPTQ, AWQ) or each projection of
        all experts stacked (``experts.gate_proj.weight``: GGUF), the shared expert."""
        experts = moe.experts
        slots: dict[str, Slot] = _linear_slots(f"{prefix}gate.", moe.router, 0)
        expert_names = dict(zip(PROJECTIONS, ARCHITECTURES[self.spec.architecture].expert_names))
        for projection in PROJECTIONS:
            slots[f"{prefix}experts.{projection}_proj.weight"] = (experts, (projection, None), False)
            if self.spec.expert_bias:  # stacked only, as the layout has them
                slots[f"{prefix}experts.{projection}_proj.bias"] = (experts, (projection, None), True)
                continue
            name = expert_names[projection]
            for e in range(experts.num_experts):
                slots[f"{prefix}experts.{e}.{name}.weight"] = (experts, (projection, e), False)
        if moe.shared_expert is not None:
            slots |= _mlp_slots(f"{prefix}shared_expert.", moe.shared_expert)
            slots[f"{prefix}shared_expert_gate.weight"] = (moe.shared_expert_gate, 0, False)
        return slots


def _linear_slots(prefix: str, linear: Linear, part: int) -> dict[str, Slot]:
    """``prefix`` + weight (and bias, when the projection has one) of one part."""
    slots: dict[str, Slot] = {f"{prefix}weight": (linear, part, False)}
    if linear.bias_parts is not None:
        slots[f"{prefix}bias"] = (linear, part, True)
    return slots


def _mlp_slots(prefix: str, mlp: MLP) -> dict[str, Slot]:
    if len(mlp.gate_up.part_sizes) == 1:  # held whole (Phi-3)
        slots = _linear_slots(f"{prefix}gate_up_proj.", mlp.gate_up, 0)
    else:
        slots = _linear_slots(f"{prefix}gate_proj.", mlp.gate_up, 0) | _linear_slots(f"{prefix}up_proj.", mlp.gate_up, 1)
    return slots | _linear_slots(f"{prefix}down_proj.", mlp.down, 0)
