"""Qwen2.5-VL's image side (Qwen2_5_VLForConditionalGeneration): its processor's steps
and its vision transformer, in plain torch. The settings are read by qwen_config.py.

- Preprocessing, as transformers' Qwen2VLImageProcessor does it: the RGB image resized
  (bicubic, Pillow) so both sides are multiples of one merged patch and its area within
  the processor's bounds, scaled to [0, 1], normalized, and cut into patches. A still
  image is one frame repeated ``temporal_patch_size`` times, so one patch holds
  channels x frames x patch x patch numbers.
- The tower: the patches embedded by one matmul (the checkpoint's Conv3d, whose stride
  is its kernel), 2D rotary positions (row, column) for each patch, pre-norm (RMSNorm)
  blocks with SwiGLU MLPs. Most blocks attend within windows of a few merged patches a
  side; the ``fullatt_block_indexes`` ones across the whole image. Images never see each
  other. Then the merger joins each 2 x 2 block of patches into one image token of the
  text model's width.
- The order of patches: the processor lays out each image merged patch by merged patch
  (the 2 x 2 patches the merger joins are consecutive). The tower reorders them window by
  window, so that every window is a contiguous run, and puts the merged tokens back in
  the processor's order at the end: the order of the prompt's image tokens.

The parameters' names are the checkpoint's below ``visual.`` (``checkpoint_name``), so
loading is a plain ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .image_input import ImageInput
from .qwen_config import QwenImageProcessing, QwenVisionConfig

Grid = tuple[int, int, int]  # (frames, patch rows, patch columns) of one image

# Where transformers saves the tower: ``visual.`` (the released files, and transformers 5,
# which writes the released layout back) or ``model.visual.`` (transformers 4.5x).
_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")


def checkpoint_name(name: str) -> str | None:
    """The tower's name for a checkpoint tensor, or None for the text model's."""
    for prefix in _CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


# -- the processor ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class QwenPixels:
    """One image as the tower takes it."""

    patches: torch.Tensor  # [frames * rows * columns, channels * temporal_patch_size * patch * patch] float32
    grid: Grid

    @property
    def num_patches(self) -> int:
        return self.patches.shape[0]


def image_patches(image: ImageInput | Image.Image, processing: QwenImageProcessing) -> QwenPixels:
    """An image (an RGB PIL image, or an ImageInput), resized, normalized and flattened
    as the processor does."""
    rgb = image.rgb() if isinstance(image, ImageInput) else image
    if rgb.mode != "RGB":
        raise ValueError(f"image_patches takes RGB images, not mode {rgb.mode}")
    height, width = processing.resized_size(rgb.height, rgb.width)
    resized = rgb.resize((width, height), Image.Resampling(processing.resample))
    # The processor's arithmetic and types: the scaling in float64 stored as float32, the
    # normalization in float32; so the numbers equal its own to the last bit.
    scaled = (np.asarray(resized, dtype=np.uint8).astype(np.float64) * processing.rescale_factor).astype(np.float32)
    normalized = (scaled - np.asarray(processing.mean, dtype=np.float32)) / np.asarray(processing.std, dtype=np.float32)
    patches = torch.from_numpy(_flatten_patches(normalized, processing))
    return QwenPixels(patches, processing.grid(rgb.height, rgb.width))


def _flatten_patches(pixels: np.ndarray, processing: QwenImageProcessing) -> np.ndarray:
    """``[height, width, channels]`` -> one row per patch, ``[rows * columns, values]``.

    Rows go merged patch by merged patch (row-major over the merged grid), and within
    one merged patch its ``merge x merge`` patches row-major. A row holds the channels
    one after another, each as ``temporal_patch_size`` copies of the patch's pixels (a
    still image is its own repeated frames), each copy row-major."""
    height, width, channels = pixels.shape
    patch, merge, frames = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    rows, columns = height // patch, width // patch
    blocks = pixels.reshape(rows // merge, merge, patch, columns // merge, merge, patch, channels)
    # (merged row, merged column, patch row in it, patch column in it, channel, pixel row, pixel column)
    ordered = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    repeated = np.broadcast_to(ordered[:, :, :, :, :, None], (*ordered.shape[:5], frames, patch, patch))
    return np.ascontiguousarray(repeated.reshape(rows * columns, channels * frames * patch * patch))


# -- where each patch goes -------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class PatchLayout:
    """For a batch of images: the patches' order inside the tower, their rotary
    positions in that order, and the runs attention stays within."""

    patch_order: torch.Tensor  # [patches]: the processor's row of each of the tower's patches
    merged_order: torch.Tensor  # [merged patches]: the same for merged patches
    rows: torch.Tensor  # [patches] each patch's row in its image (tower order)
    columns: torch.Tensor  # [patches]
    windows: AttentionRuns
    images: AttentionRuns

    @classmethod
    def build(cls, grids: Sequence[Grid], merge: int, window: int | None) -> PatchLayout:
        """``window``: a window's side in merged patches, None for no windows (every
        block attends across the image)."""
        merged_orders, window_lengths, image_lengths = [], [], []
        rows, columns = [], []
        unit = merge * merge  # patches in one merged patch
        first = 0  # the batch's index of this image's first merged patch
        for frames, height, width in grids:
            merged_rows, merged_columns = height // merge, width // merge
            per_frame = merged_rows * merged_columns
            frame = torch.arange(frames).repeat_interleave(per_frame)
            local = torch.arange(per_frame).repeat(frames)
            row, column = local // merged_columns, local % merged_columns
            if window is None:
                order = torch.arange(frames * per_frame)
                window_lengths += [per_frame * unit] * frames
            else:
                # Windows tile the merged grid from its top left corner (the last row and
                # column of windows may be cut short). A stable sort by window keeps each
                # window's merged patches in row-major order.
                windows_across = -(-merged_columns // window)
                windows_down = -(-merged_rows // window)
                window_of = (frame * windows_down + row // window) * windows_across + column // window
                order = torch.argsort(window_of, stable=True)
                counts = torch.bincount(window_of, minlength=frames * windows_down * windows_across)
                window_lengths += [count * unit for count in counts.tolist() if count]
            merged_orders.append(order + first)
            image_lengths += [per_frame * unit] * frames  # each frame of a video attends alone
            # A patch's position: its merged patch's, scaled, plus where it sits in it.
            inside = torch.arange(unit)
            rows.append((row[order, None] * merge + inside // merge).flatten())
            columns.append((column[order, None] * merge + inside % merge).flatten())
            first += frames * per_frame
        merged_order = torch.cat(merged_orders)
        patch_order = (merged_order[:, None] * unit + torch.arange(unit)).flatten()
        return cls(patch_order=patch_order, merged_order=merged_order, rows=torch.cat(rows), columns=torch.cat(columns),
                   windows=AttentionRuns(window_lengths), images=AttentionRuns(image_lengths))

    def to(self, device: torch.device) -> PatchLayout:
        return PatchLayout(self.patch_order.to(device), self.merged_order.to(device), self.rows.to(device),
                           self.columns.to(device), self.windows.to(device), self.images.to(device))


class AttentionRuns:
    """Contiguous runs of tokens that attend only within themselves. Runs of one length
    are attended together as a batch, so there is no mask and no padding."""

    def __init__(self, lengths: Sequence[int], groups: list[torch.Tensor] | None = None) -> None:
        self.lengths = list(lengths)
        if groups is None:
            starts: dict[int, list[int]] = {}
            start = 0
            for length in self.lengths:
                starts.setdefault(length, []).append(start)
                start += length
            groups = [torch.tensor(run_starts)[:, None] + torch.arange(length)
                      for length, run_starts in starts.items()]
        self.groups = groups  # each [runs, length]: the token indexes of runs of one length

    def to(self, device: torch.device) -> AttentionRuns:
        return AttentionRuns(self.lengths, [group.to(device) for group in self.groups])

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, head_dim]`` each -> the attention output, same shape."""
        if len(self.groups) == 1 and self.groups[0].shape[0] == 1:  # one run: all tokens see all
            return F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (query, key, value))).transpose(0, 1)
        out = torch.empty_like(query)
        for group in self.groups:
            runs, length = group.shape
            q, k, v = (t[group].transpose(1, 2) for t in (query, key, value))  # [runs, heads, length, head_dim]
            attended = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim)
            out[group.flatten()] = attended.transpose(1, 2).reshape(runs * length, *query.shape[1:])
        return out


# -- the tower -------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    """Computed in float32; the weight multiplies after the cast back."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # Kept as the checkpoint's Conv3d for its weight's shape; its stride is its kernel
        # and each patch is exactly one kernel, so it is one matmul with the weight flattened.
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return patches @ self.proj.weight.flatten(1).t()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32 with the halves pairing (dimension i with i + d/2)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + turned * sin).to(x.dtype)


class VisionAttention(nn.Module):
    """Attention with biased projections and 2D rotary positions, within runs of patches
    (also Qwen3-VL's)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: AttentionRuns) -> torch.Tensor:
        tokens, hidden = x.shape
        query, key, value = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        out = runs.attend(_rotate(query, cos, sin), _rotate(key, cos, sin), value)
        return self.proj(out.reshape(tokens, hidden))


class _MLP(nn.Module):
    """SwiGLU, with biases."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.norm2 = _RMSNorm(config.hidden_size)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: AttentionRuns) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """Each merged patch's ``merge x merge`` patches (consecutive rows), normed, joined
    side by side and taken through a two-layer GELU MLP to the text model's width."""

    def __init__(self, hidden: int, merge: int, out_hidden: int) -> None:
        super().__init__()
        joined = hidden * merge * merge
        self.ln_q = _RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(joined, joined), nn.GELU(), nn.Linear(joined, out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class AxialRotary(nn.Module):
    """Rotary angles from a patch's (row, column): a head's first quarter of frequencies
    turn with the row, its second with the column, and that half-size set of angles is
    used twice (the halves pairing of ``_rotate``). The frequencies are made in float32
    at each call rather than kept as a buffer, which ``.to(dtype)`` would round."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, rows: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        inv_freq = 1.0 / self.theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=rows.device) / half)
        angles = torch.cat((rows[:, None].float() * inv_freq, columns[:, None].float() * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [patches, 1 (every head), head_dim]
        return angles.cos(), angles.sin()


class QwenVisionTransformer(nn.Module):
    """Patches of one or more images -> their image tokens, ``[tokens, out_hidden_size]``,
    image after image in the processor's order (the prompt's)."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.rotary = AxialRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _PatchMerger(config.hidden_size, config.spatial_merge_size, config.out_hidden_size)

    bidirectional = False  # Qwen's text model reads an image's tokens causally, as any others

    def pixels(self, image: ImageInput | Image.Image) -> QwenPixels:
        return image_patches(image, self.config.processing)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's tokens ``[tokens, 1, out_hidden_size]`` (one part: see ImageSpan),
        the images in one call."""
        return [tokens.unsqueeze(1) for tokens in self.encode([self.pixels(image) for image in images])]

    def tokens_per_image(self, grid: Grid) -> int:
        frames, rows, columns = grid
        return frames * rows * columns // self.config.spatial_merge_size ** 2

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """``patches``: the images' QwenPixels.patches concatenated; ``grids``: theirs."""
        config = self.config
        merge = config.spatial_merge_size
        if patches.shape != (sum(t * h * w for t, h, w in grids), config.patch_values):
            raise ValueError(f"patches of shape {list(patches.shape)} do not fit the grids {list(grids)}")
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"a grid in {list(grids)} is not a whole number of merged patches")
        weight = self.patch_embed.proj.weight
        layout = PatchLayout.build(grids, merge, config.window_merged_patches).to(weight.device)
        x = self.patch_embed(patches.to(device=weight.device, dtype=weight.dtype))[layout.patch_order]
        cos, sin = self.rotary(layout.rows, layout.columns)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.images if index in config.fullatt_block_indexes else layout.windows)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[layout.merged_order] = merged  # back to the processor's order
        return out

    def encode(self, images: Sequence[QwenPixels]) -> list[torch.Tensor]:
        """Several images in one call, each one's image tokens apart."""
        grids = [image.grid for image in images]
        out = self(torch.cat([image.patches for image in images]), grids)
        return list(out.split([self.tokens_per_image(grid) for grid in grids]))
