"""What a Qwen image-text checkpoint says about its image side, read from config.json and
preprocessor_config.json without torch: the vision tower's sizes (transformers'
Qwen2_5_VLVisionConfig keys), the image processor's settings (Qwen2VLImageProcessor's
keys, shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL) and the image tokens. Qwen3-VL's
tower (Qwen3VLVisionConfig) is read by Qwen3VisionConfig. Both read llama.cpp's projector
files too (``from_mmproj``: a GGUF model's image side).

Each bad or missing value is a LocalserveError whose one line names the file and key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LocalserveError
from .placement import ImageLayout

if TYPE_CHECKING:
    from ..formats.gguf_file import GGUFFile
    from .image_input import ImageInput

# Qwen2VLImageProcessor's defaults, for a checkpoint without preprocessor_config.json or
# one that leaves a key out (CLIP's mean and std).
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# Qwen2.5-VL's released preprocessor_config.json: up to 16,384 tokens an image.
_RELEASED_MAX_PIXELS = 12_845_056
# Qwen3-VL's: size.shortest_edge and longest_edge, 64 to 16,384 tokens an image.
_QWEN3_RELEASED_PIXELS = (65_536, 16_777_216)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL's number for bicubic resampling, as preprocessor_config.json writes it
_PIL_FILTERS = range(6)  # nearest, lanczos, bilinear, bicubic, box, hamming

# The processor refuses images more elongated than this (their grid would be one merged
# patch wide and hundreds long).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class QwenImageProcessing:
    """Qwen2VLImageProcessor's settings: each image is resized so both sides are multiples
    of ``patch_size * merge_size`` and its area lies in ``min_pixels..max_pixels``, then
    rescaled, normalized and cut into patches."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any] | None, patch_size: int, merge_size: int,
                temporal_patch_size: int) -> QwenImageProcessing:
        """From preprocessor_config.json (None: the processor's defaults). The patch sizes
        default to the tower's and must agree with them when stated."""
        preprocessor = preprocessor or {}
        read = _Reader(preprocessor, "preprocessor_config.json: ")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if preprocessor.get(flag, True) is not True:
                raise LocalserveError(f"preprocessor_config.json: {flag} false is not supported")
        # transformers 5 writes the pixel bounds as size.shortest_edge / longest_edge; the
        # released files as min_pixels / max_pixels, which win when both are there (as
        # the processor's constructor has it).
        size = preprocessor.get("size")
        if size is not None and not isinstance(size, dict):
            raise LocalserveError(f"preprocessor_config.json: size must be an object, not {size!r}")
        bounds = _Reader(size or {}, "preprocessor_config.json: size.")
        min_pixels = (read.positive_int("min_pixels") if "min_pixels" in preprocessor
                      else bounds.positive_int("shortest_edge", _DEFAULT_MIN_PIXELS))
        max_pixels = (read.positive_int("max_pixels") if "max_pixels" in preprocessor
                      else bounds.positive_int("longest_edge", _DEFAULT_MAX_PIXELS))
        made = cls(patch_size=read.positive_int("patch_size", patch_size),
                   merge_size=read.positive_int("merge_size", merge_size),
                   temporal_patch_size=read.positive_int("temporal_patch_size", temporal_patch_size),
                   min_pixels=min_pixels, max_pixels=max_pixels,
                   mean=read.triple("image_mean", _CLIP_MEAN), std=read.triple("image_std", _CLIP_STD),
                   rescale_factor=read.positive_float("rescale_factor", 1 / 255),
                   resample=read.positive_int("resample", _BICUBIC, minimum=0))
        for key, tower in (("patch_size", patch_size), ("merge_size", merge_size),
                           ("temporal_patch_size", temporal_patch_size)):
            if getattr(made, key) != tower:
                raise LocalserveError(f"preprocessor_config.json: {key} {getattr(made, key)} does not match the "
                                      f"vision tower's {tower}")
        if made.min_pixels > made.max_pixels:
            raise LocalserveError(f"preprocessor_config.json: min_pixels {made.min_pixels:,} is over max_pixels "
                                  f"{made.max_pixels:,}")
        if made.max_pixels < made.factor ** 2:
            raise LocalserveError(f"preprocessor_config.json: max_pixels {made.max_pixels:,} is less than one merged "
                                  f"patch ({made.factor} x {made.factor} pixels)")
        if min(made.std) <= 0:
            raise LocalserveError("preprocessor_config.json: image_std must be positive")
        if made.resample not in _PIL_FILTERS:
            raise LocalserveError(f"preprocessor_config.json: resample {made.resample} is not one of PIL's filters")
        return made

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged patch, in pixels."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes an image to (its ``smart_resize``):
        each side rounded to the nearest multiple of ``factor``, then, if the area is out
        of ``min_pixels..max_pixels``, both sides scaled by one factor and rounded down
        (too large) or up (too small), which keeps the aspect ratio about the same."""
        if min(height, width) < 1:
            raise LocalserveError(f"an image of {width} x {height} pixels has no pixels")
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise LocalserveError(f"an image of {width:,} x {height:,} pixels is more elongated than "
                                  f"{MAX_ASPECT_RATIO}:1, which Qwen's processor refuses")
        factor = self.factor
        # Python's round (halves to even), as the processor uses.
        new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
        if new_height * new_width > self.max_pixels:
            shrink = math.sqrt(height * width / self.max_pixels)
            new_height = max(factor, math.floor(height / shrink / factor) * factor)
            new_width = max(factor, math.floor(width / shrink / factor) * factor)
        elif new_height * new_width < self.min_pixels:
            grow = math.sqrt(self.min_pixels / (height * width))
            new_height = math.ceil(height * grow / factor) * factor
            new_width = math.ceil(width * grow / factor) * factor
        return new_height, new_width

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (frames, rows, columns) of an image of this size: one frame."""
        new_height, new_width = self.resized_size(height, width)
        return 1, new_height // self.patch_size, new_width // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """How many image tokens (merged patches) an image of this size becomes."""
        frames, rows, columns = self.grid(height, width)
        return frames * rows * columns // self.merge_size ** 2


@dataclass(frozen=True, slots=True)
class QwenImageTokens:
    """The prompt's image tokens: the processor writes ``<|vision_start|>``, one
    ``<|image_pad|>`` per merged patch, ``<|vision_end|>``."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> QwenImageTokens:
        read = _Reader(config, "config.json: ")
        return cls(image_token_id=read.positive_int("image_token_id", minimum=0),
                   vision_start_token_id=read.positive_int("vision_start_token_id", minimum=0),
                   vision_end_token_id=read.positive_int("vision_end_token_id", minimum=0))


class _QwenImages:
    """Where a Qwen-VL family's images go and how many tokens each makes (both families'
    configs have ``processing``, ``tokens`` and ``spatial_merge_size``)."""

    processing: QwenImageProcessing
    tokens: QwenImageTokens

    @property
    def image_token_id(self) -> int:
        return self.tokens.image_token_id

    def layout(self) -> ImageLayout:
        """The template's ``<|image_pad|>`` becomes one per merged patch of the image."""
        return ImageLayout(marker_id=self.tokens.image_token_id, image_token_id=self.tokens.image_token_id,
                           keep_marker=False)

    def tokens_for(self, image: ImageInput) -> int:
        return self.processing.tokens(image.height, image.width)

    def grid(self, image: ImageInput) -> tuple[int, int, int]:
        """The image's patch grid (frames, rows, columns), as its pixels will have it."""
        return self.processing.grid(image.height, image.width)

    def patches_for(self, image: ImageInput) -> int:
        frames, rows, columns = self.grid(image)
        return frames * rows * columns

    @property
    def max_patches(self) -> int:
        """The patches of the largest image the processor makes (``max_pixels`` of them)."""
        return self.processing.max_pixels // self.processing.patch_size ** 2


@dataclass(frozen=True, slots=True)
class QwenVisionConfig(_QwenImages):
    """Qwen2.5-VL's image side (Qwen2_5_VLForConditionalGeneration): the tower, the
    processor and the image tokens."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int  # in pixels: a window is window_size // patch_size // spatial_merge_size merged patches a side
    fullatt_block_indexes: tuple[int, ...]  # the blocks that attend across the whole image, not within windows
    out_hidden_size: int  # the text model's width
    in_channels: int
    rope_theta: float
    processing: QwenImageProcessing
    tokens: QwenImageTokens

    @classmethod
    def from_hf(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> QwenVisionConfig:
        """From config.json and preprocessor_config.json (None when the checkpoint has
        none: the processor's defaults)."""
        vision, read = _vision_config(config)
        activation = vision.get("hidden_act", "silu")
        if activation != "silu":
            raise LocalserveError(f"config.json: vision_config.hidden_act {activation!r} is not supported "
                                  "(Qwen2.5-VL's tower uses 'silu')")
        depth = read.positive_int("depth")
        patch_size = read.positive_int("patch_size")
        merge_size = read.positive_int("spatial_merge_size")
        temporal_patch_size = read.positive_int("temporal_patch_size")
        made = cls(depth=depth, hidden_size=read.positive_int("hidden_size"),
                   intermediate_size=read.positive_int("intermediate_size"), num_heads=read.positive_int("num_heads"),
                   patch_size=patch_size, spatial_merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                   window_size=read.positive_int("window_size"),
                   fullatt_block_indexes=read.indexes("fullatt_block_indexes", depth),
                   out_hidden_size=read.positive_int("out_hidden_size"),
                   in_channels=read.positive_int("in_channels", read.positive_int("in_chans", 3)),
                   rope_theta=_rope_theta(vision),
                   processing=QwenImageProcessing.from_hf(preprocessor, patch_size, merge_size, temporal_patch_size),
                   tokens=QwenImageTokens.from_hf(config))
        _check_heads(made.hidden_size, made.num_heads)
        if made.window_merged_patches < 1:
            raise LocalserveError(f"config.json: vision_config.window_size {made.window_size} is smaller than one "
                                  f"merged patch ({patch_size * merge_size} pixels)")
        return made

    @classmethod
    def from_mmproj(cls, projector: GGUFFile, tokens: Sequence[str], text_hidden: int) -> QwenVisionConfig:
        """From llama.cpp's projector file (``qwen2.5vl_merger``: its ``clip.vision.*`` keys,
        written from config.json's vision_config and preprocessor_config.json's mean and std)
        and the text model's vocabulary (see ``_mmproj_images``)."""
        read = _mmproj_reader(projector)
        processing, image_tokens = _mmproj_images(read, tokens, (_DEFAULT_MIN_PIXELS, _RELEASED_MAX_PIXELS))
        depth = read.positive_int("block_count")
        # Every n_wa_pattern-th block attends across the whole image (the converter's check).
        pattern = read.positive_int("n_wa_pattern")
        made = cls(depth=depth, hidden_size=read.positive_int("embedding_length"),
                   intermediate_size=read.positive_int("feed_forward_length"),
                   num_heads=read.positive_int("attention.head_count"), patch_size=processing.patch_size,
                   spatial_merge_size=processing.merge_size, temporal_patch_size=2,
                   window_size=read.positive_int("window_size", 112),
                   fullatt_block_indexes=tuple(range(pattern - 1, depth, pattern)),
                   out_hidden_size=read.positive_int("projection_dim"), in_channels=3, rope_theta=10_000.0,
                   processing=processing, tokens=image_tokens)
        _check_projection(projector, made.out_hidden_size, text_hidden)
        _check_heads(made.hidden_size, made.num_heads)
        return made

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def floats_per_patch(self) -> int:
        """Activation values live per patch at a block's peak (vision/footprint.py): the
        residual stream, its norm, q, k, v and the attention's output; the SwiGLU's gate,
        up and their product."""
        return 6 * self.hidden_size + 3 * self.intermediate_size

    @property
    def window_merged_patches(self) -> int:
        """A window's side, in merged patches."""
        return self.window_size // self.patch_size // self.spatial_merge_size

    @property
    def patch_values(self) -> int:
        """The numbers in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True, slots=True)
class Qwen3VisionConfig(_QwenImages):
    """Qwen3-VL's image side (Qwen3VLForConditionalGeneration): a tower with learned
    positions and no windows, whose ``deepstack_visual_indexes`` blocks also feed the text
    model's first layers; the same processor and image tokens as Qwen2.5-VL."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int  # the text model's width
    in_channels: int
    hidden_act: str  # the MLPs': "gelu_pytorch_tanh" (released) or "gelu"
    num_position_embeddings: int  # a square grid of learned positions, resized to each image's grid
    deepstack_visual_indexes: tuple[int, ...]  # the blocks whose output also goes to the text model's layers
    rope_theta: float
    processing: QwenImageProcessing
    tokens: QwenImageTokens

    @classmethod
    def from_hf(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> Qwen3VisionConfig:
        """From config.json and preprocessor_config.json (None when the checkpoint has
        none: the processor's defaults)."""
        vision, read = _vision_config(config)
        activation = vision.get("hidden_act", "gelu_pytorch_tanh")
        if activation not in _QWEN3_ACTIVATIONS:
            raise LocalserveError(f"config.json: vision_config.hidden_act {activation!r} is not supported "
                                  f"(one of {', '.join(_QWEN3_ACTIVATIONS)})")
        depth = read.positive_int("depth")
        patch_size = read.positive_int("patch_size")
        merge_size = read.positive_int("spatial_merge_size")
        temporal_patch_size = read.positive_int("temporal_patch_size")
        made = cls(depth=depth, hidden_size=read.positive_int("hidden_size"),
                   intermediate_size=read.positive_int("intermediate_size"), num_heads=read.positive_int("num_heads"),
                   patch_size=patch_size, spatial_merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                   out_hidden_size=read.positive_int("out_hidden_size"),
                   in_channels=read.positive_int("in_channels", read.positive_int("in_chans", 3)),
                   hidden_act=activation, num_position_embeddings=read.positive_int("num_position_embeddings"),
                   deepstack_visual_indexes=read.indexes("deepstack_visual_indexes", depth),
                   rope_theta=_rope_theta(vision),
                   processing=QwenImageProcessing.from_hf(preprocessor, patch_size, merge_size, temporal_patch_size),
                   tokens=QwenImageTokens.from_hf(config))
        _check_heads(made.hidden_size, made.num_heads)
        _check_square(made.num_position_embeddings, "config.json: vision_config.num_position_embeddings")
        return made

    @classmethod
    def from_mmproj(cls, projector: GGUFFile, tokens: Sequence[str], text_hidden: int) -> Qwen3VisionConfig:
        """From llama.cpp's projector file (``qwen3vl_merger``: its ``clip.vision.*`` keys) and
        the text model's vocabulary (see ``_mmproj_images``). The position table's size and
        the deepstack blocks are read off the tensors, as llama.cpp reads them. The converter
        writes no activation (llama.cpp runs its GELU: the released files' gelu_pytorch_tanh)
        nor the tower's LayerNorm epsilon (it writes the text model's; the tower keeps 1e-6)."""
        from ..formats.mmproj import deepstack_blocks

        read = _mmproj_reader(projector)
        processing, image_tokens = _mmproj_images(read, tokens, _QWEN3_RELEASED_PIXELS)
        depth = read.positive_int("block_count")
        positions = projector.tensors.get("v.position_embd.weight")
        if positions is None or len(positions.shape) != 2 or not positions.shape[0]:
            raise LocalserveError(f"{projector.path}: tensor v.position_embd.weight is missing or not a table")
        deepstack = deepstack_blocks(projector)
        if deepstack and deepstack[-1] >= depth:
            raise LocalserveError(f"{projector.path}: a deepstack merger for block {deepstack[-1]} of a tower of "
                                  f"{depth} blocks")
        made = cls(depth=depth, hidden_size=read.positive_int("embedding_length"),
                   intermediate_size=read.positive_int("feed_forward_length"),
                   num_heads=read.positive_int("attention.head_count"), patch_size=processing.patch_size,
                   spatial_merge_size=processing.merge_size, temporal_patch_size=2,
                   out_hidden_size=read.positive_int("projection_dim"), in_channels=3,
                   hidden_act="gelu_pytorch_tanh", num_position_embeddings=positions.shape[0],
                   deepstack_visual_indexes=deepstack, rope_theta=10_000.0, processing=processing,
                   tokens=image_tokens)
        _check_projection(projector, made.out_hidden_size, text_hidden)
        _check_heads(made.hidden_size, made.num_heads)
        _check_square(made.num_position_embeddings, f"{projector.path}: tensor v.position_embd.weight's row count")
        return made

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def floats_per_patch(self) -> int:
        """As Qwen2.5-VL's, with a GELU MLP: its intermediate and its activation."""
        return 6 * self.hidden_size + 2 * self.intermediate_size

    @property
    def positions_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_values(self) -> int:
        """The numbers in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


_QWEN3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _vision_config(config: dict[str, Any]) -> tuple[dict[str, Any], _Reader]:
    """config.json's vision_config, and a reader whose errors name it."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise LocalserveError("config.json: vision_config is missing or not an object")
    return vision, _Reader(vision, "config.json: vision_config.")


def _rope_theta(vision: dict[str, Any]) -> float:
    """The tower's rotary base: transformers 5 writes rope_parameters.rope_theta; the
    released files state none (10000)."""
    parameters = vision.get("rope_parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise LocalserveError("config.json: vision_config.rope_parameters must be an object")
    rope_type = parameters.get("rope_type", "axial")
    if rope_type != "axial":
        raise LocalserveError(f"config.json: vision_config.rope_parameters.rope_type {rope_type!r} is not supported")
    if "rope_theta" in parameters:
        return _Reader(parameters, "config.json: vision_config.rope_parameters.").positive_float("rope_theta")
    return _Reader(vision, "config.json: vision_config.").positive_float("rope_theta", 10_000.0)


def _mmproj_reader(projector: GGUFFile) -> _Reader:
    """A reader of llama.cpp's projector file's ``clip.vision.*`` keys."""
    prefix = "clip.vision."
    return _Reader({key[len(prefix):]: value for key, value in projector.metadata.items() if key.startswith(prefix)},
                   f"{projector.path}: {prefix}")


def _mmproj_images(read: _Reader, tokens: Sequence[str], pixels: tuple[int, int],
                   ) -> tuple[QwenImageProcessing, QwenImageTokens]:
    """A projector file's processor settings and image tokens: its patch size, merge size,
    mean and std, two frames a patch (the converter's requirement), the pixel bounds of the
    family's released files (``pixels``: the projector does not carry them), and the image
    tokens found by their text in the text model's vocabulary ``tokens``."""
    processing = QwenImageProcessing(patch_size=read.positive_int("patch_size"),
                                     merge_size=read.positive_int("spatial_merge_size", 2), temporal_patch_size=2,
                                     min_pixels=pixels[0], max_pixels=pixels[1],
                                     mean=read.triple("image_mean", _CLIP_MEAN), std=read.triple("image_std", _CLIP_STD))
    ids = {}
    for key, text in (("image", "<|image_pad|>"), ("start", "<|vision_start|>"), ("end", "<|vision_end|>")):
        try:
            ids[key] = tokens.index(text)
        except ValueError:
            raise LocalserveError(f"the model's vocabulary lacks Qwen-VL's image token {text}") from None
    return processing, QwenImageTokens(ids["image"], ids["start"], ids["end"])


def _check_projection(projector: GGUFFile, out_hidden_size: int, text_hidden: int) -> None:
    if out_hidden_size != text_hidden:
        raise LocalserveError(f"{projector.path}: the projector makes {out_hidden_size}-wide tokens for a "
                              f"text model {text_hidden} wide: it belongs to another model")


def _check_square(count: int, what: str) -> None:
    # The learned positions are a square grid, resized to each image's.
    if math.isqrt(count) ** 2 != count:
        raise LocalserveError(f"{what} {count} is not a square grid")


def _check_heads(hidden_size: int, num_heads: int) -> None:
    # The 2D rotary gives a quarter of each head's dimensions to rows' frequencies and a
    # quarter to columns' (each used twice, for the two halves rotated together).
    if hidden_size % num_heads or (hidden_size // num_heads) % 4:
        raise LocalserveError(f"config.json: vision_config.hidden_size {hidden_size} does not split into "
                              f"{num_heads} heads of a multiple of 4 dimensions")


class _Reader:
    """Typed reads from one JSON object; each failure names ``where`` + the key."""

    def __init__(self, values: dict[str, Any], where: str) -> None:
        self.values = values
        self.where = where

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key, default)
        if value is None:
            raise LocalserveError(f"{self.where}{key} is missing")
        return value

    def positive_int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self._get(key, default)
        # JSON has no int/float distinction that matters here, but a bool or a fraction is a mistake.
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            wanted = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            raise LocalserveError(f"{self.where}{key} must be {wanted}, not {value!r}")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise LocalserveError(f"{self.where}{key} must be a positive number, not {value!r}")
        return float(value)

    def triple(self, key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
        value = self._get(key, default)
        values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        if (not isinstance(values, (list, tuple)) or len(values) != 3
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values)):
            raise LocalserveError(f"{self.where}{key} must be three numbers (one per colour channel), not {value!r}")
        return float(values[0]), float(values[1]), float(values[2])

    def indexes(self, key: str, count: int) -> tuple[int, ...]:
        """Distinct layer indexes below ``count``."""
        value = self._get(key, None)
        if (not isinstance(value, (list, tuple))
                or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < count for v in value)
                or len(set(value)) != len(value)):
            raise LocalserveError(f"{self.where}{key} must be a list of distinct block indexes below {count}, "
                                  f"not {value!r}")
        return tuple(value)
