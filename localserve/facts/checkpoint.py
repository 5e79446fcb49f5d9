"""What a checkpoint is (``localserve show``), from its metadata alone: architecture,
parameters (total, and active per token for MoE models), context, quantization, size."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import LocalserveError
from ..formats import Checkpoint, open_checkpoint
from ..formats.gguf_file import GGML_TYPES
from ..formats.gpt_oss import MXFP4
from ..formats.spec import ModelSpec
from ..units import human_bytes, human_count


def quantization(checkpoint: Checkpoint) -> str:
    """GGUF: its tensor types by share of the file; GPTQ/AWQ: bits and group size;
    otherwise the stored dtype."""
    if checkpoint.gguf is not None:
        by_type: Counter[str] = Counter()
        for info in checkpoint.gguf.tensors.values():
            by_type[GGML_TYPES.get(info.ggml_type, (f"type {info.ggml_type}",))[0]] += info.nbytes or 0
        total = sum(by_type.values()) or 1
        return ", ".join(f"{name} {size / total:.0%}" if size >= total / 100 else f"{name} <1%"
                         for name, size in by_type.most_common(4))
    if checkpoint.quant is not None:
        quant = checkpoint.quant
        group = "per-channel" if quant.group_size == -1 else f"group {quant.group_size}"
        return f"{quant.method.upper()} {quant.bits}-bit, {group}"
    stored = checkpoint.spec.torch_dtype or "unknown dtype"
    if any(dtype == MXFP4 for _, _, dtype in checkpoint.headers):
        return f"experts MXFP4, the rest {stored}"  # GPT-OSS as released
    return stored


def checkpoint_format(checkpoint: Checkpoint) -> str:
    """gguf, gptq, awq, or safetensors (plain Hugging Face weights)."""
    if checkpoint.gguf is not None:
        return "gguf"
    return checkpoint.quant.method if checkpoint.quant else "safetensors"


def gguf_license(checkpoint: Checkpoint) -> str | None:
    """A GGUF's ``general.license`` (HF checkpoints declare theirs in the Hub's card)."""
    found = checkpoint.gguf.metadata.get("general.license") if checkpoint.gguf is not None else None
    return found if isinstance(found, str) else None


def model_info(path: str | Path | Checkpoint) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """The facts as a dict (``--json``) and as (label, text) lines for people; the size
    is the weight files' on disk (every shard of a split GGUF). ``path`` may be a
    checkpoint already opened, so callers that need more of it read it once."""
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    spec = checkpoint.spec
    counts = spec.parameter_counts()
    files = checkpoint.gguf.paths if checkpoint.gguf is not None else checkpoint.files or [checkpoint.path]
    if checkpoint.mmproj is not None:
        files = [*files, checkpoint.mmproj.path]
    file_bytes = sum(f.stat().st_size for f in files)
    info: dict[str, object] = {
        "path": str(checkpoint.path),
        "format": checkpoint_format(checkpoint),
        "architecture": spec.architecture,
        "quantization": quantization(checkpoint),
        "parameters": counts.total,
        "active_parameters": counts.active,
        "experts": spec.num_experts,
        "experts_per_token": spec.num_experts_per_tok,
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "context_length": spec.max_position_embeddings,
        "sliding_window": spec.sliding_window,
        "sliding_window_layers": sum(spec.window_of(i) is not None for i in range(spec.num_layers)),
        "vocab_size": spec.vocab_size,
        "file_bytes": file_bytes,
        "license": gguf_license(checkpoint),
        "image_text": checkpoint.reads_images,
        "pooling": spec.pooling,
    }
    lines = [
        ("model", str(checkpoint.path)),
        ("architecture", f"{spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
                         f"{spec.num_heads} heads ({spec.num_kv_heads} KV) of {spec.head_dim}"),
        ("parameters", describe_parameters(spec)),
        ("context", f"{spec.max_position_embeddings:,} tokens{_windows(spec)}"),
        ("vocabulary", f"{spec.vocab_size:,} tokens"),
        ("weights", f"{info['quantization']}; {human_bytes(file_bytes)}"),
    ]
    if spec.pooling:
        pooled = {"last": "the last token's", "cls": "the first token's", "mean": "the mean of the tokens'"}
        lines.insert(2, ("embeddings", f"{spec.hidden_size:,} values, {pooled[spec.pooling]} hidden state: an "
                                       "embedding model (it answers /v1/embeddings and /api/embed, not chat)"))
    if checkpoint.reads_images:
        lines.insert(2, ("images", _images(checkpoint)))
    return info, lines


def check_images(checkpoint: Checkpoint) -> None:
    """A model that reads images has image settings that make sense (and a GGUF model's
    projector is made for it): what a registration checks beyond ``check_loadable``."""
    from ..vision.config import read_image_config

    read_image_config(checkpoint)


def _images(checkpoint: Checkpoint) -> str:
    from ..vision.config import Gemma3ImageConfig, read_image_config

    try:
        config = read_image_config(checkpoint)
    except LocalserveError as exc:
        return f"not readable: {exc}"
    assert config is not None  # an image-text checkpoint
    read = "read (OpenAI image_url, Ollama images, Anthropic image blocks): "
    if not isinstance(config, Gemma3ImageConfig):  # Qwen2.5-VL, Qwen3-VL
        processing = config.processing
        family = "Qwen2.5-VL" if hasattr(config, "window_size") else "Qwen3-VL"
        return (f"{read}a {config.depth}-layer {family} tower at the image's own size ({processing.min_pixels:,} "
                f"to {processing.max_pixels:,} pixels), a token per {processing.factor} x {processing.factor} pixels")
    tower = config.vision
    return (f"{read}a {tower.num_layers}-layer SigLIP "
            f"tower at {tower.image_size} px, {config.tokens_per_image} tokens per image"
            + (f", from {checkpoint.mmproj.path.name}" if checkpoint.mmproj else ""))


def _windows(spec: ModelSpec) -> str:
    """``; a sliding window of W on L of N layers``, or nothing for full attention."""
    sliding = sum(spec.window_of(i) is not None for i in range(spec.num_layers))
    if not sliding:
        return ""
    return f"; a sliding window of {spec.sliding_window:,} on {sliding} of {spec.num_layers} layers"


def describe_parameters(spec: ModelSpec) -> str:
    counts = spec.parameter_counts()
    if not spec.num_experts:
        return human_count(counts.total)
    return (f"{human_count(counts.total)} ({spec.num_experts} experts, {spec.num_experts_per_tok} per token: "
            f"{human_count(counts.active)} active)")
