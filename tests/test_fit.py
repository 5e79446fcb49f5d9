"""`localserve fit`: memory plans from metadata alone, checked against hand computations
for two real shapes: Llama-3.1-8B (dense, GQA) as bf16 safetensors and Mixtral-8x7B
(MoE) as a Q4_K_M-style GGUF. The checkpoints are real headers over sparse files: the
tensor data is never written, so a 16 GB model costs nothing on disk, and any attempt
to load weights would read zeros rather than fail, so the sizes must come from headers."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from localserve import EngineConfig
from localserve.cli.main import main
from localserve.facts.fit import plan

from .conftest import DATA

GiB = 1 << 30

LLAMA_8B = dict(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128, context=131072)
MIXTRAL = dict(vocab=32000, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128, context=32768,
               experts=8, top_k=2)


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], int]]) -> None:
    """A safetensors file whose header lists ``tensors`` (name: dtype, shape, item
    bytes) and whose data region is a hole."""
    header, offset = {}, 0
    for name, (dtype, shape, item) in tensors.items():
        size = item
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def llama_8b(folder: Path) -> Path:
    s = LLAMA_8B
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "max_position_embeddings": s["context"], "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        "rope_theta": 500000.0, "tie_word_embeddings": False,
    }))
    hidden, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    tensors = {"model.embed_tokens.weight": (s["vocab"], hidden), "lm_head.weight": (s["vocab"], hidden),
               "model.norm.weight": (hidden,)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                    p + "mlp.gate_proj.weight": (s["ffn"], hidden), p + "mlp.up_proj.weight": (s["ffn"], hidden),
                    p + "mlp.down_proj.weight": (hidden, s["ffn"]), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)}
    # Two shards and an index, as published checkpoints come.
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        sparse_safetensors(folder / shard, {n: ("BF16", tensors[n], 2) for n in members})
    index = {"weight_map": {n: shard for shard, members in shards.items() for n in members}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def mixtral_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    s = MIXTRAL
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_expert_count(s["experts"])
    writer.add_expert_used_count(s["top_k"])
    writer.add_layer_norm_rms_eps(1e-5)
    hidden, kv, ffn, experts = s["hidden"], s["kv_heads"] * s["head_dim"], s["ffn"], s["experts"]
    # numpy order (outermost first); Q4_K everywhere but the output (Q6_K) and F32 vectors/router.
    tensors = {"token_embd.weight": (Q.Q4_K, (s["vocab"], hidden)), "output.weight": (Q.Q6_K, (s["vocab"], hidden)),
               "output_norm.weight": (Q.F32, (hidden,))}
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors |= {p + "attn_q.weight": (Q.Q4_K, (hidden, hidden)), p + "attn_k.weight": (Q.Q4_K, (kv, hidden)),
                    p + "attn_v.weight": (Q.Q4_K, (kv, hidden)), p + "attn_output.weight": (Q.Q4_K, (hidden, hidden)),
                    p + "ffn_gate_inp.weight": (Q.F32, (experts, hidden)),
                    p + "ffn_gate_exps.weight": (Q.Q4_K, (experts, ffn, hidden)),
                    p + "ffn_up_exps.weight": (Q.Q4_K, (experts, ffn, hidden)),
                    p + "ffn_down_exps.weight": (Q.Q4_K, (experts, hidden, ffn)),
                    p + "attn_norm.weight": (Q.F32, (hidden,)), p + "ffn_norm.weight": (Q.F32, (hidden,))}
    data = 0
    for name, (qtype, shape) in tensors.items():
        elements_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count // elements_per_block * bytes_per_block
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        data += gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    size = path.stat().st_size
    os.truncate(path, gguf.GGUFWriter.ggml_pad(size, writer.data_alignment) + data)
    return path


def cuda_graphs(hidden: int, per_token: int, context: int) -> int:
    """What the decode CUDA graphs keep at the default max_num_seqs (64): the activations
    of a 64-row forward, each bucket's bf16 output rows (1 + 2 + 4 + 8 + 16 + ... + 64 =
    295), and the static inputs: three int64 and two int32 values per sequence, and
    16-token block tables as wide as the context."""
    return 64 * per_token + 295 * hidden * 2 + 64 * (3 * 8 + 2 * 4) + 4 + 64 * (context // 16) * 4


def test_llama_8b_plan_equals_hand_computation(tmp_path: Path) -> None:
    s = LLAMA_8B
    path = llama_8b(tmp_path / "llama-3.1-8b")
    result = plan(path, 24 * GiB, EngineConfig(max_model_len=8192))

    # Parameters: embeddings and head, then per layer attention (q, k, v, o), MLP, two norms.
    hidden, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * s["ffn"] + 2 * hidden
    parameters = 2 * s["vocab"] * hidden + s["layers"] * per_layer + hidden
    assert parameters == 8_030_261_248  # the published 8.03 B
    assert result.weights.parameters == result.active_parameters == parameters
    assert result.weights.file_bytes == result.weights.loaded_bytes == 2 * parameters  # bf16 stays bf16

    # KV: K and V, every layer, every KV head, bf16: the well-known 128 KiB per token.
    assert result.kv_bytes_per_token == 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2 == 128 * 1024

    # 24 GiB at 0.90 less weights, the activation estimate for a 2048-token step
    # (per token: 4 x hidden + q/k/v + 3 x ffn, bf16; plus 64 rows of fp32 logits and
    # softmax), the decode CUDA graphs' memory and the 512 MiB CUDA allowance; whole
    # 16-token blocks; 512 per sequence.
    usable = int(24 * GiB * 0.90)
    per_token = (4 * hidden + hidden + 2 * kv + 3 * s["ffn"]) * 2
    activations = 2048 * per_token + 64 * s["vocab"] * 4 * 2 + cuda_graphs(hidden, per_token, context=8192)
    kv_budget = usable - 2 * parameters - activations - 512 * (1 << 20)
    blocks = kv_budget // (16 * 128 * 1024)
    assert (result.activation_bytes, result.kv_budget, result.kv_blocks) == (activations, kv_budget, blocks)
    assert result.max_sequences == blocks // 512 == 5 and result.fits

    # Without CUDA graphs their reserve is free for the KV cache.
    eager = plan(path, 24 * GiB, EngineConfig(max_model_len=8192, disable_cuda_graphs=True))
    graphs = cuda_graphs(hidden, per_token, context=8192)
    assert eager.activation_bytes == activations - graphs
    assert eager.kv_budget == kv_budget + graphs

    # int8 KV: 2 x (128 codes + a 4-byte scale) per KV head per layer.
    int8 = plan(path, 24 * GiB, EngineConfig(max_model_len=8192, kv_cache_dtype="int8"))
    assert int8.kv_bytes_per_token == 2 * s["layers"] * s["kv_heads"] * (s["head_dim"] + 4)
    assert int8.max_sequences == kv_budget // (16 * int8.kv_bytes_per_token) // 512 == 11

    # 8 GiB of CPU tier holds 8 GiB / 2 MiB blocks = 4096 blocks: 8 more sequences.
    offload = plan(path, 24 * GiB, EngineConfig(max_model_len=8192, cpu_offload_gb=8))
    assert (offload.cpu_blocks, offload.cpu_sequences) == (4096, 8)

    # A 16 GiB GPU cannot hold 15 GiB of weights plus the rest.
    small = plan(path, 16 * GiB, EngineConfig(max_model_len=8192))
    assert not small.fits and small.kv_budget < 0


def test_mixtral_gguf_plan_counts_every_expert(tmp_path: Path) -> None:
    s = MIXTRAL
    path = mixtral_gguf(tmp_path / "mixtral-8x7b-q4_k.gguf")
    result = plan(path, 48 * GiB, EngineConfig(max_model_len=32768))
    assert result.spec.architecture == "mixtral" and result.spec.num_experts == 8

    hidden, kv, ffn = s["hidden"], s["kv_heads"] * s["head_dim"], s["ffn"]
    attention = hidden * (2 * hidden + 2 * kv)
    experts = s["experts"] * 3 * hidden * ffn
    router, norms = s["experts"] * hidden, 2 * hidden
    parameters = 2 * s["vocab"] * hidden + s["layers"] * (attention + experts + router + norms) + hidden
    assert parameters == 46_702_792_704  # the published 46.7 B
    assert result.weights.parameters == result.spec.parameter_counts().total == parameters
    # A token runs through 2 of 8 experts: the published 12.9 B active.
    active = parameters - s["layers"] * experts * 6 // 8
    assert result.active_parameters == active == 12_879_925_248

    # File: Q4_K 144 bytes per 256 weights, Q6_K 210, F32 4 per weight.
    q4k = s["layers"] * (attention + experts) + s["vocab"] * hidden
    q6k = s["vocab"] * hidden
    f32 = s["layers"] * (router + norms) + hidden
    assert result.weights.file_bytes == q4k // 256 * 144 + q6k // 256 * 210 + f32 * 4
    # Loaded: Q4_K as 4-bit codes (128 B) + 8 groups x (uint8 scale + uint8 min) + fp16 d
    # and dmin = 148 B per 256; Q6_K as a byte per code (256) + 16 groups x (int8
    # scale + uint8 zero) + fp16 d = 290 B; F32 tensors become bf16.
    assert result.weights.loaded_bytes == q4k // 256 * 148 + q6k // 256 * 290 + f32 * 2

    assert result.kv_bytes_per_token == 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2
    per_token = (4 * hidden + hidden + 2 * kv + 3 * 2 * ffn) * 2  # two experts' MLPs
    activations = 2048 * per_token + 64 * s["vocab"] * 4 * 2 + cuda_graphs(hidden, per_token, context=32768)
    kv_budget = int(48 * GiB * 0.90) - result.weights.loaded_bytes - activations - 512 * (1 << 20)
    assert result.kv_budget == kv_budget
    assert result.max_sequences == kv_budget // (16 * 128 * 1024) // (32768 // 16) == 4


def test_cpu_moe_plans_experts_in_host_memory(tmp_path: Path) -> None:
    """cpu_moe takes the experts of the first N layers off the GPU's budget: Q4_K
    loaded at 148 bytes per 256 weights, 3 x 8 experts of hidden x ffn per layer."""
    s = MIXTRAL
    path = mixtral_gguf(tmp_path / "mixtral.gguf")
    per_layer = 3 * s["experts"] * s["hidden"] * s["ffn"] // 256 * 148
    base = plan(path, 24 * GiB, EngineConfig(max_model_len=32768))
    assert not base.fits and base.host_expert_bytes == 0
    for cpu_moe, layers in ((8, 8), ("all", 32), (100, 32)):
        moved = plan(path, 24 * GiB, EngineConfig(max_model_len=32768, cpu_moe=cpu_moe))
        assert moved.cpu_moe_layers == layers
        assert moved.host_expert_bytes == layers * per_layer
        assert moved.gpu_weight_bytes == base.weights.loaded_bytes - layers * per_layer
        # Experts on the CPU run eagerly: the decode CUDA graphs' reserve (64 rows of
        # activations, two experts' MLPs each) is the KV cache's too.
        kv = s["kv_heads"] * s["head_dim"]
        graphs = cuda_graphs(s["hidden"], (5 * s["hidden"] + 2 * kv + 6 * s["ffn"]) * 2, context=32768)
        assert moved.kv_budget == base.kv_budget + layers * per_layer + graphs
    # All experts in host RAM: 1.5 GiB of weights stay on the GPU and 19.7 GiB of KV
    # cache (2 MiB blocks of 16 tokens) hold 4 full 32K contexts.
    assert moved.gpu_weight_bytes < 1.6 * GiB
    assert moved.fits and moved.max_sequences == moved.kv_budget // (2 << 20) // 2048 == 4
    result = CliRunner().invoke(main, ["fit", str(path), "--gpu-memory", "24GiB", "--max-model-len", "32768",
                                       "--cpu-moe"])
    assert result.exit_code == 0, result.output
    assert "of experts (cpu_moe: layers 0-31 of 32) run on the CPU" in result.output
    assert "yes: 4 sequences" in result.output


def test_show_prints_total_and_active_parameters(tmp_path: Path) -> None:
    path = mixtral_gguf(tmp_path / "mixtral.gguf")
    result = CliRunner().invoke(main, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "mixtral: 32 layers, hidden 4096, 32 heads (8 KV) of 128" in result.output
    assert "46.70 B (8 experts, 2 per token: 12.88 B active)" in result.output
    assert "32,768 tokens" in result.output
    info = json.loads(CliRunner().invoke(main, ["show", str(path), "--json"]).output)
    assert (info["parameters"], info["active_parameters"]) == (46_702_792_704, 12_879_925_248)
    assert info["quantization"].startswith("Q4_K")


def test_fit_cli_prints_the_plan(tmp_path: Path) -> None:
    path = mixtral_gguf(tmp_path / "mixtral.gguf")
    runner = CliRunner()
    result = runner.invoke(main, ["fit", str(path), "--gpu-memory", "48GiB", "--max-model-len", "32768",
                                  "--cpu-offload-gb", "16"])
    assert result.exit_code == 0, result.output
    assert "8 experts, 2 per token: 12.88 B active" in result.output
    assert "yes: 4 sequences of 32,768 tokens" in result.output
    assert "4 more sequences held in host memory" in result.output  # 16 GiB / 4 GiB per sequence

    as_json = runner.invoke(main, ["fit", str(path), "--gpu-memory", "24GiB", "--json"])
    summary = json.loads(as_json.output)
    assert summary["fits"] is False and summary["parameters"] == 46_702_792_704


@pytest.mark.parametrize(("name", "tolerance"), [
    ("stories260K-hf", 0), ("stories260K.gguf", 0),
    # GPTQ/AWQ: zero points unpacked to a byte each, act-order's permutation as int64.
    ("tiny-gptq-4bit-g32-actorder", 0.03), ("tiny-awq-4bit-g64", 0.03),
])
def test_planned_weights_equal_what_the_engine_holds(name: str, tolerance: float) -> None:
    from localserve import Engine

    path = DATA / "models" / name
    engine = Engine(path, EngineConfig(num_kv_blocks=4), device="cpu", dtype="bfloat16")
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters()) + sum(
        linear.nbytes for linear in engine.model.linears())
    planned = plan(path, GiB, dtype="bfloat16").weights.loaded_bytes
    assert planned == pytest.approx(held, rel=tolerance, abs=0)


def test_fit_errors_are_clear(tmp_path: Path) -> None:
    runner = CliRunner()
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt-neox"}')
    result = runner.invoke(main, ["fit", str(folder), "--gpu-memory", "8GiB"])
    assert result.exit_code == 1 and "not supported" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_moe_checkpoints_are_planned(tmp_path: Path, kind: str) -> None:
    """Tiny MoE checkpoints saved by transformers: every parameter counted once, the
    experts' told apart (a shared expert is always active), KV from the config."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    config = {
        "mixtral": lambda: MixtralConfig(**common, intermediate_size=96, num_local_experts=4),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                            num_experts=4, intermediate_size=96),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, moe_intermediate_size=48, num_experts=4, intermediate_size=96,
                                            head_dim=32),
    }[kind]()
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(tmp_path / kind)

    result = plan(tmp_path / kind, GiB)
    spec = result.spec
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok) == (kind, 4, 2)
    parameters = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in parameters.items() if ".experts." in name)  # not Qwen2's shared_expert
    assert result.weights.parameters == sum(parameters.values())
    assert result.active_parameters == sum(parameters.values()) - experts // 2
    assert result.weights.loaded_bytes == 2 * sum(parameters.values())
    assert result.kv_bytes_per_token == 2 * 2 * 2 * spec.head_dim * 2


def test_fit_without_a_gpu_plans_for_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU and no --gpu-memory: the plan is for the CPU (fp32 weights and KV cache) in
    the host's available memory, with the engine's own default pool: a quarter of what
    the weights and one 512-token step's activations leave, for contexts of at most
    8,192 tokens when no max_model_len is given."""
    import torch

    from localserve.engine import memory
    from localserve.engine.host_memory import HostMemory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory, "available_host_memory", lambda: HostMemory(64 * GiB, "MemAvailable, by a test"))
    s = LLAMA_8B
    path = llama_8b(tmp_path / "llama-3.1-8b")
    result = CliRunner().invoke(main, ["fit", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)

    per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 4  # K and V, fp32: 256 KiB
    assert summary["kv_bytes_per_token"] == per_token == 256 * 1024
    assert (summary["device"], summary["memory"], summary["dtype"]) == ("cpu", 64 * GiB, "float32")
    weights = 4 * 8_030_261_248  # every parameter as fp32
    hidden, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    activations = 512 * (5 * hidden + 2 * kv + 3 * s["ffn"]) * 4 + 64 * s["vocab"] * 4 * 2
    room = 64 * GiB - weights - activations
    blocks = int(room * 0.25) // (16 * per_token)  # 64 sequences of 8,192 tokens (128 GiB) would take more
    assert (summary["weights_loaded_bytes"], summary["activation_bytes_estimate"]) == (weights, activations)
    assert (summary["context"], summary["kv_blocks"]) == (8192, blocks)
    assert summary["max_sequences"] == blocks // 512 == 4 and summary["fits"]
    assert summary["largest_context"] == blocks * 16  # the model's own 131,072 would not fit

    text = CliRunner().invoke(main, ["fit", str(path)]).output
    assert "64.00 GiB available (MemAvailable, by a test; no GPU)" in text
    assert "capped to 25% of" in text and "yes: 4 sequences of 8,192 tokens at once" in text

    # Room for every sequence a step may run: the pool is sized for them, not for a quarter of the memory.
    few = plan(path, None, EngineConfig(max_model_len=2048, max_num_seqs=2))
    assert few.kv_blocks == 2 * 2048 // 16 and few.max_sequences == 2
    assert few.kv_reason.startswith("sized for 2 sequences of 2,048 tokens; 25% of")
    # A pool fixed by the options holds 32 such sequences, but a step runs at most max_num_seqs.
    fixed = plan(path, None, EngineConfig(max_model_len=2048, max_num_seqs=4, kv_cache_memory=16 * GiB))
    assert fixed.pool_sequences == 16 * GiB // (2048 * per_token) == 32 and fixed.max_sequences == 4
    # More than the weights leave does not fit.
    assert not plan(path, None, EngineConfig(max_model_len=2048, kv_cache_memory=48 * GiB)).fits


def test_every_figure_respects_the_engine_limits(tmp_path: Path) -> None:
    """A large GPU holds hundreds of 1,024-token sequences, but a step runs max_num_seqs,
    no sequence is longer than max_model_len, and only running sequences are swapped
    out to the CPU tier."""
    path = llama_8b(tmp_path / "llama-3.1-8b")
    config = EngineConfig(max_model_len=1024, max_num_seqs=8, cpu_offload_gb=8)
    result = plan(path, 80 * GiB, config)
    assert result.pool_sequences > 400  # 128 MiB per sequence in ~55 GiB
    assert (result.max_sequences, result.largest_context, result.cpu_sequences) == (8, 1024, 0)
    out = CliRunner().invoke(main, ["fit", str(path), "--gpu-memory", "80GiB", "--max-model-len", "1024",
                                    "--max-num-seqs", "8", "--cpu-offload-gb", "8"]).output
    assert f"yes: 8 sequences of 1,024 tokens at once, the max_num_seqs limit (the {result.kv_blocks * 16:,} tokens " \
           f"of KV cache would hold {result.pool_sequences:,})" in out
    assert "0 more sequences held in host memory while swapped out (65,536 tokens; the max_num_seqs limit" in out
