"""GPTQ and AWQ checkpoints: written by the tests from the format facts, and the
reference checkpoints in tests/data."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from localserve import LLM, Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.formats import open_checkpoint
from localserve.kernels.quant_weight import QuantWeight, dequantize_in_input_order

from .conftest import DATA, hf_logits, random_prompt, reinitialise, relative_error
from .quant_writers import awq_layer, gptq_layer, numpy_unpack_gptq
from .test_models import all_logits

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_checkpoint(path: Path, quant_config: dict, make_layer, hidden: int = 128, layers: int = 1):
    """A tiny quantized Llama checkpoint and the HF fp32 model carrying exactly its
    dequantized weights (dense tensors stored in fp16, as real checkpoints do)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    reinitialise(model, seed=7)
    rng = np.random.default_rng(0)
    state = model.state_dict()
    tensors, dense = {}, {}
    for name, weight in state.items():
        prefix, _, _ = name.rpartition(".")
        if prefix.rsplit(".", 1)[-1] in LINEARS:
            layer = make_layer(rng, *weight.shape)
            tensors.update({f"{prefix}.{k}": v for k, v in layer.tensors.items()})
            dense[f"{prefix}.weight"] = layer.dense
            state[name] = torch.from_numpy(layer.dense)
        else:
            tensors[name] = weight.half().numpy()
            state[name] = weight.half().float()
    model.load_state_dict(state)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    config_dict = config.to_dict()
    config_dict["quantization_config"] = quant_config
    config_dict["torch_dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config_dict))
    return model.eval(), dense


GPTQ_CASES = list(itertools.product([4, 8], [32, 64, 128, -1], [False, True], [False, True], ["gptq", "gptq_v2"]))


@pytest.mark.parametrize("bits,group_size,desc_act,sym,fmt", GPTQ_CASES)
def test_gptq(tmp_path, bits, group_size, desc_act, sym, fmt) -> None:
    quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
             "checkpoint_format": fmt}
    hf, dense = write_checkpoint(
        tmp_path / "ckpt", quant,
        lambda rng, out_f, in_f: gptq_layer(rng, out_f, in_f, bits, group_size, desc_act, sym, v1=fmt == "gptq"),
    )
    check_checkpoint(tmp_path / "ckpt", hf, dense)


@pytest.mark.parametrize("group_size,zero_point", list(itertools.product([64, 128], [True, False])))
def test_awq(tmp_path, group_size, zero_point) -> None:
    quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point, "version": "gemm"}
    hf, dense = write_checkpoint(
        tmp_path / "ckpt", quant, lambda rng, out_f, in_f: awq_layer(rng, out_f, in_f, group_size, zero_point)
    )
    check_checkpoint(tmp_path / "ckpt", hf, dense)


def check_checkpoint(path: Path, hf, dense: dict[str, np.ndarray]) -> None:
    quantized = {n: w for n, w in open_checkpoint(path).weights() if isinstance(w, QuantWeight)}
    assert quantized.keys() == dense.keys()
    for name, weight in quantized.items():
        # Lossless re-packing: exactly the writer's fp32 values.
        assert torch.equal(dequantize_in_input_order(weight), torch.from_numpy(dense[name])), name
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    prompt = random_prompt(40, seed=5)
    assert relative_error(all_logits(engine, [prompt])[0], hf_logits(hf, prompt)) <= 1e-4


def test_four_bit_weights_stay_about_file_size(tmp_path) -> None:
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    write_checkpoint(tmp_path / "ckpt", quant,
                     lambda rng, o, i: gptq_layer(rng, o, i, 4, 128, False, True, v1=True), hidden=512, layers=2)
    from safetensors import safe_open

    with safe_open(tmp_path / "ckpt" / "model.safetensors", "np") as f:
        file_bytes = sum(f.get_tensor(k).nbytes for k in f.keys() if k.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"))
    engine = Engine(tmp_path / "ckpt", EngineConfig(num_kv_blocks=8), device="cpu", dtype=torch.float32)
    linears = [l for l in engine.model.linears() if l is not engine.model.embed and l is not engine.model.lm_head]
    held = sum(l.nbytes for l in linears)
    fp16_bytes = sum(l.in_features * sum(l.part_sizes) * 2 for l in linears)
    print(f"\nquantized linears: {held} bytes in memory, {file_bytes} in the file, {fp16_bytes} as fp16")
    assert held <= 1.1 * file_bytes and held < 0.3 * fp16_bytes


@pytest.mark.parametrize("name", ["tiny-gptq-4bit-g32-actorder", "tiny-awq-4bit-g64"])
def test_shared_reference_checkpoints(name: str) -> None:
    path = DATA / "models" / name
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    expected = json.loads((path / "expected.json").read_text())
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    # The reference generations never ended early: EOS held back for all 16 tokens.
    outputs = llm.generate(expected["prompts"], SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=5))
    assert [o.token_ids for o in outputs] == expected["greedy_16"]
    top5 = expected["prompt0_last_logits_top5"]
    first = outputs[0].logprobs[0].top
    assert [t for t, _ in first] == top5["ids"]
    # Logprobs differ from logits by one constant per row: compare the differences.
    ours = np.array([lp for _, lp in first])
    np.testing.assert_allclose(ours - ours[0], np.array(top5["values"]) - top5["values"][0], atol=1e-4)


def test_shared_gptq_unpacks_like_numpy() -> None:
    path = DATA / "models" / "tiny-gptq-4bit-g32-actorder"
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    from safetensors.numpy import load_file

    raw = load_file(str(path / "model.safetensors"))
    for name, weight in open_checkpoint(path).weights():
        if isinstance(weight, QuantWeight):
            prefix = name.rsplit(".", 1)[0]
            parts = {k: raw[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
            expected = numpy_unpack_gptq(parts, bits=4, group_size=32, v1=True)
            assert torch.equal(dequantize_in_input_order(weight), torch.from_numpy(expected)), name


def test_unsupported_quantization_is_refused(tmp_path) -> None:
    quant = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemv"}
    write_checkpoint(tmp_path / "ckpt", quant, lambda rng, o, i: awq_layer(rng, o, i, 64, True))
    with pytest.raises(LocalserveError, match="'gemv' is not supported"):
        Engine(tmp_path / "ckpt", EngineConfig(num_kv_blocks=8), device="cpu")


def test_gptq_v1_zero_of_256_is_kept() -> None:
    from localserve.formats.hf import QuantConfig
    from localserve.formats.hf_quant import gptq_to_quant_weight

    k, n = 32, 8
    qweight = torch.full((k * 8 // 32, n), 0x05050505, dtype=torch.int32)  # every code 5
    qzeros = torch.full((1, n * 8 // 32), -1, dtype=torch.int32)  # stored 255: true zero 256
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": torch.ones(1, n, dtype=torch.float16)}
    weight = gptq_to_quant_weight("layer", parts, QuantConfig("gptq", 8, 32, zeros_minus_one=True))
    assert torch.all(dequantize_in_input_order(weight) == 5 - 256)
