"""Batch invariance on the CPU: a request's tokens and logprobs are the same bits alone,
among 1..63 other requests, and while other prompts are mid-prefill (chunked), for GGUF's
types (gguf-py's and llama.cpp's quantizers) and for GPTQ and AWQ checkpoints.

It holds by construction: every CPU kernel computes a row with the same operations in the
same order whatever else shares the step (kernels/csrc), and attention computes a prompt
row exactly as a decode at its position, so chunking a prompt changes nothing either."""

from __future__ import annotations

import pytest
import torch

from localserve import LLM, SamplingParams
from localserve.kernels import cpu_library

from .conftest import DATA, random_prompt
from .gguf_writers import tiny_llama, write_gguf

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels were not built")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TARGET = [1, *random_prompt(40, seed=5)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)


def others(count: int, vocab: int) -> list[list[int]]:
    """Prompts of 3 to 150 tokens: the long ones are still prefilling, a chunk a step,
    while the target decodes."""
    return [[1, *torch.randint(3, vocab, (3 + (37 * i) % 148,), generator=torch.Generator().manual_seed(i)).tolist()]
            for i in range(count)]


def fingerprint(output) -> tuple:  # type: ignore[no-untyped-def]
    return (output.token_ids, [(t.token_id, t.logprob, t.top) for t in output.logprobs])


def check_invariance(path, vocab: int) -> None:  # type: ignore[no-untyped-def]
    # A 64-token budget per step: in a crowd the target's own prompt is split into chunks too.
    llm = LLM(path, device="cpu", num_kv_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False)
    [alone] = llm.generate(TARGET, PARAMS)
    for count in (1, 7, 63):
        crowd = others(count, vocab)
        # The target in the middle of the crowd: some requests are admitted before it.
        prompts = crowd[: count // 2] + [TARGET] + crowd[count // 2 :]
        params = [SamplingParams(temperature=0, max_tokens=3 + i % 20, ignore_eos=True) for i in range(count + 1)]
        params[count // 2] = PARAMS
        outputs = llm.generate(prompts, params)
        assert fingerprint(outputs[count // 2]) == fingerprint(alone), f"differs among {count} others"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model = tiny_llama()
    source = tmp_path_factory.mktemp("invariance") / "tiny-f32.gguf"
    write_gguf(source, model, Q.F32)
    return model, source


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_gguf_py_types(tmp_path, tiny, qtype) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, tiny[0], qtype)
    check_invariance(path, vocab=512)


@pytest.mark.parametrize("ftype", ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"])
def test_llama_cpp_k_quants(tmp_path, tiny, ftype: str) -> None:  # type: ignore[no-untyped-def]
    from .test_gguf_models import llama_cpp_quantize

    path = tmp_path / f"tiny-{ftype}.gguf"
    llama_cpp_quantize(tiny[1], path, ftype)
    check_invariance(path, vocab=512)


@pytest.mark.parametrize("name", ["tiny-gptq-4bit-g32-actorder", "tiny-awq-4bit-g64"])
def test_gptq_and_awq(name: str) -> None:
    path = DATA / "models" / name
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    check_invariance(path, vocab=vocab)
