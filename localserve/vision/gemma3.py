"""Gemma 3's image side (Gemma3ForConditionalGeneration: 4B, 12B, 27B): its processor's
steps, the SigLIP tower and the projector that turns the tower's patches into the text
model's image tokens.

- Preprocessing, as transformers' Gemma3ImageProcessor does it with pan-and-scan off (its
  default): RGB, resized to the tower's square (896 px) with bilinear resampling, scaled
  to [0, 1], normalized with the processor's mean and std (0.5 each).
- The projector: the tower's 64 x 64 patch grid average-pooled to 16 x 16 (256 tokens),
  an RMSNorm with Gemma's (1 + weight), one matmul to the text model's width.
- The prompt: where the chat template writes ``<start_of_image>``, the processor puts
  ``"\\n\\n<start_of_image>"``, 256 ``<image_soft_token>`` and ``"<end_of_image>\\n\\n"``; the
  text model takes the projected tokens at the soft tokens' places, and those places see
  each other (bidirectional attention within one image) as well as everything before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import Gemma3ImageConfig
from .image_input import ImageInput
from .siglip import SiglipVisionTower


class _SoftEmbeddingNorm(nn.Module):
    """Gemma's RMSNorm: computed in fp32, scaled by (1 + weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _Projector(nn.Module):
    def __init__(self, config: Gemma3ImageConfig, text_hidden: int) -> None:
        super().__init__()
        vision = config.vision
        self.side = vision.patches_per_side
        self.pool = self.side // math.isqrt(config.tokens_per_image)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = _SoftEmbeddingNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        images, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)


class Gemma3Vision(nn.Module):
    """Images -> the text model's image tokens, ``[images, tokens_per_image, text hidden]``."""

    bidirectional = True  # an image's tokens attend to each other in the text model

    def __init__(self, config: Gemma3ImageConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.tower = SiglipVisionTower(config.vision)
        self.projector = _Projector(config, text_hidden)

    def pixels(self, image: ImageInput) -> torch.Tensor:
        """``[3, size, size]`` float32, as the processor makes them."""
        size = self.config.vision.image_size
        from PIL import Image

        resized = image.rgb().resize((size, size), Image.Resampling.BILINEAR)
        array = np.asarray(resized, dtype=np.float64) * self.config.rescale_factor
        array = (array - np.asarray(self.config.mean)) / np.asarray(self.config.std)
        return torch.from_numpy(array.astype(np.float32)).permute(2, 0, 1).contiguous()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixels))

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's tokens ``[tokens_per_image, 1, text hidden]`` (one part: see
        ImageSpan), the images in one batch."""
        device = self.projector.mm_input_projection_weight.device
        return [tokens.unsqueeze(1) for tokens in self(torch.stack([self.pixels(image) for image in images]).to(device))]
