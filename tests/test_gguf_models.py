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
    engine = Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32)
    prompts = [random_prompt(n, seed=n) for n in (1, 37)]
    for prompt, ours in zip(prompts, all_logits(engine, prompts)):
        assert relative_error(ours, hf_logits(reference, prompt)) <= 1e-4


def test_stories_gguf_greedy() -> None:
    if not STORIES_GGUF.is_file():
        pytest.skip("stories260K.gguf not present")
    from .test_stories import CONTINUATION

    llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
    assert llm.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=80))
    assert out.text.startswith(CONTINUATION)
