"""A random-weight Llama-shaped HF checkpoint for the benchmarks (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_llama(path: Path, **config_fields) -> None:  # type: ignore[no-untyped-def]
    """Save a LlamaForCausalLM with ``config_fields`` and weights at std 1/sqrt(fan_in)
    (non-degenerate logits), seeded, so every run measures the same model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config_fields))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32")
    model.save_pretrained(path)
