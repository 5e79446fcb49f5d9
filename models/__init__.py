"""Model architectures as torch modules that call kernels."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from localserve.errors import LocalserveError
from localserve.formats.architectures import ARCHITECTURES
from localserve.formats.layout import IGNORED_SUFFIXES, layout
from localserve.formats.spec import ModelSpec
from localserve.kernels.quant_weight import QuantWeight

from .layers import Linear, RMSNorm
from .llama import LlamaForCausalLM


NamedWeights = Iterable[tuple[str, torch.Tensor | QuantWeight]]




def build(
    spec: ModelSpec, weights: NamedWeights, device: torch.device, dtype: torch.dtype, max_position: int,
    cpu_moe_layers: int = 0, exact_cpu_matmul: bool = False, cpu_kernels: bool = True,
) -> LlamaForCausalLM:
    """Lay out the model for ``spec`` on ``device`` and fill it from named weights
    (dense tensors, or QuantWeights that stay quantized). The experts of MoE layers
    below ``cpu_moe_layers`` stay in host memory and run on the CPU. On the CPU, GGUF's
    quantized weights are tiled for the int8 kernel unless ``exact_cpu_matmul`` keeps
    every matmul in fp32 or the engine keeps the torch references (``cpu_kernels``)."""
    int8_cpu = cpu_kernels and not exact_cpu_matmul
    model = _empty_model(spec, device, dtype, max_position)

    def finalize(linear: Linear) -> None:
        linear.finalize(device, dtype, int8_cpu=int8_cpu)
        _return_freed_heap()

    # Each projection is finalized as soon as its last part arrives, and what its
    # checkpoint layout held is handed back, so the peak stays near one copy of the model.
    load_weights(model, weights, on_complete=finalize)
    for norm in model.modules():
        if isinstance(norm, RMSNorm):
            norm.fold_offset()
    for layer, experts in model.experts():
        experts.finalize(torch.device("cpu") if layer < cpu_moe_layers else device, dtype, int8_cpu=int8_cpu)
        _return_freed_heap()
    return model.eval()


def build_prepared(spec: ModelSpec, path: Path, device: torch.device, dtype: torch.dtype,
                   max_position: int) -> LlamaForCausalLM:
    """The model for ``spec`` with its weights mapped from a prepared layout (prepared.py)
    instead of read from the checkpoint: PreparedMismatch if the file does not fit."""
    from localserve.kernels import cpu_library

    from . import prepared

    model = _empty_model(spec, device, dtype, max_position)
    prepared.load(model, path, cpu_library.lanes())
    return model.eval()


def _empty_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, max_position: int) -> LlamaForCausalLM:
    """The model's modules on ``device`` in ``dtype``, with no weights filled in yet."""
    if spec.architecture not in ARCHITECTURES:
        raise LocalserveError(f"architecture {spec.architecture!r} is not supported")
    with torch.device(device):
        model = LlamaForCausalLM(spec, max_position, device)
    model.cast(dtype)
    return model


def _return_freed_heap() -> None:
    """glibc keeps the freed checkpoint-layout copies in its heap, resident; give them
    back to the system (elsewhere there is no malloc_trim, and nothing to do)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def load_weights(model: LlamaForCausalLM, weights: NamedWeights,
                 on_complete: Callable[[Linear], None] | None = None) -> None:
    """Fill the model's slots from named weights, each checked against the layout of the
    model's spec (formats/layout.py: the same statement ``pull`` checks files against);
    ``on_complete`` gets each projection once all its parts are in."""
    expected = layout(model.spec)
    slots = model.checkpoint_slots()
    filled: set[str] = set()
    for name, value in weights:
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.spec.tie_word_embeddings):
            continue
        shape = expected.shapes.get(name)
        if shape is None:
            raise LocalserveError(f"checkpoint tensor {name!r} does not belong to a {model.spec.architecture} model")
        if name in filled:
            raise LocalserveError(f"checkpoint tensor {name!r} appears twice")
        if tuple(value.shape) != shape:
            raise LocalserveError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
        slot = slots[name]
        if isinstance(slot, torch.Tensor):
            if isinstance(value, QuantWeight):
                raise LocalserveError(f"checkpoint tensor {name!r} is quantized; a norm weight cannot be")
            slot.data.copy_(value)
        else:
            linear, part, is_bias = slot
            if is_bias:
                if isinstance(value, QuantWeight):
                    raise LocalserveError(f"checkpoint tensor {name!r} is quantized; a bias cannot be")
                linear.bias_parts[part] = value  # type: ignore[index]
            else:
                linear.parts[part] = value  # type: ignore[index]
            if on_complete is not None and isinstance(linear, Linear) and linear.complete:
                on_complete(linear)
        filled.add(name)
    missing = expected.missing(filled)
    if missing:
        shown = ", ".join(missing[:5])
        raise LocalserveError(f"checkpoint is missing {len(missing)} tensors, e.g. {shown}")
