"""What an image-text checkpoint says about its image side, read from its config files
without torch (the daemon reads it to lay out prompts; the engine to build the encoder):
SigLIP's tower (transformers' SiglipVisionConfig keys) and Gemma 3's processor settings
and image tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LocalserveError

if TYPE_CHECKING:
    from ..formats import Checkpoint


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    num_channels: int = 3

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> SiglipConfig:
        """From a checkpoint's ``vision_config`` (transformers' SiglipVisionConfig keys;
        the released Gemma 3 files state every one Gemma 3 needs)."""
        try:
            made = cls(hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
                       num_layers=int(config["num_hidden_layers"]), num_heads=int(config["num_attention_heads"]),
                       image_size=int(config["image_size"]), patch_size=int(config["patch_size"]),
                       layer_norm_eps=float(config.get("layer_norm_eps", 1e-6)),
                       num_channels=int(config.get("num_channels", 3)))
        except (KeyError, TypeError, ValueError) as exc:
            raise LocalserveError(f"config.json: vision_config is missing or has a bad {exc}") from None
        activation = config.get("hidden_act", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise LocalserveError(f"config.json: a vision tower with activation {activation!r} is not supported")
        if made.hidden_size % made.num_heads or made.image_size % made.patch_size or min(
                made.hidden_size, made.intermediate_size, made.num_layers, made.num_heads, made.patch_size) < 1:
            raise LocalserveError("config.json: vision_config's sizes do not fit together")
        return made

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True, slots=True)
class Gemma3ImageConfig:
    vision: SiglipConfig
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def from_hf(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> Gemma3ImageConfig:
        """From config.json and preprocessor_config.json (None when the checkpoint has
        none: the processor's defaults)."""
        vision = SiglipConfig.from_hf(config.get("vision_config") or {})
        preprocessor = preprocessor or {}
        try:
            made = cls(vision=vision, tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
                       image_token_id=int(config.get("image_token_index", 262_144)),
                       boi_token_id=int(config.get("boi_token_index", 255_999)),
                       eoi_token_id=int(config.get("eoi_token_index", 256_000)),
                       mean=_triple(preprocessor.get("image_mean", 0.5)),
                       std=_triple(preprocessor.get("image_std", 0.5)),
                       rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)))
        except (TypeError, ValueError) as exc:
            raise LocalserveError(f"Gemma 3's image settings cannot be read: {exc}") from None
        if preprocessor.get("do_pan_and_scan"):
            raise LocalserveError("preprocessor_config.json: pan-and-scan is not supported (turn do_pan_and_scan off)")
        side = math.isqrt(made.tokens_per_image)
        if side < 1 or side * side != made.tokens_per_image or vision.patches_per_side % side:
            raise LocalserveError(f"config.json: mm_tokens_per_image {made.tokens_per_image} is not a square that "
                                  f"divides the tower's {vision.patches_per_side} x {vision.patches_per_side} patches")
        if min(made.std) <= 0:
            raise LocalserveError("preprocessor_config.json: image_std must be positive")
        return made


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError("a mean or std needs one value per colour channel")
    return values[0], values[1], values[2]


def read_image_config(checkpoint: Checkpoint) -> Gemma3ImageConfig | None:
    """The image side of an image-text checkpoint (its config.json and, when present,
    preprocessor_config.json), or None for a text-only one."""
    if not checkpoint.image_text:
        return None
    from ..formats import hf
    from ..json_files import read_json_object

    preprocessor_path = checkpoint.path / "preprocessor_config.json"
    preprocessor = read_json_object(preprocessor_path) if preprocessor_path.is_file() else None
    return Gemma3ImageConfig.from_hf(hf.read_config(checkpoint.path), preprocessor)
