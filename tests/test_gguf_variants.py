"""Granite, Gemma 2, Gemma 3 and Phi-3 as GGUF files laid out by llama.cpp's converter
conventions (Granite's Q/K rows permuted and its multipliers in metadata; Gemma's norms
stored as 1 + w, its post-attention and post-MLP norms, soft caps and sliding window in
metadata, and what llama.cpp fixes in code: the window pattern, Gemma 3's local rotary base;
Phi-3's fused attn_qkv and gate+up ffn_up, longrope's factor sets as tensors and its cos/sin
scale in metadata), over a prompt four times the window: our logits against llama.cpp on an
F32 file, and against gguf-py's dequantization (in transformers) on a Q8_0 one.

Phi-3's longrope picks its factor set by the context: llama.cpp by the context it serves
(128 here, past the 64-token original: the long set), transformers by each forward's length
(48 here: the short set); our engine by the context it serves, so each comparison serves the
context its oracle picks by.

The llama.cpp comparison is on F32 weights: with 8-bit weights, llama.cpp rounds every
matmul's activations to 8 bits, and on these random tiny Gemmas (norm gains of 1.5 to 2.5
around both blocks) that rounding alone moves llama.cpp's logits 0.1 to 0.19 from its own
fp32 result, and ours, which round the same way, as far; at F32 the two agree to its f16 KV
cache's rounding (about 5e-3). The Q8_0 file is checked exactly against transformers."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig
from localserve.formats import open_checkpoint
from localserve.formats.layout import check_tensors

from .conftest import hf_logits, random_prompt, relative_error
from .gguf_writers import dequantized_reference, tiny_variant, write_gguf
from .test_gguf_models import llama_cpp_logits
from .test_models import all_logits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROMPT = [1, *random_prompt(47, seed=11)]


@pytest.fixture(scope="module", params=["granite", "gemma2", "gemma3", "phi3"])
def variant(request):
    return request.param, tiny_variant(request.param)


def test_f32_file_matches_llama_cpp(tmp_path, variant) -> None:
    pytest.importorskip("llama_cpp")
    kind, model = variant
    path = tmp_path / f"{kind}-f32.gguf"
    write_gguf(path, model, Q.F32)
    ours = all_logits(Engine(path, EngineConfig(num_kv_blocks=32), device="cpu", dtype=torch.float32), [PROMPT])[0]
    error = relative_error(ours, llama_cpp_logits(path, PROMPT))
    assert error <= 1e-2, f"{kind}: {error:.1e} from llama.cpp"


def test_q8_0_file_matches_its_dequantization(tmp_path, variant) -> None:
    kind, model = variant
    path = tmp_path / f"{kind}-q8_0.gguf"
    write_gguf(path, model, Q.Q8_0)
    check_tensors(open_checkpoint(path))  # what pull checks: every tensor belongs, none is missing
    # Phi-3: served within its original context, where transformers' short factors hold.
    context = 64 if kind == "phi3" else None
    engine = Engine(path, EngineConfig(num_kv_blocks=32, exact_cpu_matmul=True, max_model_len=context), device="cpu",
                    dtype=torch.float32)
    assert engine.model.spec.architecture == kind
    error = relative_error(all_logits(engine, [PROMPT])[0], hf_logits(dequantized_reference(path, model), PROMPT))
    assert error <= 1e-4, f"{kind}: {error:.1e} from transformers on the dequantized weights"
