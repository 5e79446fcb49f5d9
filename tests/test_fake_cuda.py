"""The engine's CUDA path on a faked card (tests/fake_cuda): for a dense and an MoE
model in each format, whole engine steps (prefill chunks, decode, sampling, KV writes,
paged attention, swaps to the CPU tier) run on device ``cuda:0`` with every kernel
dispatched to its Triton custom op, after the warm-up at load captured the decode CUDA
graphs (test_cuda_graphs.py has the graphs' own tests); and the memory planner sizes the KV pool of
real-shaped models on a 24 GiB and an 80 GiB card so that the largest step still fits.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.errors import InsufficientMemoryError
from localserve.engine.cuda_graphs import GraphShape, capture_sizes
from localserve.engine.memory import GiB
from localserve.formats import Checkpoint

from .fake_cuda import A100_80GB, DEVICE, RTX_4090, Card, fake_gpu

pytest.importorskip("triton")

# What a step may do on the host: build its small index tensors there before copying
# them over, read sampled tokens back, and take views of the CPU tier's blocks (the
# copies themselves mix devices). Nothing else: no computation.
HOST_STAGING = {"aten::lift_fresh", "aten::detach_", "prim::device", "aten::_to_copy", "aten::empty.memory_format",
                "aten::view.dtype", "aten::select.int", "aten::as_strided"}


def _gptq(bits: int = 4, group: int = 32, act_order: bool = True) -> tuple[dict, object]:
    from .quant_writers import gptq_layer

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False}
    return config, lambda rng, o, i: gptq_layer(rng, o, i, bits, group, act_order, False, v1=True)


def _awq() -> tuple[dict, object]:
    from .quant_writers import awq_layer

    return ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
            lambda rng, o, i: awq_layer(rng, o, i, 64, True))


def _gguf(root: Path, model: torch.nn.Module, ftype: str = "Q4_K_M") -> Path:
    """The model quantized by llama.cpp's own quantizer."""
    import gguf

    from .gguf_writers import write_gguf
    from .test_gguf_models import llama_cpp_quantize

    source, path = root / "f32.gguf", root / f"{ftype}.gguf"
    write_gguf(source, model, gguf.GGMLQuantizationType.F32)
    llama_cpp_quantize(source, path, ftype)
    return path


def make_checkpoint(kind: str, root: Path, tiny_models) -> Path:  # type: ignore[no-untyped-def]
    from .gguf_writers import tiny_llama, tiny_moe
    from .test_gptq_awq import write_checkpoint
    from .test_gptq_awq_moe import write_moe_checkpoint

    if kind == "hf-dense":
        return tiny_models.get("llama", torch.bfloat16)[0]
    if kind == "hf-moe":
        return tiny_models.get("qwen2_moe", torch.float16)[0]
    if kind == "gptq-dense":
        write_checkpoint(root / "gptq", *_gptq())
        return root / "gptq"
    if kind == "awq-dense":
        write_checkpoint(root / "awq", *_awq())
        return root / "awq"
    if kind == "gptq-moe":
        return write_moe_checkpoint(root, "qwen3_moe", *_gptq(act_order=True))[0]
    if kind == "awq-moe":
        return write_moe_checkpoint(root, "mixtral", *_awq())[0]
    if kind == "gguf-dense":
        return _gguf(root, tiny_llama())
    if kind == "gguf-iq4_xs-moe":  # codebook weights: a table lookup inside the GEMMs
        return _gguf(root, tiny_moe("qwen2_moe"), "IQ4_XS")
    assert kind == "gguf-moe"
    return _gguf(root, tiny_moe("qwen2_moe"))


KINDS = ["hf-dense", "hf-moe", "gptq-dense", "gptq-moe", "awq-dense", "awq-moe", "gguf-dense", "gguf-moe",
         "gguf-iq4_xs-moe"]

# Sampling that takes every branch of the sampler at once.
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=1),
    SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.5, logit_bias={5: 3.0}, min_tokens=2),
]


def run_steps(engine: Engine, prompts: list[list[int]]) -> list:  # type: ignore[type-arg]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, PARAMS[i % len(PARAMS)])
    finished = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return finished
        finished += [out for out in engine.step() if out.finished]
    raise AssertionError("the engine did not finish its requests")


@pytest.mark.parametrize("kind", KINDS)
def test_engine_steps_on_a_fake_card(tmp_path, tiny_models, kind: str) -> None:
    path = make_checkpoint(kind, tmp_path, tiny_models)
    # A pool of 24 blocks for prompts of 40-150 tokens: requests are preempted and
    # swapped to the CPU tier and back; 64-token steps chunk every prefill.
    config = EngineConfig(num_kv_blocks=24, num_cpu_blocks=64, max_num_batched_tokens=64)
    with fake_gpu(RTX_4090) as gpu:
        engine = Engine(path, config, device="cuda:0")
        assert engine.dtype in (torch.bfloat16, torch.float16)
        gpu.mode.ops.clear()
        gpu.mode.cpu_ops.clear()
        prompts = [list(range(3, 3 + 40 + 22 * i)) for i in range(6)]
        finished = run_steps(engine, prompts)
        stats = engine.stats()

    assert len(finished) == len(prompts)
    if "iq4" in kind:
        experts = engine.runner.model.layers[0].mlp.experts.mlp
        assert all(w.weight.codebook is not None for w in (*experts.gate_up, experts.down))
    # A fake tensor has no values: every token read back is 0.
    assert all(out.token_ids == [0] * 6 for out in finished)
    assert stats.swap_out_blocks > 0 and stats.swap_in_blocks > 0
    ops = gpu.mode.ops
    layers = engine.spec.num_layers
    assert ops["localserve::write_kv"] == ops["localserve::paged_attention"] > 0
    assert ops["localserve::write_kv"] % layers == 0
    if not kind.startswith("hf"):
        assert ops["localserve::quant_linear"] > 0
    if kind.endswith("moe"):
        assert ops["localserve::moe_gemm"] > 0
    else:
        assert ops["localserve::moe_gemm"] == 0
    # Nothing is computed on the host during a step: it only stages indices and reads tokens.
    assert set(gpu.mode.cpu_ops) <= HOST_STAGING, gpu.mode.cpu_ops
    # Every decode bucket was captured at load under the capture's checks (no read back
    # to the host, no host memory copied in), and decode steps replayed them.
    graphs = engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs, key=lambda shape: shape.rows) == [
        GraphShape(size, size, 1) for size in capture_sizes(engine.config.max_num_seqs)]
    assert sum(graphs.replays.values()) > 0


@pytest.mark.parametrize("card,kv_cache_dtype", [(RTX_4090, "fp8"), (A100_80GB, "int8")], ids=["fp8-4090", "int8-a100"])
def test_8bit_caches_on_a_fake_card(tiny_models, card: Card, kv_cache_dtype: str) -> None:
    path = tiny_models.get("qwen3", torch.bfloat16)[0]
    config = EngineConfig(num_kv_blocks=24, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    with fake_gpu(card) as gpu:
        engine = Engine(path, config, device="cuda:0")
        finished = run_steps(engine, [list(range(3, 90)), list(range(7, 50))])
    assert len(finished) == 2
    assert gpu.mode.ops["localserve::write_kv"] > 0
    cache = engine.runner.kv_caches[0]
    assert cache.key.device == DEVICE and cache.key.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[
        kv_cache_dtype]
    assert cache.key_scale is not None and cache.key_scale.dtype == torch.float32


def test_fp8_cache_is_refused_below_compute_8_9(tiny_models) -> None:
    path = tiny_models.get("qwen3", torch.bfloat16)[0]
    with fake_gpu(A100_80GB), pytest.raises(LocalserveError, match="8.9"):
        Engine(path, EngineConfig(num_kv_blocks=8, kv_cache_dtype="fp8"), device="cuda:0")


# --------------------------------------------------------------------------------------
# Pool sizing with real shapes
# --------------------------------------------------------------------------------------

REAL_CONFIGS = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, rope_theta=500000.0,
        bos_token_id=128000, eos_token_id=128001),
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
        rope_theta=1000000.0, norm_topk_prob=False, decoder_sparse_step=1, bos_token_id=151643,
        eos_token_id=151643),
}


def sparse_checkpoint(root: Path, name: str) -> Path:
    """A bf16 safetensors checkpoint of a real model's shapes whose data is a hole in a
    sparse file: its headers are real, its bytes never read (the weights come from
    ``fake_weights``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / name
    folder.mkdir()
    config = REAL_CONFIGS[name]
    (folder / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    header, offset = {}, 0
    for tensor_name, shape in hub_names(model.state_dict()):
        size = math.prod(shape) * 2
        header[tensor_name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        f.truncate(8 + len(encoded) + offset)
    return folder


def hub_names(state: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """(name, shape) as checkpoints on the Hub store them: transformers holds a layer's
    experts fused (``experts.gate_up_proj [E, 2I, H]``), files one tensor per expert."""
    for name, tensor in state.items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            experts, rows, columns = tensor.shape
            for e in range(experts):
                for projection in ("gate_proj", "up_proj"):
                    yield f"{prefix}.{e}.{projection}.weight", [rows // 2, columns]
        elif last == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", list(tensor.shape[1:])
        else:
            yield name, list(tensor.shape)


def fake_weights(checkpoint: Checkpoint):  # type: ignore[no-untyped-def]
    """The checkpoint's tensors as fake bf16 tensors of their header shapes (on the
    device: a CPU tensor would be real)."""
    for name, shape, _ in checkpoint.headers:
        yield name, torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)


@pytest.mark.parametrize("card", [RTX_4090, A100_80GB], ids=["24GiB", "80GiB"])
@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_pool_fills_the_card_and_the_largest_step_fits(tmp_path, name: str, card: Card) -> None:
    from localserve.facts.fit import plan

    path = sparse_checkpoint(tmp_path, name)
    # 16 sequences, not the default 64: five decode graphs to capture instead of eleven (a
    # capture under the fake card is seconds of Python per graph), the same planning, pool
    # and graph-memory arithmetic.
    config = EngineConfig(max_num_seqs=16)
    planned = plan(path, card.total_memory, config)
    usable = int(card.total_memory * config.gpu_memory_utilization)
    with fake_gpu(card) as gpu, mock.patch.object(Checkpoint, "weights", fake_weights):
        if planned.kv_budget <= 0:
            # The weights alone do not fit: refused before loading, not by an out-of-memory error.
            with pytest.raises(InsufficientMemoryError, match="the weights need .* GiB on the GPU"):
                Engine(path, config, device="cuda:0")
            assert gpu.mode.peak == 0
            return
        engine = Engine(path, config, device="cuda:0")
        after_load = gpu.in_use
        pool_bytes = engine.kv.device.num_blocks * engine.runner.kv_caches[0].key[0].nbytes * 2 * engine.spec.num_layers
        # The largest step: one prefill of max_num_batched_tokens.
        gpu.reset_peak()
        engine.add_request(list(range(1000, 1000 + engine.config.step_tokens("cuda"))), SamplingParams(max_tokens=1))
        engine.step()
        step_peak = card.context_bytes + gpu.mode.peak

    assert after_load <= usable
    assert step_peak <= usable, f"the largest step needs {(step_peak - usable) / GiB:.2f} GiB more than allowed"
    # The pool takes what the step leaves: less than one block of the budget unused.
    assert usable - step_peak < pool_bytes / engine.kv.device.num_blocks + (64 << 20)
    # `localserve fit`'s estimate is within 5% of the pool the engine measured for.
    assert math.isclose(planned.kv_blocks, engine.kv.device.num_blocks, rel_tol=0.05), (
        planned.kv_blocks, engine.kv.device.num_blocks)
    assert np.isclose(planned.weights.loaded_bytes, after_load - pool_bytes - card.context_bytes, rtol=0.02)
