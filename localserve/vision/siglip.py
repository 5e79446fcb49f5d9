"""SigLIP's vision transformer (Gemma 3's vision tower), in plain torch: the image cut
into patches by a strided convolution, a learned position per patch, pre-norm encoder
layers with full (bidirectional) attention over the patches, a final LayerNorm. It runs
whole images, so it needs no paged cache: attention is torch's SDPA.

The names of its parameters are the checkpoint's below the tower's prefix (see
``formats/multimodal.vision_name``), so loading is a plain ``load_state_dict``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SiglipConfig


class _Attention(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(config.hidden_size, config.hidden_size) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        heads = [proj(x).view(batch, tokens, self.num_heads, -1).transpose(1, 2)
                 for proj in (self.q_proj, self.k_proj, self.v_proj)]
        out = F.scaled_dot_product_attention(*heads)  # scale 1/sqrt(head_dim), no mask: every patch sees all
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class _MLP(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _EncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side ** 2, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [images, patches, hidden], row-major
        return patches + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.num_layers))


class SiglipVisionTower(nn.Module):
    """``[images, channels, size, size]`` pixels -> ``[images, patches, hidden]``."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels.to(self.embeddings.patch_embedding.weight.dtype))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
