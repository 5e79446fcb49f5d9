"""Rotary position embeddings in HF's half-split ("rotate_half") layout, with the
context-extension schemes checkpoints declare: linear, llama3, YaRN, dynamic NTK and
longrope.

transformers switches dynamic NTK and longrope by the length of each forward's sequence;
a paged cache cannot re-rotate the keys it holds, so here (as in llama.cpp) the switch is
made once, by the context the engine serves: within the pre-trained context both equal
transformers exactly, and beyond it they are what transformers reaches at that length."""

from __future__ import annotations

import math

import torch

from localserve.errors import LocalserveError
from localserve.formats.spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, rotary_dim: int, context: int) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds and the scale YaRN and longrope apply to cos/sin (1
    elsewhere), for a model serving ``context`` tokens."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    theta = rope.theta
    if rope.kind == "dynamic" and rope.original_max_position and context > rope.original_max_position:
        # NTK: a larger base for a longer context (transformers' formula at that length).
        stretch = rope.factor * context / rope.original_max_position - (rope.factor - 1)
        theta = theta * stretch ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / theta**exponents
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64)
    if rope.kind in ("default", "dynamic"):
        return inv_freq.float(), 1.0
    if rope.kind == "longrope":
        return _longrope(inv_freq, rope, context)
    if rope.kind == "linear":
        return (inv_freq / rope.factor).float(), 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope).float(), 1.0
    if rope.kind == "yarn":
        return _yarn(inv_freq, rope, rotary_dim)
    raise ValueError(f"unknown rope kind {rope.kind}")


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Long wavelengths (beyond the pre-training context / low_freq_factor) are slowed
    # down by `factor`, short ones kept, and the band between interpolated smoothly.
    context = rope.original_max_position
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = context / rope.low_freq_factor
    high_freq_wavelen = context / rope.high_freq_factor
    smooth = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _longrope(inv_freq: torch.Tensor, rope: RopeSpec, context: int) -> tuple[torch.Tensor, float]:
    # Each pair's frequency divided by its factor: the long set past the pre-trained
    # context, the short set within it; cos/sin scaled by the context's growth.
    original = rope.original_max_position or context
    factors = rope.long_factor if context > original else rope.short_factor
    assert factors is not None
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(rope.factor) / math.log(original)) if rope.factor > 1 else 1.0
    return (inv_freq / torch.tensor(factors, dtype=torch.float64)).float(), float(attention_factor)


def _yarn(inv_freq: torch.Tensor, rope: RopeSpec, rotary_dim: int) -> tuple[torch.Tensor, float]:
    # Dimensions that rotate many times within the original context keep their
    # frequency (extrapolation); slow ones are interpolated by `factor`; a linear ramp
    # between the beta_fast and beta_slow rotation counts mixes the two.
    context = rope.original_max_position

    def dim_for_rotations(rotations: float) -> float:
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for_rotations(rope.beta_fast), dim_for_rotations(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    mixed = (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return mixed.float(), float(attention_factor)


def _mrope_axes(rope: RopeSpec, rotary_dim: int, device: torch.device) -> torch.Tensor | None:
    """For M-RoPE, which of a token's three positions each rotary dimension turns by:
    sections of consecutive pairs (Qwen2-VL, Qwen2.5-VL) or, interleaved (Qwen3-VL), pair
    i by position i % 3 until a section runs out; both halves alike."""
    if rope.mrope_section is None:
        return None
    sections = rope.mrope_section
    if sum(sections) != rotary_dim // 2:
        raise LocalserveError(f"mrope_section {list(sections)} covers {sum(sections)} frequency pairs; "
                              f"the heads have {rotary_dim // 2}")
    if rope.mrope_interleaved:
        axes, left = [], list(sections)
        for pair in range(rotary_dim // 2):
            axis = pair % 3 if left[pair % 3] > 0 else 0
            left[axis] -= 1
            axes.append(axis)
    else:
        axes = [axis for axis, count in enumerate(sections) for _ in range(count)]
    return torch.tensor(axes * 2, dtype=torch.long, device=device)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embeddings at arbitrary (flat-batch) positions."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position: int, device: torch.device) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        inv_freq, scale = inverse_frequencies(rope, self.rotary_dim, max_position)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # cos/sin of each pair, repeated for both halves as rotate_half expects.
        self.register_buffer("cos", (angles.cos() * scale).repeat(1, 2).to(device), persistent=False)
        self.register_buffer("sin", (angles.sin() * scale).repeat(1, 2).to(device), persistent=False)
        self.register_buffer("axis", _mrope_axes(rope, self.rotary_dim, device), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[tokens, 1, rotary_dim]`` at these positions; once per forward,
        shared by every layer. M-RoPE positions are ``[3, tokens]`` (frame, row, column):
        each frequency pair turns by the one its section names (a text token's three are
        equal, so plain ``[tokens]`` positions serve it too)."""
        if positions.dim() == 1:
            return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        assert self.axis is not None, "three positions per token for a model without M-RoPE"
        index = self.axis.unsqueeze(0).expand(positions.shape[1], -1)  # [tokens, rotary_dim]: which of the three
        cos, sin = (table[positions].gather(0, index.unsqueeze(0)).squeeze(0) for table in (self.cos, self.sin))
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [tokens, heads, head_dim]``; dimensions past rotary_dim pass through."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)
