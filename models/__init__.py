"""Model architectures as torch modules that call kernels."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from localserve.errors import LocalserveError
from localserve.formats.spec import ModelSpec
from localserve.kernels.quant_linear import QuantWeight

from .llama import LlamaForCausalLM

# Names some checkpoints carry that hold nothing we need (derived at load time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

NamedWeights = Iterable[tuple[str, torch.Tensor | QuantWeight]]


def build(
    spec: ModelSpec, weights: NamedWeights, device: torch.device, dtype: torch.dtype, max_position: int
) -> LlamaForCausalLM:
    """Lay out the model for ``spec`` on ``device`` and fill it from named weights
    (dense tensors, or QuantWeights that stay quantized)."""
    if spec.num_experts:
        raise LocalserveError(f"mixture-of-experts models ({spec.architecture}) cannot run yet; "
                              "`localserve fit` can plan their memory")
    if spec.architecture not in ("llama", "qwen2", "qwen3"):
        raise LocalserveError(f"architecture {spec.architecture!r} is not supported")
    with torch.device(device):
        model = LlamaForCausalLM(spec, max_position, device)
    # Parameters only: the rotary cos/sin tables stay fp32 like the references keep them.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.dtype = dtype
    load_weights(model, weights)
    for linear in model.linears():
        linear.finalize(device, dtype)
    return model.eval()


def load_weights(model: LlamaForCausalLM, weights: NamedWeights) -> None:
    slots = model.checkpoint_slots()
    filled: set[str] = set()
    for name, value in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.spec.tie_word_embeddings):
            continue
        slot = slots.get(name)
        if slot is None:
            raise LocalserveError(f"checkpoint tensor {name!r} does not belong to a {model.spec.architecture} model")
        if isinstance(slot, torch.Tensor):
            expected = tuple(slot.shape)
        else:
            linear, part, is_bias = slot
            expected = linear.expected_shape(part, is_bias)
        if tuple(value.shape) != expected or (isinstance(value, QuantWeight) and (isinstance(slot, torch.Tensor) or is_bias)):
            raise LocalserveError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {expected}")
        if isinstance(slot, torch.Tensor):
            slot.data.copy_(value)
        elif is_bias:
            linear.bias_parts[part] = value  # type: ignore[index]
        else:
            linear.parts[part] = value
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(missing[:5])
        raise LocalserveError(f"checkpoint is missing {len(missing)} tensors, e.g. {shown}")
