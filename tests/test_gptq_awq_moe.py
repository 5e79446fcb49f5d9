"""GPTQ and AWQ MoE checkpoints (every expert's projections quantized one by one, in
the hub's per-expert naming; routers left dense, as quantizers leave them), written
from the format facts: our logits equal transformers running the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from localserve import Engine, EngineConfig

from .conftest import hf_logits, random_prompt, reinitialise, relative_error
from .quant_writers import awq_layer, gptq_layer
from .test_models import all_logits

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def tiny_moe_config(kind: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    # Widths that every group size below divides (and AWQ's 8 columns per word).
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, num_experts_per_tok=2)
    if kind == "mixtral":
        return MixtralConfig(**base, num_local_experts=4, sliding_window=None)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**base, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=128)
    return Qwen3MoeConfig(**base, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True)


def write_moe_checkpoint(root: Path, kind: str, quant_config: dict, make_layer):
    """The quantized checkpoint at ``root / "quantized"``, and transformers' model of
    its dequantized weights (saved with the same names, loaded back)."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(kind)
    model = AutoModelForCausalLM.from_config(config)
    reinitialise(model, seed=11)
    model.save_pretrained(root / "source")  # the hub's per-expert names
    rng = np.random.default_rng(1)
    quantized, dense = {}, {}
    for name, array in load_file(str(root / "source" / "model.safetensors")).items():
        prefix, _, _ = name.rpartition(".")
        if array.ndim == 2 and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            layer = make_layer(rng, *array.shape)
            quantized.update({f"{prefix}.{k}": v for k, v in layer.tensors.items()})
            dense[name] = layer.dense
        else:
            quantized[name] = array.astype(np.float16)
            dense[name] = array.astype(np.float16).astype(np.float32)
    for folder, tensors, extra in ((root / "quantized", quantized, {"quantization_config": quant_config}),
                                   (root / "dequantized", dense, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config.to_dict(), **extra}))
    reference = AutoModelForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32)
    return root / "quantized", reference.eval()


QUANTIZATIONS = {
    # Act-order: each expert's gate and up have their own column orders, so they run apart.
    "gptq-4bit-g32-actorder": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
                               lambda rng, o, i: gptq_layer(rng, o, i, 4, 32, True, False, v1=True)),
    "gptq-8bit-g64": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": True},
                      lambda rng, o, i: gptq_layer(rng, o, i, 8, 64, False, True, v1=True)),
    "awq-4bit-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                     lambda rng, o, i: awq_layer(rng, o, i, 64, True)),
}


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantized_moe_checkpoint_equals_dequantized_reference(tmp_path, kind: str, quantization: str) -> None:
    quant_config, make_layer = QUANTIZATIONS[quantization]
    path, reference = write_moe_checkpoint(tmp_path, kind, quant_config, make_layer)
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    for _, experts in engine.model.experts():
        assert experts.mlp.quantized
        assert len(experts.mlp.gate_up) == (2 if "actorder" in quantization else 1)
    prompts = [random_prompt(n, seed=n) for n in (3, 40)]
    for prompt, ours in zip(prompts, all_logits(engine, prompts)):
        assert relative_error(ours, hf_logits(reference, prompt)) <= 1e-4
