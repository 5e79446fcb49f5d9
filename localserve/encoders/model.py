"""The encoder network in plain torch, one layout for BERT, RoBERTa and nomic-bert
(config.py says how they differ), run over a packed batch (packing.py).

Embeddings (token + learned position or none + segment), layer-normed; then per layer
post-norm attention and MLP: ``x = norm1(x + attn(x))``, ``x = norm2(x + mlp(x))``.
Q, K and V are one matmul (fused at load). Attention is bidirectional within each input
and never across inputs: one SDPA call per input over its own span of rows, which on a CPU
costs only the input's own length squared (a block-diagonal mask over the whole batch
would cost the batch's length squared, padding to the longest input its padding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .packing import PackedBatch

_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
                "silu": F.silu}


class Rotary:
    """Rotary positions over the whole head, pairs split in halves (rotate_half), as nomic
    runs them (rotary_emb_interleaved false) and transformers' NomicBert does. Computed per
    batch from the positions (no buffer: the model is built on the meta device)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin per row, [tokens, 1, head_dim], computed in float32 then cast."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        angles = positions.float()[:, None] * (1.0 / self.theta ** exponents)[None, :]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        width = config.num_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * width, bias=config.attention_bias)
        self.out = nn.Linear(width, config.hidden_size, bias=config.attention_bias)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # A gated MLP's gate and up projections are one matmul, gate rows first.
        up_rows = 2 * config.intermediate_size if config.gated_mlp else config.intermediate_size
        self.up = nn.Linear(config.hidden_size, up_rows, bias=config.up_bias)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.down_bias)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gated = config.gated_mlp
        self.act = _ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor, batch: PackedBatch,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = self.attn_norm(x + self.out(self.attention(x, batch, rotary)))
        h = self.up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.mlp_norm(x + self.down(h))

    def attention(self, x: torch.Tensor, batch: PackedBatch,
                  rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        # [heads, tokens, head_dim], contiguous once per layer, so each input's span is a view.
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        outputs = [F.scaled_dot_product_attention(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n])
                   for s, n in batch.spans]
        return torch.cat(outputs, dim=1).transpose(0, 1).reshape(tokens, -1)


class ClassifierHead(nn.Module):
    """A reranker's score from its first token ([CLS] or <s>): ``out(tanh(dense(x)))``. BERT
    names these pooler.dense and classifier, RoBERTa classifier.dense and classifier.out_proj."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        assert config.num_labels is not None
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first)))


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = None if config.rope_theta is not None else \
            nn.Embedding(config.max_positions + config.position_offset, config.hidden_size)
        self.type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.rotary = None if config.rope_theta is None else Rotary(config.head_dim, config.rope_theta)
        self.head = ClassifierHead(config) if config.classifies else None

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states, one row per packed token."""
        x = self.word_embeddings(batch.input_ids) + self.type_embeddings(batch.type_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(batch.positions)
        x = self.embed_norm(x)
        rotary = None if self.rotary is None else self.rotary(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, batch, rotary)
        return x
