"""GGUF models end to end: our logits against gguf-py's dequantization (the same
weights in an HF fp32 model) and against llama.cpp on the same file."""

from __future__ import annotations

import pytest
import torch

from localserve import LLM, Engine, EngineConfig, SamplingParams

from .conftest import hf_logits, random_prompt, relative_error
from .gguf_writers import STORIES_GGUF, dequantized_reference, tiny_llama, write_gguf
from .test_models import all_logits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
SIMPLE_TYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("qtype", SIMPLE_TYPES, ids=lambda t: t.name)
def test_gguf_py_types_match_dequantized_reference(tmp_path, model, qtype) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, model, qtype)
    reference = dequantized_reference(path, model)
    engine = Engine(path, EngineConfig(num_kv_blocks=32, exact_cpu_matmul=True), device="cpu", dtype=torch.float32)
    prompts = [random_prompt(n, seed=n) for n in (1, 37)]
    logits = all_logits(engine, prompts)
    for prompt, ours in zip(prompts, logits):
        assert relative_error(ours, hf_logits(reference, prompt)) <= 1e-4


def test_stories_gguf_greedy() -> None:
    if not STORIES_GGUF.is_file():
        pytest.skip("stories260K.gguf not present")
    from .test_stories import CONTINUATION

    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
    assert llm.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=80))
    assert out.text.startswith(CONTINUATION)


def padded_stories_model():
    """The stories HF twin with the FFN padded from 172 to 192 with zeros (whole Q8_0
    blocks); the extra units output silu(0) * 0 = 0, so the logits are unchanged."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from .conftest import STORIES_HF

    source = AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    config = source.config
    config.intermediate_size = 192
    padded = LlamaForCausalLM(config)
    state = source.state_dict()
    for name, tensor in list(state.items()):
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            state[name] = torch.cat([tensor, torch.zeros(192 - tensor.shape[0], tensor.shape[1])])
        elif name.endswith("down_proj.weight"):
            state[name] = torch.cat([tensor, torch.zeros(tensor.shape[0], 192 - tensor.shape[1])], dim=1)
    padded.load_state_dict(state)
    return padded.eval()


def test_stories_q8_0_first_40_tokens(tmp_path) -> None:
    if not STORIES_GGUF.is_file():
        pytest.skip("stories260K.gguf not present")
    path = tmp_path / "stories-q8_0.gguf"
    write_gguf(path, padded_stories_model(), Q.Q8_0)
    params = SamplingParams(temperature=0, max_tokens=40)
    [reference] = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64).generate("Once upon a time", params)
    [quantized] = LLM(path, device="cpu", num_kv_blocks=64).generate("Once upon a time", params)
    assert quantized.token_ids == reference.token_ids
    assert quantized.text.startswith(", there was a little girl named Lily")


# -- llama.cpp as the oracle ------------------------------------------------------------

K_QUANTS = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"]


def llama_cpp_logits(path, tokens: list[int]) -> torch.Tensor:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False,
                          n_threads=2, seed=0)
    llm.eval(tokens)
    logits = torch.tensor(llm.scores[: len(tokens)], dtype=torch.float32)
    llm.close()
    return logits


def llama_cpp_quantize(source, target, ftype_name: str) -> None:
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert status == 0, f"llama.cpp could not quantize to {ftype_name}"


def compare_with_oracles(path, model) -> tuple[float, float]:
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    prompt = [1, *random_prompt(47, seed=11)]
    # GGUF's quantized weights meet int8-rounded x, as in llama.cpp.
    ours = all_logits(engine, [prompt])[0]
    # fp32 activations in every matmul, as the dequantized fp32 model computes them.
    exact_engine = Engine(path, EngineConfig(num_kv_blocks=32, exact_cpu_matmul=True), device="cpu", dtype=torch.float32)
    exact = all_logits(exact_engine, [prompt])[0]
    versus_dequantized = relative_error(exact, hf_logits(dequantized_reference(path, model), prompt))
    versus_llama_cpp = relative_error(ours, llama_cpp_logits(path, prompt))
    print(f"\n{path.name}: vs dequantized {versus_dequantized:.1e}, vs llama.cpp {versus_llama_cpp:.1e}")
    return versus_dequantized, versus_llama_cpp


@pytest.mark.parametrize("qtype", SIMPLE_TYPES, ids=lambda t: t.name)
def test_simple_types_match_llama_cpp(tmp_path, model, qtype) -> None:
    pytest.importorskip("llama_cpp")
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, model, qtype)
    versus_dequantized, versus_llama_cpp = compare_with_oracles(path, model)
    assert versus_dequantized <= 1e-4 and versus_llama_cpp <= 3e-2


@pytest.mark.parametrize("ftype", K_QUANTS)
def test_k_quants_from_llama_cpp_quantizer(tmp_path, model, ftype: str) -> None:
    pytest.importorskip("llama_cpp")
    source = tmp_path / "tiny-f32.gguf"
    write_gguf(source, model, Q.F32)
    path = tmp_path / f"tiny-{ftype}.gguf"
    llama_cpp_quantize(source, path, ftype)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types & {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}, types
    versus_dequantized, versus_llama_cpp = compare_with_oracles(path, model)
    assert versus_dequantized <= 1e-4 and versus_llama_cpp <= 3e-2


def test_bad_gguf_models_fail_cleanly(tmp_path, model) -> None:
    from localserve import LocalserveError

    missing = tmp_path / "missing.gguf"
    write_gguf(missing, model, Q.F16, exclude=("blk.1.ffn_down.weight",))
    with pytest.raises(LocalserveError, match="missing 1 tensors"):
        LLM(missing, device="cpu", num_kv_blocks=8)

    def minimal(path, arch: str, tensor_type, extra: dict | None = None) -> None:
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_embedding_length(256)
        writer.add_head_count(4)
        writer.add_block_count(1)
        writer.add_feed_forward_length(512)
        for key, value in (extra or {}).items():
            writer.add_uint32(key, value)
        rows = 512
        nbytes = rows * 256 // gguf.GGML_QUANT_SIZES[tensor_type][0] * gguf.GGML_QUANT_SIZES[tensor_type][1]
        writer.add_tensor("token_embd.weight", np.zeros((rows, nbytes // rows), dtype=np.uint8), raw_dtype=tensor_type)
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))  # the one layer block_count says
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    import numpy as np

    unsupported_type = tmp_path / "q8_k.gguf"
    minimal(unsupported_type, "llama", Q.Q8_K)  # llama.cpp's activation type, never a weight
    with pytest.raises(LocalserveError, match="Q8_K.*token_embd|token_embd.*Q8_K"):
        LLM(unsupported_type, device="cpu", num_kv_blocks=8)
    other_arch = tmp_path / "gpt2.gguf"
    minimal(other_arch, "gpt2", Q.F16)
    with pytest.raises(LocalserveError, match="architecture 'gpt2' is not supported"):
        LLM(other_arch, device="cpu", num_kv_blocks=8)
    moe = tmp_path / "moe.gguf"
    minimal(moe, "llama", Q.F16, {"llama.expert_count": 8})
    with pytest.raises(LocalserveError, match="expert_used_count"):
        LLM(moe, device="cpu", num_kv_blocks=8)
    moe_without_experts = tmp_path / "moe-empty.gguf"
    minimal(moe_without_experts, "llama", Q.F16, {"llama.expert_count": 8, "llama.expert_used_count": 2})
    with pytest.raises(LocalserveError, match="missing"):
        LLM(moe_without_experts, device="cpu", num_kv_blocks=8)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(LocalserveError, match="GGUF"):
        LLM(not_gguf, device="cpu", num_kv_blocks=8)


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_K_M"])
def test_four_bit_gguf_weights_stay_about_file_size(tmp_path, model, ftype: str) -> None:
    """Every weight the engine holds (embeddings and LM head included) against the bytes
    of all tensors in the file and against fp16. Measured 1.10x (Q4_0) and 1.12x
    (Q4_K_M): the Q6_K tensors llama.cpp picks for the LM head (and, in Q4_K_M, some
    attn_v/ffn_down) hold their 6-bit codes in a byte each."""
    from localserve.formats.gguf_file import read_gguf

    source = tmp_path / "tiny-f32.gguf"
    write_gguf(source, model, Q.F32)
    path = tmp_path / f"tiny-{ftype}.gguf"
    llama_cpp_quantize(source, path, ftype)
    gguf_file = read_gguf(path)
    file_bytes = sum(info.nbytes for info in gguf_file.tensors.values() if len(info.shape) == 2)
    engine = Engine(path, EngineConfig(num_kv_blocks=8), device="cpu", dtype=torch.float32)
    linears = list(engine.model.linears())
    held = sum(linear.nbytes for linear in linears)
    fp16_bytes = sum(linear.in_features * sum(linear.part_sizes) * 2 for linear in linears)
    print(f"\n{ftype}: weights {held} bytes in memory, {file_bytes} in the file, {fp16_bytes} as fp16")
    assert held <= 1.15 * file_bytes and held < 0.4 * fp16_bytes


def test_load_finalizes_each_projection_as_it_completes(tmp_path) -> None:
    """Each projection is handed on (tiled, on the CPU) once its last part is read, so
    the checkpoint's layout of it is freed before the next weights come; a tensor that
    comes twice is refused."""
    from localserve.errors import LocalserveError
    from localserve.formats import open_checkpoint
    from localserve.models import LlamaForCausalLM, load_weights

    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(path, tiny_llama(), Q.Q8_0)
    checkpoint = open_checkpoint(path)
    read: list[str] = []
    completed: list[tuple[int, object]] = []

    def named():  # type: ignore[no-untyped-def]
        for name, weight in checkpoint.weights():
            read.append(name)
            yield name, weight

    model = LlamaForCausalLM(checkpoint.spec, 64, torch.device("cpu"))
    load_weights(model, named(), on_complete=lambda linear: completed.append((len(read), linear)))
    assert {id(linear) for _, linear in completed} == {id(linear) for linear in model.linears()}
    assert len(completed) == len(model.linears())  # once each
    assert completed[0][0] < len(read) / 2  # not all at the end

    twice = [*checkpoint.weights(), next(iter(checkpoint.weights()))]
    with pytest.raises(LocalserveError, match="appears twice"):
        load_weights(LlamaForCausalLM(checkpoint.spec, 64, torch.device("cpu")), twice)


def test_a_huge_declared_context_is_capped_to_the_pool(tmp_path) -> None:
    """A file declaring 2**28 positions: the model's rotary tables are sized by what the KV
    pool can hold, not by the declaration (before: > 7 GiB allocated at load)."""
    hostile = tiny_llama()
    hostile.config.max_position_embeddings = 1 << 28
    path = tmp_path / "long.gguf"
    write_gguf(path, hostile, Q.F16)
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    assert llm.engine.max_model_len == 64 * 16
    assert llm.engine.model.rotary.cos.shape[0] == 64 * 16
    [out] = llm.generate([[1, 5, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.token_ids) == 4
