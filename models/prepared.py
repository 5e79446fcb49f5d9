"""A loaded model's weights, kept on disk in the layout the CPU kernels read, and mapped
back at the next load instead of converted again.

Loading a GGUF file for the CPU converts every quantized tensor twice (GGUF blocks to
QuantWeights, then tiled for the int8 kernel): seconds for a 1B model, most of a minute for
an 8B one, where llama.cpp maps the file and starts. So after the first load the result is
written once as a safetensors file (``save``), and later loads map it (``load``): the
weights are pages of that file, shared with the page cache, read as the first step touches
them. A stored file is checked as a hostile one would be: safetensors checks its offsets,
and every tensor's dtype and shape is checked against the model it must fill.

Models whose weights are all dense or tiled are stored, mixtures of experts included when
their experts are tiled stacks (with GPT-OSS's biases, if any); the fp32-activation path's
QuantWeights are not (``storable``), and load as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from localserve.kernels.experts import ExpertMLP, ExpertWeights
from localserve.kernels.quant_linear_cpu import TiledWeight

from .layers import Linear, RMSNorm
from .llama import LlamaForCausalLM
from .moe import Experts

FORMAT = "localserve-prepared/1"


class PreparedMismatch(ValueError):
    """A stored file that does not fill this model (another version, a damaged file)."""


EXPERT_BIASES = ("gate_up_bias", "down_bias")


def storable(model: LlamaForCausalLM) -> bool:
    return all(isinstance(w, (torch.Tensor, TiledWeight)) for linear in model.linears() for w in linear.weights) and all(
        experts.mlp is not None and experts.mlp.tiled for experts in _experts(model).values())


def _experts(model: LlamaForCausalLM) -> dict[str, Experts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Experts)}


def _expert_stacks(mlp: ExpertMLP) -> dict[str, ExpertWeights]:
    return {"gate_up": mlp.gate_up[0], "down": mlp.down}


def _linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    # The tied LM head is the embedding module: stored once, under its first name.
    found: dict[str, Linear] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and id(module) not in seen:
            seen.add(id(module))
            found[name] = module
    return found


def save(model: LlamaForCausalLM, path: Path, source: str) -> None:
    """Write the model's weights to ``path`` (through a partial file, renamed when
    complete); ``source`` names what they were converted from."""
    if not storable(model):
        raise ValueError("this model holds weights the prepared layout does not store")
    tensors, linears, experts = _stored(model)
    metadata = {"format": FORMAT, "source": source, "linears": json.dumps(linears), "experts": json.dumps(experts)}
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two processes never share one
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata)
    partial.replace(path)


def mapped_tensors(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Every tensor a mapped model reads from its stored file: what ``save`` writes."""
    return list(_stored(model)[0].values())


def _stored(model: LlamaForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, list[dict]], dict[str, dict]]:
    """What the layout holds: every tensor by its stored name, and the linears' and the
    experts' tables (how each weight is stored)."""
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, list[dict]] = {}
    for name, linear in _linears(model).items():
        parts = []
        for i, weight in enumerate(linear.weights):
            if isinstance(weight, TiledWeight):
                parts.append({"tiled": _put_tiled(tensors, f"{name}.{i}.", weight)})
            else:
                parts.append({"dense": True})
                tensors[f"{name}.{i}"] = weight
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias
        linears[name] = parts
    experts: dict[str, dict] = {}
    for name, module in _experts(model).items():
        assert module.mlp is not None
        entry = {}
        for projection, stack in _expert_stacks(module.mlp).items():
            entry[projection] = _put_tiled(tensors, f"{name}.{projection}.", stack.weight)  # type: ignore[arg-type]
        for bias in EXPERT_BIASES:
            if getattr(module.mlp, bias) is not None:
                tensors[f"{name}.{bias}"] = getattr(module.mlp, bias)
        experts[name] = entry
    for name, tensor in _plain_tensors(model).items():
        tensors[f"plain.{name}"] = tensor.detach()
    return tensors, linears, experts


def _plain_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Parameters and stored buffers outside the linears (norm gains, GPT-OSS's sinks)."""
    linear_ids = {id(m) for m in _linears(model).values()}
    found = {}
    for module_name, module in model.named_modules():
        if id(module) in linear_ids:
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in module.named_parameters(recurse=False):
            found[prefix + name] = parameter  # the Parameter itself: load sets its .data
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                found[prefix + name] = buffer
    return found


def load(model: LlamaForCausalLM, path: Path, lanes: int) -> None:
    """Fill a freshly built model (no weights loaded, cast to its dtype) from ``path``,
    every tensor checked against the model: PreparedMismatch if anything differs."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise PreparedMismatch(f"{path.name}: not a {FORMAT} file")
            try:
                linears = json.loads(metadata["linears"])
            except (KeyError, ValueError) as exc:
                raise PreparedMismatch(f"{path.name}: no linear table ({exc})") from None
            try:
                experts = json.loads(metadata.get("experts", "{}"))
            except ValueError as exc:
                raise PreparedMismatch(f"{path.name}: a damaged expert table ({exc})") from None
            names = set(handle.keys())
            _fill_linears(model, handle, names, linears, lanes)
            _fill_experts(model, handle, names, experts, lanes)
            _fill_plain(model, handle, names)
    except SafetensorError as exc:
        raise PreparedMismatch(f"{path.name}: not a valid safetensors file ({exc})") from None
    for norm in model.modules():
        if isinstance(norm, RMSNorm):
            norm.offset = 0.0  # stored folded (RMSNorm.fold_offset)


def _take(handle, names: set[str], name: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if name not in names:
        raise PreparedMismatch(f"the stored layout has no tensor {name}")
    names.discard(name)
    return handle.get_tensor(name)


def _put_tiled(tensors: dict[str, torch.Tensor], prefix: str, weight: TiledWeight) -> dict[str, int | float]:
    """A tiled weight's tensors into ``tensors`` under ``prefix``; its numbers, for the table."""
    numbers, fields = weight.stored()
    tensors.update({prefix + field: t for field, t in fields.items()})
    return numbers


def _take_tiled(handle, names: set[str], prefix: str, numbers: dict, lanes: int) -> TiledWeight:  # type: ignore[no-untyped-def]
    """The tiled weight ``_put_tiled`` stored under ``prefix``, checked by ``TiledWeight.restore``."""
    fields = {field: _take(handle, names, prefix + field) for field in TiledWeight.TENSORS if prefix + field in names}
    try:
        return TiledWeight.restore(numbers, fields, lanes)
    except ValueError as exc:
        raise PreparedMismatch(f"{prefix.rstrip('.')}: {exc}") from None


def _fill_linears(model: LlamaForCausalLM, handle, names: set[str], stored: object,  # type: ignore[no-untyped-def]
                  lanes: int) -> None:
    linears = _linears(model)
    if not isinstance(stored, dict) or set(stored) != set(linears):
        raise PreparedMismatch("the stored layout's projections are not this model's")
    for name, linear in linears.items():
        parts = stored[name]
        if not isinstance(parts, list) or not 1 <= len(parts) <= len(linear.part_sizes):
            raise PreparedMismatch(f"{name}: stored parts do not fit")
        weights: list[torch.Tensor | TiledWeight] = []
        for i, part in enumerate(parts):
            if isinstance(part, dict) and isinstance(part.get("tiled"), dict):
                weights.append(_take_tiled(handle, names, f"{name}.{i}.", part["tiled"], lanes))
            elif isinstance(part, dict) and part.get("dense") is True:
                dense = _take(handle, names, f"{name}.{i}")
                if dense.dim() != 2 or dense.dtype != model.dtype:
                    raise PreparedMismatch(f"{name}: a stored dense weight is {dense.dtype} {list(dense.shape)}")
                weights.append(dense)
            else:
                raise PreparedMismatch(f"{name}: an unknown stored part")
        if (any(w.shape[1] != linear.in_features for w in weights)
                or sum(w.shape[0] for w in weights) != sum(linear.part_sizes)):
            raise PreparedMismatch(f"{name}: stored weights do not make [{sum(linear.part_sizes)}, "
                                   f"{linear.in_features}]")
        bias = None
        if linear.bias_parts is not None:
            bias = _take(handle, names, f"{name}.bias")
            if bias.shape != (sum(linear.part_sizes),) or bias.dtype != model.dtype:
                raise PreparedMismatch(f"{name}: the stored bias is {bias.dtype} {list(bias.shape)}")
        linear.weights, linear.bias, linear.parts, linear.bias_parts = weights, bias, [], None


def _fill_experts(model: LlamaForCausalLM, handle, names: set[str], stored: object,  # type: ignore[no-untyped-def]
                  lanes: int) -> None:
    modules = _experts(model)
    if not isinstance(stored, dict) or set(stored) != set(modules):
        raise PreparedMismatch("the stored layout's experts are not this model's")
    for name, module in modules.items():
        entry = stored[name]
        count, hidden, width = module.num_experts, module.hidden_size, module.intermediate_size
        shapes = {"gate_up": (2 * width, hidden), "down": (hidden, width)}
        stacks = {}
        for projection, (rows, columns) in shapes.items():
            numbers = entry.get(projection) if isinstance(entry, dict) else None
            if not isinstance(numbers, dict):
                raise PreparedMismatch(f"{name}: no stored {projection} experts")
            tiled = _take_tiled(handle, names, f"{name}.{projection}.", numbers, lanes)
            # Each expert must start on a tile: the kernel reads expert e's rows from tile e * rows / lanes.
            if tiled.shape != (count * rows, columns) or rows % lanes:
                raise PreparedMismatch(f"{name}.{projection}: stored as {list(tiled.shape)}, expected "
                                       f"{count} experts of [{rows}, {columns}]")
            stacks[projection] = ExpertWeights(tiled, count)
        biases: dict[str, torch.Tensor | None] = dict.fromkeys(EXPERT_BIASES)
        if module.bias_parts is not None:
            for bias, rows in zip(EXPERT_BIASES, (2 * width, hidden)):
                value = _take(handle, names, f"{name}.{bias}")
                if value.shape != (count, rows) or value.dtype != model.dtype:
                    raise PreparedMismatch(f"{name}: the stored {bias} is {value.dtype} {list(value.shape)}")
                biases[bias] = value
        module.mlp = ExpertMLP([stacks["gate_up"]], stacks["down"], biases["gate_up_bias"], biases["down_bias"],
                               module.activation)
        module.parts, module.bias_parts = {}, None


def _fill_plain(model: LlamaForCausalLM, handle, names: set[str]) -> None:  # type: ignore[no-untyped-def]
    for name, target in _plain_tensors(model).items():
        value = _take(handle, names, f"plain.{name}")
        # Norm gains may be stored fp32 in a model of another dtype (RMSNorm.fold_offset).
        if value.shape != target.shape or not value.is_floating_point():
            raise PreparedMismatch(f"{name}: stored as {value.dtype} {list(value.shape)}, expected "
                                   f"{list(target.shape)}")
        target.data = value
    if names:
        raise PreparedMismatch(f"the stored layout holds tensors this model has no place for, e.g. {min(names)}")
