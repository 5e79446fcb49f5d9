"""What an image-text checkpoint says about its image side, read from its config files
without torch (the daemon reads it to lay out prompts; the engine to build the encoder):
SigLIP's tower (transformers' SiglipVisionConfig keys) and Gemma 3's processor settings
and image tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LocalserveError

from .placement import ImageLayout

if TYPE_CHECKING:
    from ..formats import Checkpoint
    from ..formats.gguf_file import GGUFFile
    from .image_input import ImageInput
    from .qwen_config import Qwen3VisionConfig, QwenVisionConfig


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
        return made.check("config.json: vision_config")

    def check(self, where: str) -> SiglipConfig:
        if min(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.patch_size) < 1 or (
                self.hidden_size % self.num_heads or self.image_size % self.patch_size):
            raise LocalserveError(f"{where}: the vision tower's sizes do not fit together")
        return self

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
        return made.checked("config.json")

    @classmethod
    def from_mmproj(cls, projector: GGUFFile, tokens: Sequence[str], text_hidden: int) -> Gemma3ImageConfig:
        """From llama.cpp's projector file (its ``clip.vision.*`` keys, as the converter
        writes them from the same config files) and the text model's vocabulary, where the
        image tokens are found by their text."""
        metadata = projector.metadata

        def value(key: str, kind: type, default: Any = None) -> Any:
            found = metadata.get(f"clip.vision.{key}", default)
            if found is None or isinstance(found, bool) or not isinstance(found, kind) or (kind is int and found < 1):
                raise LocalserveError(f"{projector.path}: metadata clip.vision.{key} is missing or bad ({found!r})")
            return found

        vision = SiglipConfig(hidden_size=value("embedding_length", int),
                              intermediate_size=value("feed_forward_length", int),
                              num_layers=value("block_count", int), num_heads=value("attention.head_count", int),
                              image_size=value("image_size", int), patch_size=value("patch_size", int),
                              layer_norm_eps=float(value("attention.layer_norm_epsilon", (int, float), 1e-6)))
        vision.check(str(projector.path))
        if value("projection_dim", int) != text_hidden:
            raise LocalserveError(f"{projector.path}: the projector makes {value('projection_dim', int)}-wide tokens "
                                  f"for a text model {text_hidden} wide: it belongs to another model")
        # llama.cpp's default pooling: 4 x 4 patches per image token (every Gemma 3 size).
        pooled_side = vision.patches_per_side // value("projector.scale_factor", int, 4)
        ids = {}
        for key, text in (("boi", "<start_of_image>"), ("eoi", "<end_of_image>"), ("image", "<image_soft_token>")):
            try:
                ids[key] = tokens.index(text)
            except ValueError:
                raise LocalserveError(f"the model's vocabulary lacks Gemma 3's image token {text}") from None
        try:
            made = cls(vision=vision, tokens_per_image=pooled_side * pooled_side, image_token_id=ids["image"],
                       boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], mean=_triple(value("image_mean", list)),
                       std=_triple(value("image_std", list)), rescale_factor=1 / 255)
        except (TypeError, ValueError) as exc:
            raise LocalserveError(f"{projector.path}: clip.vision.image_mean / image_std: {exc}") from None
        return made.checked(str(projector.path))

    def layout(self) -> ImageLayout:
        """``"\n\n<start_of_image>"``, the image tokens, ``"<end_of_image>\n\n"``."""
        return ImageLayout(marker_id=self.boi_token_id, image_token_id=self.image_token_id, keep_marker=True,
                           end_id=self.eoi_token_id, around="\n\n")

    def tokens_for(self, image: ImageInput) -> int:
        return self.tokens_per_image  # every image is resized to the tower's square

    def patches_for(self, image: ImageInput) -> int:
        return self.max_patches

    @property
    def max_patches(self) -> int:
        return self.vision.patches_per_side ** 2

    @property
    def floats_per_patch(self) -> int:
        """Activation values live per patch at a tower layer's peak (vision/footprint.py):
        the residual stream, its norm, q, k, v and the attention's output; the MLP's
        intermediate and its GELU."""
        return 6 * self.vision.hidden_size + 2 * self.vision.intermediate_size

    def checked(self, where: str) -> Gemma3ImageConfig:
        side = math.isqrt(self.tokens_per_image)
        if side < 1 or side * side != self.tokens_per_image or self.vision.patches_per_side % side:
            raise LocalserveError(f"{where}: {self.tokens_per_image} tokens per image is not a square that divides the "
                                  f"tower's {self.vision.patches_per_side} x {self.vision.patches_per_side} patches")
        if min(self.std) <= 0:
            raise LocalserveError(f"{where}: the image std must be positive")
        return self


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError("a mean or std needs one value per colour channel")
    return values[0], values[1], values[2]


def read_image_config(checkpoint: Checkpoint) -> ImageConfig | None:
    """The image side of an image-text checkpoint (its config.json and, when present,
    preprocessor_config.json; or a GGUF model's projector file), or None for a text-only one."""
    if checkpoint.mmproj is not None:
        from ..formats.mmproj import projector_type
        from .qwen_config import Qwen3VisionConfig, QwenVisionConfig

        assert checkpoint.gguf is not None  # only a GGUF model has a projector file
        tokens = checkpoint.gguf.metadata.get("tokenizer.ggml.tokens")
        family: type[ImageConfig] = {"gemma3": Gemma3ImageConfig, "qwen2.5vl_merger": QwenVisionConfig,
                                     "qwen3vl_merger": Qwen3VisionConfig}[projector_type(checkpoint.mmproj)]
        return family.from_mmproj(checkpoint.mmproj, tokens if isinstance(tokens, list) else [],
                                  checkpoint.spec.hidden_size)
    if not checkpoint.image_text:
        return None
    from ..formats import hf
    from ..json_files import read_json_object

    preprocessor_path = checkpoint.path / "preprocessor_config.json"
    preprocessor = read_json_object(preprocessor_path) if preprocessor_path.is_file() else None
    config = hf.read_config(checkpoint.path)
    if config.get("model_type") == "qwen2_5_vl":
        from .qwen_config import QwenVisionConfig

        return QwenVisionConfig.from_hf(config, preprocessor)
    if config.get("model_type") == "qwen3_vl":
        from .qwen_config import Qwen3VisionConfig

        return Qwen3VisionConfig.from_hf(config, preprocessor)
    return Gemma3ImageConfig.from_hf(config, preprocessor)


if TYPE_CHECKING:
    ImageConfig = Gemma3ImageConfig | QwenVisionConfig | Qwen3VisionConfig  # what read_image_config gives
