"""8-bit KV caches (int8 and float8 e4m3, per-token scales) end to end: accuracy
against transformers, memory, and blocks that keep their scales when they move."""

from __future__ import annotations

import pytest
import torch

from localserve import LLM, Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.engine.kv_cache import kv_bytes_per_block

from .conftest import STORIES_HF, hf_logits, random_prompt, relative_error
from .test_engine import MAX_TOKENS, PROMPTS, run_engine
from .test_models import all_logits
from .test_stories import CONTINUATION


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball. She wanted to play with it, but it was too high. She asked her mom")

# Relative max logit error allowed against transformers, per cache dtype. Measured on
# the stories model: int8 2.7e-2, fp8 9.5e-2 (e4m3 keeps 3 mantissa bits).
LOGIT_ERROR = {"int8": 4e-2, "fp8": 0.15}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_stories_logits_stay_close(kv_cache_dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    engine = Engine(STORIES_HF, EngineConfig(num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype), device="cpu")
    ids = engine.tokenizer.encode(STORY)
    [ours] = all_logits(engine, [ids])
    reference = hf_logits(hf, ids)
    error = relative_error(ours, reference)
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"\n{kv_cache_dtype} KV cache, {len(ids)} positions: logits relative max error {error:.2e}, "
          f"argmax agrees at {agree:.1%}")
    assert error <= LOGIT_ERROR[kv_cache_dtype]
    assert agree >= (1.0 if kv_cache_dtype == "int8" else 0.95)


def test_stories_int8_greedy_is_the_known_continuation() -> None:
    llm = LLM(STORIES_HF, device="cpu", num_kv_blocks=256, kv_cache_dtype="int8")
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=80))
    assert out.text.startswith(CONTINUATION)
    assert llm.engine.stats().kv_cache_dtype == "int8"


def test_random_llama_logits_stay_close(llama) -> None:
    path, hf = llama
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 150)]
    # Measured: int8 2.1e-2, fp8 1.0e-1 (other seeds: int8 1.1-1.7e-2, fp8 4.9-9.9e-2).
    for kv_cache_dtype, bound in (("int8", 3e-2), ("fp8", 0.15)):
        engine = Engine(path, EngineConfig(num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype), device="cpu")
        errors = [relative_error(ours, hf_logits(hf, p)) for p, ours in zip(prompts, all_logits(engine, prompts))]
        print(f"\n{kv_cache_dtype}: logits relative max error {max(errors):.2e} (random tiny Llama)")
        assert max(errors) <= bound


def test_8bit_blocks_take_about_half_of_fp16(llama) -> None:
    path, _ = llama
    spec = Engine(path, EngineConfig(num_kv_blocks=4), device="cpu").spec
    fp16, fp32 = (kv_bytes_per_block(spec, 16, dtype) for dtype in (torch.float16, torch.float32))
    for dtype in (torch.int8, torch.float8_e4m3fn):
        # Per token, layer and head: K and V codes (1 byte each per dim) plus a float32 scale each.
        assert kv_bytes_per_block(spec, 16, dtype) == spec.num_layers * 16 * spec.num_kv_heads * 2 * (spec.head_dim + 4)
    assert kv_bytes_per_block(spec, 16, torch.int8) / fp16 == pytest.approx((spec.head_dim + 4) / (2 * spec.head_dim))

    # The same memory holds that many more blocks (fp32 is the CPU's model dtype).
    memory = 100 * fp32
    blocks = {kv: Engine(path, EngineConfig(kv_cache_memory=memory, kv_cache_dtype=kv), device="cpu").stats()
              for kv in ("auto", "int8")}
    assert blocks["auto"].kv_blocks_total == 100 and blocks["auto"].kv_cache_dtype == "float32"
    assert blocks["int8"].kv_blocks_total == memory // kv_bytes_per_block(spec, 16, torch.int8)
    assert blocks["int8"].kv_cache_dtype == "int8"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_swapped_and_cached_blocks_keep_their_scales(llama, kv_cache_dtype: str) -> None:
    """Swapping out and in, and prefix hits, under pressure: outputs equal an
    unconstrained run with the same cache dtype, which they would not if a block's
    scales were left behind."""
    path, _ = llama

    def run(**options: int | bool) -> tuple[list[list[int]], dict]:
        config = EngineConfig(max_num_batched_tokens=128, kv_cache_dtype=kv_cache_dtype, **options)
        engine = Engine(path, config, device="cpu")
        # Every prompt twice: the second copies hit the prefix cache.
        outputs, _ = run_engine(engine, PROMPTS + PROMPTS, MAX_TOKENS + MAX_TOKENS)
        return outputs, engine.stats()

    unconstrained, _ = run(num_kv_blocks=1024, enable_prefix_caching=False)
    blocks_needed = sum(-(-(len(p) + m) // 16) for p, m in zip(PROMPTS, MAX_TOKENS))
    pressured, stats = run(num_kv_blocks=blocks_needed // 4, num_cpu_blocks=512)
    assert stats.swap_in_blocks > 0 and stats.prefix_cache_hits > 0
    assert pressured == unconstrained


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(LocalserveError, match="kv_cache_dtype 'int4' is not one of auto, fp32, fp16, bf16, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")


def test_a_quantized_gguf_on_the_cpu_gets_an_fp16_cache_by_default(tmp_path) -> None:
    """auto on the CPU: fp16 for a GGUF of quantized weights (llama.cpp's default), fp32 for a
    dense one and with exact_cpu_matmul; a named dtype wins; fit plans what the engine makes."""
    gguf = pytest.importorskip("gguf")
    from localserve.facts.fit import plan

    from .gguf_writers import tiny_llama, write_gguf

    quantized, dense = tmp_path / "q8.gguf", tmp_path / "f32.gguf"
    model = tiny_llama()
    write_gguf(quantized, model, gguf.GGMLQuantizationType.Q8_0)
    write_gguf(dense, model, gguf.GGMLQuantizationType.F32)
    cases = [(quantized, {}, torch.float16), (dense, {}, torch.float32),
             (quantized, {"exact_cpu_matmul": True}, torch.float32), (quantized, {"kv_cache_dtype": "fp32"}, torch.float32),
             (quantized, {"kv_cache_dtype": "bf16"}, torch.bfloat16), (dense, {"kv_cache_dtype": "fp16"}, torch.float16)]
    for path, options, expected in cases:
        config = EngineConfig(num_kv_blocks=8, **options)
        engine = Engine(path, config, device="cpu")
        assert engine.kv_dtype == expected and engine.runner.kv_caches[0].key.dtype == expected, (path.name, options)
        assert plan(path, config=config).kv_dtype == expected, (path.name, options)
    # Half the bytes of an fp32 cache per block.
    assert kv_bytes_per_block(engine.spec, 16, torch.float16) * 2 == kv_bytes_per_block(engine.spec, 16, torch.float32)
    # It serves: a greedy reply through the 16-bit cache.
    [out] = LLM(quantized, device="cpu", num_kv_blocks=8).generate([[1, 5, 9, 13]], SamplingParams(max_tokens=5,
                                                                                                  ignore_eos=True))
    assert len(out.token_ids) == 5
