"""Model architectures as torch modules that call kernels."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from localserve.errors import LocalserveError
from localserve.formats.spec import ModelSpec

from .llama import LlamaForCausalLM

# Names some checkpoints carry that hold nothing we need (derived at load time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build(
    spec: ModelSpec,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
) -> LlamaForCausalLM:
    """Lay out the model for ``spec`` on ``device`` and fill it from named weights."""
    if spec.architecture not in ("llama", "qwen2", "qwen3"):
        raise LocalserveError(f"architecture {spec.architecture!r} is not supported")
    with torch.device(device):
        model = LlamaForCausalLM(spec, max_position, device)
    # Parameters only: the rotary cos/sin tables stay fp32 like the references keep them.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    load_weights(model, weights)
    return model.eval()


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    slots = model.checkpoint_slots()
    filled: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.spec.tie_word_embeddings):
            continue
        slot = slots.get(name)
        if slot is None:
            raise LocalserveError(f"checkpoint tensor {name!r} does not belong to a {model.spec.architecture} model")
        target, start, rows = slot
        expected = (rows, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise LocalserveError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        target.data[start : start + rows].copy_(tensor)
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(missing[:5])
        raise LocalserveError(f"checkpoint is missing {len(missing)} tensors, e.g. {shown}")
