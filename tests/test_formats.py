"""HF checkpoint reading: config variants and hostile or broken files."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from localserve import Engine, EngineConfig, LocalserveError
from localserve.formats import open_checkpoint
from localserve.formats.hf import spec_from_config

BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def test_old_and_new_rope_keys() -> None:
    old = spec_from_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = spec_from_config({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old.rope == new.rope
    assert (old.rope.kind, old.rope.theta, old.rope.factor, old.rope.original_max_position) == ("llama3", 500000.0, 8.0, 8192)
    linear = spec_from_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (linear.rope.kind, linear.rope.factor, linear.rope.theta) == ("linear", 2.0, 10000.0)


def test_config_errors_are_clear() -> None:
    with pytest.raises(LocalserveError, match="not supported"):
        spec_from_config({**BASE, "model_type": "gpt2"})
    with pytest.raises(LocalserveError, match="rope type 'su'"):
        spec_from_config({**BASE, "rope_scaling": {"type": "su", "factor": 2.0}})
    with pytest.raises(LocalserveError, match="activation 'relu'"):
        spec_from_config({**BASE, "hidden_act": "relu"})
    with pytest.raises(LocalserveError, match="longrope needs 4 short and long factors"):
        spec_from_config({**BASE, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                                   "long_factor": [1.0] * 3}, "original_max_position_embeddings": 64})
    with pytest.raises(LocalserveError, match="final_softcap inf"):
        spec_from_config({**BASE, "final_logit_softcapping": float("inf")})
    with pytest.raises(LocalserveError, match="missing or malformed"):
        spec_from_config({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(LocalserveError, match="multiple"):
        spec_from_config({**BASE, "num_attention_heads": 3, "num_key_value_heads": 2})


def test_qwen2_sliding_window_only_when_enabled() -> None:
    assert spec_from_config({**BASE, "model_type": "qwen2", "sliding_window": 1024}).sliding_window is None
    assert spec_from_config({**BASE, "model_type": "mistral", "sliding_window": 1024}).sliding_window == 1024
    # A window as long as the context (4,096 here) limits nothing.
    assert spec_from_config({**BASE, "model_type": "mistral", "sliding_window": 4096}).window_of(0) is None


@pytest.mark.parametrize("model_type,architecture,bias,qk_norm", [
    ("llama", "llama", False, False), ("mistral", "llama", False, False), ("qwen2", "qwen2", True, False),
    ("qwen3", "qwen3", False, True)])
def test_the_architecture_table_decides_what_sets_a_model_apart(model_type: str, architecture: str, bias: bool,
                                                                 qk_norm: bool) -> None:
    """formats/architectures.py is the one place: the HF reader, the GGUF reader and the
    model's weight names all read it."""
    from localserve.formats.architectures import ARCHITECTURES, HF_MODEL_TYPES, by_gguf

    spec = spec_from_config({**BASE, "model_type": model_type})
    assert (spec.architecture, spec.attention_bias, spec.qk_norm) == (architecture, bias, qk_norm)
    assert sorted(HF_MODEL_TYPES) == sorted(t for a in ARCHITECTURES.values() for t in a.hf_model_types)
    assert by_gguf("llama", has_experts=True) is ARCHITECTURES["mixtral"]
    assert by_gguf("llama", has_experts=False) is ARCHITECTURES["llama"]
    assert by_gguf("qwen3moe", has_experts=True) is ARCHITECTURES["qwen3_moe"] and by_gguf("gpt2", False) is None
    with pytest.raises(LocalserveError, match="supported: gemma2, gemma3_text, gpt_oss, granite, llama, mistral, mixtral, olmoe, phi3, qwen2, "
                       "qwen2_moe, qwen3, qwen3_moe"):
        spec_from_config({**BASE, "model_type": "gpt2"})


@pytest.fixture()
def checkpoint(tiny_models, tmp_path):
    source, _ = tiny_models.get("llama")
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def expect_load_error(path, match: str) -> None:
    with pytest.raises(LocalserveError, match=match):
        Engine(path, EngineConfig(num_kv_blocks=4), device="cpu")


def test_broken_files_fail_cleanly(checkpoint) -> None:
    (checkpoint / "config.json").write_text("{not json")
    expect_load_error(checkpoint, "not valid JSON")
    expect_load_error(checkpoint / "missing", "no such file")


def test_truncated_safetensors(checkpoint) -> None:
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    expect_load_error(checkpoint, "not a valid safetensors file")


def test_lying_safetensors_header(checkpoint) -> None:
    # A header length pointing far beyond the end of the file.
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    expect_load_error(checkpoint, "not a valid safetensors file")


def test_shard_names_cannot_escape(checkpoint) -> None:
    index = {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_load_error(checkpoint, "invalid shard file name")


def test_missing_and_misshapen_tensors(checkpoint) -> None:
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors")
    expect_load_error(checkpoint, "missing 1 tensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, checkpoint / "model.safetensors")
    expect_load_error(checkpoint, "has shape")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 160)
    tensors["model.layers.9.unknown.weight"] = torch.zeros(2)
    save_file(tensors, checkpoint / "model.safetensors")
    expect_load_error(checkpoint, "num_hidden_layers is 2 but the weights hold tensors of 3 layers, numbered up to 9")
    del tensors["model.layers.9.unknown.weight"]
    tensors["model.unknown.weight"] = torch.zeros(2)
    save_file(tensors, checkpoint / "model.safetensors")
    expect_load_error(checkpoint, "does not belong")


def test_open_checkpoint_reads_generation_eos(checkpoint) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert open_checkpoint(checkpoint).spec.eos_token_ids == [2, 7]


def test_fused_slice_with_wrong_rows_is_refused(checkpoint) -> None:
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)  # 32 rows expected
    save_file(tensors, checkpoint / "model.safetensors")
    expect_load_error(checkpoint, r"expected \(32, 64\)")
