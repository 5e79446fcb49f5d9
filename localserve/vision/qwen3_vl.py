"""Qwen3-VL's image side (Qwen3VLForConditionalGeneration): the same processor as
Qwen2.5-VL (qwen_vl.image_patches; the released files use 16-pixel patches and a mean
and std of 0.5) and a different vision transformer, in plain torch.

- The patches are embedded by one matmul (the checkpoint's Conv3d, here with a bias),
  plus a learned position: the checkpoint holds a square grid of them, resized to each
  image's patch grid (bilinear, corners aligned) before it is added.
- Pre-norm blocks (LayerNorm) with 2D rotary positions and a two-layer MLP; every block
  attends across the whole image (no windows), never across images, so the patches stay
  in the processor's order throughout.
- The merger joins each 2 x 2 block of patches into one image token (LayerNorm on each
  patch first). DeepStack: the outputs of the ``deepstack_visual_indexes`` blocks go
  through mergers of their own (LayerNorm after joining) and are added, one per layer,
  to the text model's hidden states at the image tokens after its first layers: the
  first deepstack output after text layer 0, the second after layer 1, and so on.

The parameters' names are the checkpoint's below ``model.visual.`` (qwen_vl.checkpoint_name
strips it), so loading is a plain ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .image_input import ImageInput
from .qwen_config import Qwen3VisionConfig
from .qwen_vl import AttentionRuns, AxialRotary, Grid, PatchLayout, QwenPixels, VisionAttention, image_patches


@dataclass(frozen=True, slots=True, eq=False)
class Qwen3ImageEmbeds:
    """One image's (or a batch's) output: ``tokens`` replace the prompt's image tokens;
    ``deepstack[i]`` is added to the text model's hidden states at those tokens after
    its layer ``i``."""

    tokens: torch.Tensor  # [image tokens, out_hidden_size]
    deepstack: tuple[torch.Tensor, ...]  # one [image tokens, out_hidden_size] per deepstack block


class _PatchEmbed(nn.Module):
    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # The checkpoint's Conv3d, for its weight's shape: stride = kernel = one patch, so one matmul.
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class _MLP(nn.Module):
    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class _Block(nn.Module):
    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: AttentionRuns) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """A merged patch's ``merge x merge`` patches (consecutive rows) joined side by side,
    through a two-layer GELU MLP to the text model's width. The main merger normalizes
    each patch before joining; the deepstack ones the joined vector."""

    def __init__(self, config: Qwen3VisionConfig, norm_after_joining: bool) -> None:
        super().__init__()
        self.joined = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_joining = norm_after_joining
        self.norm = nn.LayerNorm(self.joined if norm_after_joining else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.joined, self.joined)
        self.linear_fc2 = nn.Linear(self.joined, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_joining:
            joined = self.norm(x.reshape(-1, self.joined))
        else:
            joined = self.norm(x).reshape(-1, self.joined)
        return self.linear_fc2(F.gelu(self.linear_fc1(joined)))


class Qwen3VisionTransformer(nn.Module):
    """Patches of one or more images -> their image tokens and deepstack features, image
    after image in the processor's order (the prompt's)."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary = AxialRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _PatchMerger(config, norm_after_joining=False)
        self.deepstack_merger_list = nn.ModuleList(
            _PatchMerger(config, norm_after_joining=True) for _ in config.deepstack_visual_indexes)

    bidirectional = False  # Qwen's text model reads an image's tokens causally, as any others

    def pixels(self, image: ImageInput | Image.Image) -> QwenPixels:
        return image_patches(image, self.config.processing)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's ``[tokens, 1 + deepstack blocks, out_hidden_size]``: its tokens, then
        what is added after each of the text model's first layers (see ImageSpan)."""
        return [torch.stack((out.tokens, *out.deepstack), dim=1)
                for out in self.encode([self.pixels(image) for image in images])]

    def tokens_per_image(self, grid: Grid) -> int:
        frames, rows, columns = grid
        return frames * rows * columns // self.config.spatial_merge_size ** 2

    def _positions(self, grids: Sequence[Grid], rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Each patch's learned position: the square table resized to its image's grid
        (bilinear, the corners of both grids aligned) and read at its row and column."""
        side = self.config.positions_per_side
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        out, first = [], 0
        resized: dict[tuple[int, int], torch.Tensor] = {}
        for frames, height, width in grids:
            if (height, width) not in resized:
                grid = F.interpolate(table, size=(height, width), mode="bilinear", align_corners=True)
                resized[height, width] = grid[0].flatten(1).t()  # [height * width, hidden], row-major
            count = frames * height * width
            out.append(resized[height, width][rows[first:first + count] * width + columns[first:first + count]])
            first += count
        return torch.cat(out).to(self.pos_embed.weight.dtype)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> Qwen3ImageEmbeds:
        """``patches``: the images' QwenPixels.patches concatenated; ``grids``: theirs."""
        config = self.config
        merge = config.spatial_merge_size
        if patches.shape != (sum(t * h * w for t, h, w in grids), config.patch_values):
            raise ValueError(f"patches of shape {list(patches.shape)} do not fit the grids {list(grids)}")
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"a grid in {list(grids)} is not a whole number of merged patches")
        # Without windows the tower keeps the processor's order: the layout's orders are the identity.
        weight = self.patch_embed.proj.weight
        layout = PatchLayout.build(grids, merge, window=None).to(weight.device)
        x = self.patch_embed(patches.to(device=weight.device, dtype=weight.dtype))
        x = x + self._positions(grids, layout.rows, layout.columns)
        cos, sin = self.rotary(layout.rows, layout.columns)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.images)
            if index in config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return Qwen3ImageEmbeds(self.merger(x), tuple(deepstack))

    def encode(self, images: Sequence[QwenPixels]) -> list[Qwen3ImageEmbeds]:
        """Several images in one call, each one's outputs apart."""
        grids = [image.grid for image in images]
        out = self(torch.cat([image.patches for image in images]), grids)
        sizes = [self.tokens_per_image(grid) for grid in grids]
        tokens = out.tokens.split(sizes)
        deepstack = [feature.split(sizes) for feature in out.deepstack]
        return [Qwen3ImageEmbeds(tokens[i], tuple(feature[i] for feature in deepstack)) for i in range(len(images))]
