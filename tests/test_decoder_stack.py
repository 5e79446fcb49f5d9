"""The CPU's decoder stack (kernels/csrc/decoder_layers.cpp through models/cpu_stack.py):
every layer of a step in one C++ call. It must compute what the modules compute, one torch
op and kernel call at a time (the path it replaces, itself checked against transformers
and llama.cpp in test_models.py and test_gguf_models.py), for every layer variant it takes:
q/k/v and MLP biases, per-head q/k norms, sandwich norms and soft caps, sliding windows,
two rotary tables, partial rotary, GeGLU, residual scales; dense fp32 weights and tiled
quantized ones, a fused projection whose parts differ in type (llama.cpp's Q4_K_M mixes)."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig
from localserve.kernels import cpu_library
from localserve.kernels.decoder_cpu import DecoderStack
from localserve.models import llama as llama_module

from .conftest import random_prompt, relative_error
from .gguf_writers import tiny_llama, write_gguf
from .test_models import all_logits

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels were not built")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

PROMPTS = [[1, *random_prompt(40, seed=3)], [1, *random_prompt(29, seed=4)]]
# Tiny models of one layer kind each (tests/conftest.py), all dense fp32 weights.
HF_KINDS = ["llama-bias", "llama3-rope", "qwen2", "qwen2-swa", "qwen3", "mistral-swa", "granite", "phi3-longrope",
            "gemma2", "gemma3"]


def stack_and_module_logits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """Logits of PROMPTS (in one batch, prefilled in chunks of 16 then 7 at a time) by
    the stack, then by the modules."""
    chunks = [16, 7, 7, 7, 7, 7]
    stacked = all_logits(engine, PROMPTS, chunks)
    assert isinstance(engine.model._stack[1], DecoderStack), "the stack did not run"
    with monkeypatch.context() as patch:
        patch.setattr(llama_module, "stack_for", lambda *args: None)
        engine.model._stack = None
        modules = all_logits(engine, PROMPTS, chunks)
    engine.model._stack = None
    return stacked, modules


def assert_close(stacked: list, modules: list, bound: float) -> None:
    for ours, theirs in zip(stacked, modules):
        error = relative_error(ours, theirs)
        assert error <= bound, f"{error:.1e} from the modules"


@pytest.mark.parametrize("kind", HF_KINDS)
def test_dense_layers_match_the_modules(tiny_models, monkeypatch, kind: str) -> None:
    path, _ = tiny_models.get(kind)
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    assert_close(*stack_and_module_logits(engine, monkeypatch), bound=1e-5)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("stack") / "tiny-f32.gguf"
    write_gguf(path, tiny_llama(), Q.F32)
    return path


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "Q6_K"])
def test_quantized_layers_match_the_modules(tmp_path, tiny_f32, monkeypatch, ftype: str) -> None:
    from .test_gguf_models import llama_cpp_quantize

    path = tmp_path / f"tiny-{ftype}.gguf"
    llama_cpp_quantize(tiny_f32, path, ftype)
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    stacked, modules = stack_and_module_logits(engine, monkeypatch)
    if ftype == "Q4_K_M":  # llama.cpp's mix: Q6_K V rows beside Q4_K Q and K in one projection
        assert any(len(layer.attn.qkv.weights) > 1 for layer in engine.model.layers)
    # The glue's float order differs by an ulp here and there, and where an activation lies
    # at a rounding boundary that flips its int8 code by one step (amax / 127): a few such
    # flips move these logits by up to ~6e-3 (a wrong rotary, bias or cache write: by O(1)).
    assert_close(stacked, modules, bound=2e-2)


def quantized_moe(tmp_path, kind: str, ftype: str) -> Engine:
    from .gguf_writers import tiny_moe
    from .test_gguf_models import llama_cpp_quantize

    source = tmp_path / f"{kind}-f32.gguf"
    write_gguf(source, tiny_moe(kind), Q.F32)
    path = tmp_path / f"{kind}-{ftype}.gguf"
    llama_cpp_quantize(source, path, ftype)
    return Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_mixtures_of_experts_match_the_modules(tmp_path, monkeypatch, kind: str, ftype: str) -> None:
    """Experts tiled for the int8 kernel run inside the stack: routing (softmax, top-k,
    Qwen3's renormalized gates), the chosen experts grouped, their outputs weighted and summed."""
    stacked, modules = stack_and_module_logits(quantized_moe(tmp_path, kind, ftype), monkeypatch)
    # As for the dense layers, plus the router: its logits are ~4 apart (4x scale), so an ulp
    # does not change which experts a token takes.
    assert_close(stacked, modules, bound=2e-2)


def test_what_the_stack_does_not_take_runs_the_modules(tmp_path, tiny_models, tiny_f32) -> None:
    path, _ = tiny_models.get("mixtral")
    moe = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    all_logits(moe, PROMPTS[:1])
    assert moe.model._stack is not None and moe.model._stack[1] is None  # fp32 experts, not tiled
    shared_expert = quantized_moe(tmp_path, "qwen2_moe", "Q8_0")
    all_logits(shared_expert, PROMPTS[:1])
    assert shared_expert.model._stack is not None and shared_expert.model._stack[1] is None
    int8_cache = Engine(tiny_f32, EngineConfig(num_kv_blocks=32, kv_cache_dtype="int8"), device="cpu",
                        dtype=torch.float32)
    all_logits(int8_cache, PROMPTS[:1])
    assert int8_cache.model._stack is not None and int8_cache.model._stack[1] is None


def test_a_slot_outside_the_cache_is_refused(tiny_f32) -> None:
    from localserve.engine.runner import scratch_prefill

    engine = Engine(tiny_f32, EngineConfig(num_kv_blocks=4), device="cpu", dtype=torch.float32)
    inputs = scratch_prefill(3, [0], engine.config.block_size, engine.device)
    inputs.meta.slot_mapping[2] = 4 * engine.config.block_size  # one past the last slot
    with pytest.raises(ValueError, match="outside the cache"), torch.inference_mode():
        engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16"])
def test_half_caches_are_written_as_torch_rounds_them(tiny_models, monkeypatch, kv_cache_dtype: str) -> None:
    """With a 16-bit cache the stack narrows K and V as torch's .to() does, and reads them as
    the modules do; its logits stay near an fp32 cache's."""
    path, _ = tiny_models.get("gemma2")  # soft caps and a sliding window read the cache too
    chunks = [16, 7, 7, 7, 7, 7]

    def run(kv: str, stack: bool) -> tuple[Engine, list]:
        engine = Engine(path, EngineConfig(num_kv_blocks=32, kv_cache_dtype=kv), device="cpu", dtype=torch.float32)
        for cache in engine.runner.kv_caches:  # unwritten slots alike in every run
            cache.key.zero_()
            cache.value.zero_()
        with monkeypatch.context() as patch:
            if not stack:
                patch.setattr(llama_module, "stack_for", lambda *args: None)
            logits = all_logits(engine, PROMPTS, chunks)
        assert isinstance(engine.model._stack[1], DecoderStack) == stack
        return engine, logits

    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[kv_cache_dtype]
    stacked_engine, stacked = run(kv_cache_dtype, stack=True)
    full_engine, full = run("auto", stack=True)
    # The first layer's K and V do not depend on the cache's type: the half cache holds the fp32
    # cache's values rounded by torch, bit for bit (ties to even, in every written slot).
    ours, fp32 = stacked_engine.runner.kv_caches[0], full_engine.runner.kv_caches[0]
    assert ours.key.dtype == half
    assert torch.equal(ours.key.view(torch.int16), fp32.key.to(half).view(torch.int16))
    assert torch.equal(ours.value.view(torch.int16), fp32.value.to(half).view(torch.int16))
    _, modules = run(kv_cache_dtype, stack=False)
    # The glue rounds an ulp differently here and there (see above), which a 16-bit cache
    # can turn into one step of its own: ~3e-4 here, 1.5e-3 for bf16 on an AVX512-BF16 host,
    # whose torch reads bf16 its own way; one bf16 step is 2^-8 of a value (a wrong
    # conversion or read: O(1)).
    assert_close(stacked, modules, bound={"fp16": 1e-3, "bf16": 8e-3}[kv_cache_dtype])
    # Against an fp32 cache: fp16 keeps 11 bits of each value, bf16 8 (4.4e-3 and 5.0e-2 here).
    assert_close(stacked, full, bound={"fp16": 1e-2, "bf16": 1e-1}[kv_cache_dtype])
