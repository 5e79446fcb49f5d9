"""The text model of an image-text HF checkpoint (Gemma 3 4B, 12B, 27B: ``model_type``
``gemma3``; Qwen2.5-VL: ``qwen2_5_vl``), read as the text-only checkpoint it contains, and
the names of its vision tower's and projector's tensors, which the image side
(localserve/vision/) reads.

Gemma 3 nests the language model's settings under ``text_config`` and its tensors under a
prefix: ``language_model.model.`` (the released files, written by transformers 4.5x) or
``model.language_model.`` (transformers 5). transformers saves a nested config as its
difference from the text config class's defaults, so the released ``text_config`` omits
every default (Gemma 3 4B's names no head count, vocabulary or rotary base): those
defaults, the ones the files were written against, are restated here. Qwen2.5-VL's
released files keep the text model's settings at the top of config.json and its tensors
under ``model.`` (transformers 5 nests them as Gemma 3's), the tower under ``visual.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LocalserveError
from .hf import TensorHeader


@dataclass(frozen=True, slots=True)
class ImageTextModel:
    text_model_type: str  # the text model's model_type, as localserve's architectures know it
    text_defaults: dict[str, Any] = field(default_factory=dict)  # the text config class's defaults
    nested_types: tuple[str, ...] = ()  # what a nested text_config may call itself besides
    flat: bool = False  # without text_config, the outer config describes the text model


# transformers 4.50's Gemma3TextConfig defaults, as far as the readers consult them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "attention_bias": False,
}

IMAGE_TEXT_MODELS = {
    "gemma3": ImageTextModel("gemma3_text", _GEMMA3_TEXT_DEFAULTS),
    # Qwen2.5-VL's text model is Qwen2's, its rotary turned by three positions (M-RoPE).
    "qwen2_5_vl": ImageTextModel("qwen2", nested_types=("qwen2_5_vl_text",), flat=True),
    # Qwen3-VL's is Qwen3's, its M-RoPE interleaved.
    "qwen3_vl": ImageTextModel("qwen3", nested_types=("qwen3_vl_text",)),
}

# Where the language model's tensors live -> the text-only checkpoint's names.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("lm_head.", "lm_head."),
                  ("model.", "model."))  # Qwen2.5-VL's released files

# Keys of the outer config that describe the text model too.
_SHARED_KEYS = ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings")


def text_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The text model's full config when ``config`` is an image-text model's, else None."""
    wrapper = IMAGE_TEXT_MODELS.get(config.get("model_type"))  # type: ignore[arg-type]
    if wrapper is None:
        return None
    nested = config.get("text_config")
    if nested is None and wrapper.flat:
        nested = {key: value for key, value in config.items() if key not in ("vision_config", "model_type")}
    nested = nested or {}
    if not isinstance(nested, dict):
        raise LocalserveError("config.json: text_config must be an object")
    # The outer config's end tokens and dtype are the model's as a whole (the nested ones
    # may be the text config's defaults).
    outer = {key: config[key] for key in _SHARED_KEYS if config.get(key) is not None}
    text = {**wrapper.text_defaults, **nested, **outer}
    text["model_type"] = nested.get("model_type") or wrapper.text_model_type
    if text["model_type"] in wrapper.nested_types:
        text["model_type"] = wrapper.text_model_type
    if text["model_type"] != wrapper.text_model_type:
        raise LocalserveError(f"config.json: a {config['model_type']} model's text_config must be "
                              f"{wrapper.text_model_type}, not {text['model_type']!r}")
    return text


def text_name(name: str) -> str | None:
    """The text-only checkpoint's name for a tensor, or None for the vision side's."""
    if any(name.startswith(prefix) for prefix, _ in _VISION_PREFIXES):
        return None
    for prefix, canonical in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return canonical + name[len(prefix):]
    return None


# Where the image side's tensors live -> the names below localserve's vision model: Gemma
# 3's tower (released files: ``vision_tower.vision_model.``; transformers 5:
# ``vision_tower.``) and projector (vision/gemma3.py); Qwen2.5-VL's tower, projector
# included (vision/qwen_vl.py: its own names).
_VISION_PREFIXES = (("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.", "tower."),
                    ("model.vision_tower.", "tower."), ("vision_tower.", "tower."),
                    ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."),
                    ("model.visual.", ""), ("visual.", ""))


def vision_name(name: str) -> str | None:
    """The vision model's name for an image-text checkpoint's tensor, or None for the text
    side's and for SigLIP's pooling head (saved when the config leaves ``vision_use_head``
    at SigLIP's default; Gemma 3 takes the patches, not the pooled vector)."""
    for prefix, canonical in _VISION_PREFIXES:
        if name.startswith(prefix):
            renamed = canonical + name[len(prefix):]
            return None if renamed.startswith("tower.head.") else renamed
    return None


def vision_headers(headers: Iterable[TensorHeader]) -> list[TensorHeader]:
    return [(renamed, shape, dtype) for name, shape, dtype in headers if (renamed := vision_name(name)) is not None]


def text_headers(headers: Iterable[TensorHeader]) -> list[TensorHeader]:
    return [(renamed, shape, dtype) for name, shape, dtype in headers if (renamed := text_name(name)) is not None]
