"""Images in: decoding what clients send (image_input.py), each family's processor and
encoder (gemma3.py on siglip.py; qwen_vl.py), and the engine's one way in (encoder.py).

``load_image_encoder`` gives the engine a model's ImageEncoder, or None for a model that
reads no images."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from ..kernels.quant_weight import QuantWeight

    from ..formats import Checkpoint
    from ..text.tokenizer import Tokenizer
    from .encoder import ImageEncoder


def load_image_encoder(checkpoint: Checkpoint, tokenizer: Tokenizer | None, device: torch.device,
                       dtype: torch.dtype) -> ImageEncoder | None:
    """The image encoder of an image-text checkpoint (Gemma 3's vision tower and projector,
    read from its shards or a GGUF model's projector file; Qwen2.5-VL's tower), on
    ``device`` in ``dtype``; None for a text-only one."""
    if not checkpoint.reads_images:
        return None
    from ..formats.weights import iter_vision_weights
    from .config import Gemma3ImageConfig, read_image_config
    from .encoder import ImageEncoder
    from .quantized import keep_quantized, runs_quantized

    config = read_image_config(checkpoint)
    assert config is not None  # an image-text checkpoint
    model: torch.nn.Module
    if isinstance(config, Gemma3ImageConfig):
        from .gemma3 import Gemma3Vision

        model = Gemma3Vision(config, checkpoint.spec.hidden_size)
    else:
        from .qwen3_vl import Qwen3VisionTransformer
        from .qwen_config import Qwen3VisionConfig
        from .qwen_vl import QwenVisionTransformer

        if config.out_hidden_size != checkpoint.spec.hidden_size:
            from ..errors import LocalserveError

            raise LocalserveError(f"config.json: the vision tower makes {config.out_hidden_size}-wide tokens for a "
                                  f"text model {checkpoint.spec.hidden_size} wide")
        model = Qwen3VisionTransformer(config) if isinstance(config, Qwen3VisionConfig) else \
            QwenVisionTransformer(config)
    quantized = _load(model, iter_vision_weights(checkpoint),
                      str(checkpoint.mmproj.path if checkpoint.mmproj else checkpoint.path), runs_quantized(device))
    model = model.to(device=device, dtype=dtype).eval()
    keep_quantized(model, quantized, device)
    return ImageEncoder(model, tokenizer, checkpoint.spec.vocab_size, device)  # type: ignore[arg-type]


def _load(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]],
          where: str, keep: bool) -> dict[str, QuantWeight]:
    """The weights loaded into the model's float parameters, but for the quantized
    matrices of its linear layers with ``keep``: those are returned, for ``keep_quantized``."""
    from ..errors import LocalserveError
    from ..kernels.quant_weight import QuantWeight, dequantize
    from .quantized import linear_weight_names

    state = dict(weights)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LocalserveError(f"{where}: the vision tensors do not match the config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    linears = linear_weight_names(model)
    quantized: dict[str, QuantWeight] = {}
    for name, tensor in state.items():
        if list(tensor.shape) != list(expected[name].shape):
            raise LocalserveError(f"{where}: vision tensor {name} is {list(tensor.shape)}, the config says "
                                  f"{list(expected[name].shape)}")
        if isinstance(tensor, QuantWeight):
            if keep and name in linears:
                quantized[name] = tensor
            else:  # widened: where the int8 kernel is no faster, or a matrix used otherwise (Gemma 3's projection)
                state[name] = dequantize(tensor).reshape(expected[name].shape)
    model.load_state_dict({name: t for name, t in state.items() if name not in quantized}, strict=False)
    return quantized
