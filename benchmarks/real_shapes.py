"""localserve against llama.cpp at real model shapes, side by side on the same GGUF files.

    python benchmarks/llama_server.py                      # once: build llama-server (~20 min)
    python benchmarks/real_shapes.py                       # Llama-3.2-1B shape, Q4_K_M and Q8_0
    python benchmarks/real_shapes.py --shapes qwen2.5-1.5b --types Q4_K_M --repeats 3
    python benchmarks/real_shapes.py --workloads pp512 one 16 --json out.json

Models: random weights at a real model's shape (layers, widths, heads, vocabulary, tied
embeddings, q/k/v bias) written as F16 GGUF with a synthetic SentencePiece vocabulary of
the real size, then quantized by llama.cpp's own quantizer (through llama-cpp-python).
Files are cached in ``$LOCALSERVE_BENCH_CACHE`` (default ``~/.cache/localserve-bench``).

Workloads (each system started in turn, one at a time, with the same thread count):

* ``pp512``: prompt processing of one 512-token prompt, offline: localserve's engine
  (a request with one output token) against llama-cpp-python's ``eval``; tokens/s.
* ``one``: one client, 128 in / 64 out, through each server; TPOT and output tokens/s.
* ``offline``: the same stream in-process, no server: localserve's engine against
  llama-cpp-python's ``eval``; TPOT (what ``one`` costs beyond it is the HTTP path's).
* ``16``, ``32``: that many clients, random prompts of 64 in / 32 out (the issue's
  workload); output tokens/s. llama-server runs with ``-np N -c N*ctx``.
* ``prefix``: 32 clients whose prompts share a 512-token system prompt, then 32 own
  tokens, 32 out; output tokens/s.
* ``pp8k``: prompt processing of one 8,000-token prompt, offline (llama.cpp with flash
  attention); tokens/s.
* ``8k``: one client, 8,000 in / 64 out, through each server: TPOT at 8k of context (and the
  prompt's tokens/s from the time to the first token, in the extras).

llama-server runs with flash attention on (``-fa on``); both keep K and V in fp16.

Every server's peak RSS (VmHWM) is recorded, and how long its first request (16 in, 8 out) takes
once it reports ready with the model loaded. With --repeats R each workload runs R times,
the systems interleaved, and the report gives the median and the spread (min-max).
The ratio column is localserve's figure over llama.cpp's (above 1: localserve is better;
for TPOT and RSS, where lower is better, llama.cpp's over localserve's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_server  # noqa: E402
from servers import free_port, serving  # noqa: E402


# A Gemma 3 style chat template (turns; an image part is <start_of_image>), for Gemma-3-4B's shape.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' or p.type == 'image_url' %}<start_of_image>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


# Qwen2-VL's chat template, cut to turns and images (<|vision_start|><|image_pad|><|vision_end|>).
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' or p.type == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    qkv_bias: bool = False
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    head_dim: int | None = None
    sliding_window: int = 0  # Gemma 2: every other layer slides
    pooling: str = ""  # an embedding model's (gguf.PoolingType's name), its tokenizer appending EOS
    tied: bool = True  # the LM head is the embedding table (else an output.weight of its own)
    chat_template: str = ""  # written to the file (the image benchmarks render chats with it)


SHAPES = {
    "llama-3.2-1b": Shape("llama", 16, 2048, 32, 8, 8192, 128256, 500000.0),
    # The 8B shapes people run: ~4.9 GB at Q4_K_M, an untied LM head (Q6_K in that mix). Their
    # F16 source (16 GB) is written tensor by tensor, never whole in memory.
    # A draft model for Llama-3.2-1B's shape (benchmarks/speculative.py): its first 2 layers,
    # embeddings and head. write_random_gguf draws each tensor in file order from one seed,
    # so a shape that differs only in its layer count gets the very same leading tensors.
    "llama-3.2-1b-draft": Shape("llama", 2, 2048, 32, 8, 8192, 128256, 500000.0),
    "llama-3.1-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, 500000.0, tied=False),
    "qwen3-8b": Shape("qwen3", 36, 4096, 32, 8, 12288, 151936, 1000000.0, head_dim=128, tied=False),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 8960, 151936, 1000000.0, qkv_bias=True),
    # Gemma-2-2B: GeGLU, four norms a layer, soft caps 50/30, a 4,096 window on every other
    # layer, heads of 256, a 256,000-token vocabulary (tied).
    "gemma-2-2b": Shape("gemma2", 26, 2304, 8, 4, 9216, 256000, 10000.0, head_dim=256, sliding_window=4096),
    # Gemma-3-4B's text model: q/k norms, four norms a layer, 5 sliding layers (window 1,024) to 1
    # full, heads of 256, its 262,208-token vocabulary with the image tokens (benchmarks/image_ttft.py).
    "gemma-3-4b": Shape("gemma3", 34, 2560, 8, 4, 10240, 262208, 1000000.0, head_dim=256, sliding_window=1024,
                        chat_template=GEMMA3_TEMPLATE),
    # Qwen2.5-VL-3B's text model: Qwen2's (q/k/v biases, tied), M-RoPE in sections of 16, 24 and 24
    # frequency pairs, its 151,936-token vocabulary with the turn and vision tokens.
    "qwen2.5-vl-3b": Shape("qwen2vl", 36, 2048, 16, 2, 11008, 151936, 1000000.0, qkv_bias=True,
                           chat_template=QWEN_VL_TEMPLATE),
    # Qwen3-30B-A3B's layer (128 experts, 8 used, expert FFN 768, head_dim 128) at 12 layers
    # and hidden 1024 so its F16 source fits this machine's memory.
    "qwen3-moe-small": Shape("qwen3moe", 12, 1024, 16, 4, 0, 151936, 1000000.0, experts=128, experts_used=8,
                             expert_ffn=768, head_dim=128),
    # Qwen3-Embedding-0.6B: a Qwen3 decoder (q/k norms, tied), last-token pooling over the
    # EOS its tokenizer appends (benchmarks/embeddings.py).
    "qwen3-embedding-0.6b": Shape("qwen3", 28, 1024, 16, 8, 3072, 151669, 1000000.0, head_dim=128, pooling="LAST"),
}


# -- models -----------------------------------------------------------------------------------

def model_path(shape_name: str, ftype: str) -> Path:
    cache = llama_server.cache_dir() / "models"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{shape_name}-{ftype}.gguf"
    if target.exists():
        return target
    source = cache / f"{shape_name}-F16.gguf"
    if not source.exists():
        write_random_gguf(source, SHAPES[shape_name])
    quantize(source, target, ftype)
    return target


def write_random_gguf(path: Path, shape: Shape, random_blocks: bool = False) -> None:
    """Random F16 weights (std 1/sqrt(fan_in); embeddings at std 1) and a SentencePiece
    vocabulary of ``shape.vocab`` pieces: <unk>, <s>, </s>, the 256 byte pieces, then
    single characters.

    With ``random_blocks`` the matrices are written straight in Q4_K_M's types instead
    (random K-quant blocks: Q6_K for the LM head and V, Q4_K for the rest), where no
    quantizer is at hand (the GPU proof's machine has no llama.cpp); the same speed as a
    quantized file, with no F16 source."""
    import gguf

    print(f"writing {path.name} (random weights{', Q4_K_M blocks' if random_blocks else ''})", flush=True)
    rng = np.random.default_rng(0)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    writer = gguf.GGUFWriter(str(path.with_suffix(".partial")), shape.arch)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn or shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.rope_theta)
    if shape.arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(shape.sliding_window)
    if shape.arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if shape.chat_template:
        writer.add_chat_template(shape.chat_template)
    if shape.arch == "qwen2vl":
        writer.add_rope_dimension_sections([16, 24, 24, 0])
    if shape.pooling:
        writer.add_pooling_type(gguf.PoolingType[shape.pooling])
        writer.add_add_eos_token(True)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    # One character per piece (CJK onwards, surrogates skipped): text made of these pieces
    # tokenizes back to the same ids, so servers fed text see the intended prompt lengths.
    characters = [chr(c) for c in range(0x4E00, 0x4E00 + shape.vocab + 2048) if not 0xD800 <= c < 0xE000]
    words = ["\u2581", *characters[: shape.vocab - 260]]
    types = [1] * len(words)
    specials = {"gemma3": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                           "<image_soft_token>"],
                "qwen2vl": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"],
                }.get(shape.arch)
    if specials:  # the turn and image tokens, control tokens as in the model's vocabulary
        words[-len(specials):], types[-len(specials):] = specials, [3] * len(specials)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *words])
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))])
    writer.add_token_types([2, 3, 3, *[6] * 256, *types])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    # Each tensor's shape, type and how to make it, in file order; made (drawing from rng in
    # that order) and written one at a time, so an 8B model's 16 GB never sit in memory.
    plan: list[tuple[str, tuple[int, ...], type, object]] = []

    def add(name: str, rows: int, columns: int, std: float | None = None) -> None:
        scale = std if std is not None else columns ** -0.5
        if random_blocks:
            kind = "Q6_K" if name == "output.weight" or name.endswith("attn_v.weight") else "Q4_K"
            plan.append((name, (rows, columns), kind, lambda: random_quant_blocks(rng, kind, rows, columns, scale)))
            return
        plan.append((name, (rows, columns), np.float16,
                     lambda: (rng.standard_normal((rows, columns), dtype=np.float32) * scale).astype(np.float16)))

    def vector(name: str, size: int, value: float | None = None) -> None:
        plan.append((name, (size,), np.float32, lambda: np.full(size, value, np.float32) if value is not None
                     else rng.standard_normal(size, np.float32) * 0.02))

    add("token_embd.weight", shape.vocab, shape.hidden, std=1.0)  # tied: the LM head too
    vector("output_norm.weight", shape.hidden, 1.0)
    if not shape.tied:
        add("output.weight", shape.vocab, shape.hidden)
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    for i in range(shape.layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", shape.hidden, 1.0)
        vector(f"{b}.ffn_norm.weight", shape.hidden, 1.0)
        if shape.arch in ("gemma2", "gemma3"):  # their norms after attention and after the MLP
            vector(f"{b}.post_attention_norm.weight", shape.hidden, 1.0)
            vector(f"{b}.post_ffw_norm.weight", shape.hidden, 1.0)
        add(f"{b}.attn_q.weight", q, shape.hidden)
        add(f"{b}.attn_k.weight", kv, shape.hidden)
        add(f"{b}.attn_v.weight", kv, shape.hidden)
        add(f"{b}.attn_output.weight", shape.hidden, q)
        if shape.qkv_bias:
            vector(f"{b}.attn_q.bias", q)
            vector(f"{b}.attn_k.bias", kv)
            vector(f"{b}.attn_v.bias", kv)
        if shape.arch in ("qwen3", "qwen3moe", "gemma3"):
            vector(f"{b}.attn_q_norm.weight", head_dim, 1.0)
            vector(f"{b}.attn_k_norm.weight", head_dim, 1.0)
        if shape.experts:
            plan.append((f"{b}.ffn_gate_inp.weight", (shape.experts, shape.hidden), np.float32,
                         lambda: rng.standard_normal((shape.experts, shape.hidden), dtype=np.float32) * 0.1))
            for name, rows, columns in (("gate", shape.expert_ffn, shape.hidden), ("up", shape.expert_ffn, shape.hidden),
                                        ("down", shape.hidden, shape.expert_ffn)):
                if random_blocks:
                    plan.append((f"{b}.ffn_{name}_exps.weight", (shape.experts, rows, columns), "Q4_K",
                                 lambda rows=rows, columns=columns: random_quant_blocks(
                                     rng, "Q4_K", shape.experts * rows, columns, columns ** -0.5)))
                    continue
                plan.append((f"{b}.ffn_{name}_exps.weight", (shape.experts, rows, columns), np.float16,
                             lambda rows=rows, columns=columns: (rng.standard_normal(
                                 (shape.experts, rows, columns), dtype=np.float32) * columns ** -0.5).astype(np.float16)))
        else:
            add(f"{b}.ffn_gate.weight", shape.ffn, shape.hidden)
            add(f"{b}.ffn_up.weight", shape.ffn, shape.hidden)
            add(f"{b}.ffn_down.weight", shape.hidden, shape.ffn)
    for name, dims, dtype, _ in plan:
        if isinstance(dtype, str):  # K-quant blocks: the shape in bytes, the type named
            kind = gguf.GGMLQuantizationType[dtype]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            byte_dims = (*dims[:-1], dims[-1] // block * size)
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)), raw_dtype=kind)
            continue
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, _, make in plan:
        writer.write_tensor_data(make())  # type: ignore[operator]
    writer.close()
    path.with_suffix(".partial").replace(path)


def random_quant_blocks(rng: np.random.Generator, kind: str, rows: int, columns: int, std: float) -> np.ndarray:
    """``rows`` x ``columns`` weights as random Q4_K, Q6_K or Q8_0 blocks (uint8, one row of
    blocks per weight row) whose values have about ``std``: random codes and sub-scales, and a
    scale per block chosen for that spread (Q4_K's min offsets the mean to about 0)."""
    block_elements, block_bytes = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34)}[kind]
    blocks = np.frombuffer(rng.bytes(rows * columns // block_elements * block_bytes), np.uint8)
    blocks = blocks.reshape(-1, block_bytes).copy()
    if kind == "Q4_K":
        # d * sub-scale * code - dmin * min, sub-scales and mins 0-63, codes 0-15: the spread of
        # a sub-scale times a code is about 217, its mean 236 (31.5 * 7.5), a min's mean 31.5.
        d = np.float16(std / 217)
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(float(d) * 7.5).tobytes(), np.uint8)
    elif kind == "Q6_K":
        # d * sub-scale * (code - 32): sub-scales narrowed to -16..15 (spread about 9.2) so d
        # stays a normal fp16 number; codes 0-63 (spread about 18.5).
        blocks[:, 192:208] = ((blocks[:, 192:208] & 31).astype(np.int8) - 16).view(np.uint8)
        blocks[:, 208:210] = np.frombuffer(np.float16(std / (9.2 * 18.5)).tobytes(), np.uint8)
    else:  # Q8_0: d * code, codes -128..127 (spread about 74)
        blocks[:, 0:2] = np.frombuffer(np.float16(std / 74).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


# llama.cpp refuses to write these mixes without an importance matrix (IQ3_XXS's holds IQ2_S).
NEEDS_IMATRIX = ("IQ1", "IQ2", "IQ3_XXS")


def quantize(source: Path, target: Path, ftype: str) -> None:
    import ctypes

    import llama_cpp

    print(f"quantizing to {target.name}", flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = os.cpu_count() or 2
    if ftype.startswith(NEEDS_IMATRIX):
        # Random weights have no data to weigh their columns by: every column matters alike
        # (the speed of the file is the same whichever matrix chose its codes).
        import gguf

        matrices = [t for t in gguf.GGUFReader(source).tensors if len(t.shape) == 2]
        ones = [(t.name.encode(), np.ones(int(t.shape[0]), dtype=np.float32)) for t in matrices]
        entries = (llama_cpp.llama_model_imatrix_data * (len(ones) + 1))()  # a zeroed entry ends the list
        for entry, (name, values) in zip(entries, ones):
            entry.name, entry.data, entry.size = name, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), values.size
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize to {ftype}")
    partial.replace(target)


# -- measurements -----------------------------------------------------------------------------

@dataclass
class Sample:
    system: str
    workload: str
    value: float  # the workload's headline figure (tokens/s, or TPOT in ms: LOWER_IS_BETTER)
    extra: dict = field(default_factory=dict)


def prompt_ids(vocab: int, count: int, length: int, seed: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *(shared or []), *rng.integers(260, vocab, length - 1).tolist()] for _ in range(count)]


def prompt_localserve(path: Path, threads: int, length: int) -> float:
    """Prompt tokens/s of one ``length``-token prompt, in 512-token chunks (the CPU default)."""
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", num_kv_blocks=length // 16 + 8, max_num_batched_tokens=512, threads=threads,
              enable_prefix_caching=False)
    vocab = llm.engine.spec.vocab_size
    llm.generate(prompt_ids(vocab, 1, 64, seed=1), SamplingParams(max_tokens=1))  # warm-up
    [prompt] = prompt_ids(vocab, 1, length, seed=2)
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    return length / (time.perf_counter() - start)


def prompt_llama_cpp(path: Path, threads: int, vocab: int, length: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=length + 512, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    llm.eval(prompt_ids(vocab, 1, 64, seed=1)[0])
    llm.reset()
    [prompt] = prompt_ids(vocab, 1, length, seed=2)
    start = time.perf_counter()
    llm.eval(prompt)
    elapsed = time.perf_counter() - start
    llm.close()
    return length / elapsed


def offline_tpot_localserve(path: Path, threads: int) -> float:
    """One stream in-process (no server): the median TPOT in ms over the "one" prompts."""
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", num_kv_blocks=64, threads=threads)
    vocab = llm.engine.spec.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompt_ids(vocab, 1, 16, seed=1), SamplingParams(max_tokens=4))  # warm-up
    tpots = []
    for prompt in prompt_ids(vocab, 4, 128, seed=3):
        [out] = llm.generate(prompt, params)
        tpots.append((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1) * 1000)
    return statistics.median(tpots)


def offline_tpot_llama_cpp(path: Path, threads: int, vocab: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    tpots = []
    for prompt in prompt_ids(vocab, 4, 128, seed=3):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(63):  # greedy decode of the 63 tokens after the first
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([token])
        tpots.append((time.perf_counter() - start) / 63 * 1000)
    llm.close()
    return statistics.median(tpots)


def localserve_command(path: Path, port: int, threads: int, clients: int, ctx: int, preload: bool = True) -> list[str]:
    """``localserve serve`` for ``path`` as ``bench``; without ``preload`` it loads no model at
    start (a registry model named bench is loaded when asked for), the options the same."""
    model = ["--model", f"bench={path}"] if preload else []
    return [sys.executable, "-m", "localserve.cli", "serve", *model, "--device", "cpu",
            "--port", str(port), "--log-level", "warning", "--max-num-seqs", str(max(clients, 1)),
            "--max-model-len", str(ctx), "--kv-cache-memory", str(max(clients, 1) * ctx * kv_bytes_per_token(path)),
            "--threads", str(threads), "--insecure-no-auth"]


def llama_server_command(path: Path, port: int, threads: int, clients: int, ctx: int) -> list[str]:
    binary = llama_server.binary()
    if binary is None:
        raise SystemExit("llama-server is not built: run python benchmarks/llama_server.py first")
    slots = max(clients, 1)
    return [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx), "-fa", "on", "--no-webui", "-a", "bench"]


def kv_bytes_per_token(path: Path) -> int:
    from localserve.formats.gguf_file import read_gguf

    meta = read_gguf(path).metadata
    arch = meta["general.architecture"]
    layers, kv_heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count_kv"])
    head_dim = int(meta.get(f"{arch}.attention.key_length") or
                   int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"]))
    return 2 * layers * kv_heads * head_dim * 2  # fp16 K and V: the CPU's default for a quantized GGUF


def peak_rss(pid: int) -> int:
    """The server's peak RSS: its own and its children's (localserve's engine processes)
    added up, as if every peak came at once."""
    import psutil

    total = 0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:  # ended meanwhile
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return total


def time_first_request(url: str, prompt: str) -> float:
    """Seconds the first request (16 tokens in, 8 out) takes once the server says it is
    ready with the model loaded: whatever the server still sets up at first use."""
    import httpx

    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=600, headers={"Authorization": "Bearer bench"},
                          json={"model": "bench", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - start


def served(system: str, path: Path, workload: str, args: argparse.Namespace, workdir: Path,
           extra: tuple[str, ...] = (), own_prompts: list[list[int]] | None = None) -> Sample:
    """One server's run of ``workload``; ``extra``: options added to its command line (a
    repeated option's last value wins). Workload ``own``: ``own_prompts`` from one client,
    64 tokens out each (TPOT)."""
    from localserve.bench import BenchConfig, arun_benchmark
    from localserve.bench.datasets import SampleRequest
    from localserve.bench.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    vocab = tokenizer.vocab_size
    warmups = 1
    if workload == "one":
        clients, prompts, output = 1, prompt_ids(vocab, 4, 128, seed=3), 64
    elif workload == "own":
        assert own_prompts is not None
        clients, prompts, output = 1, own_prompts, 64
    elif workload == "8k":
        # No warm-up copy: it would put the prompt in the prefix cache of both servers.
        clients, prompts, output, warmups = 1, prompt_ids(vocab, 1, 8000, seed=6), 64, 0
    elif workload == "prefix":
        shared = np.random.default_rng(9).integers(260, vocab, 511).tolist()
        clients, prompts, output = 32, prompt_ids(vocab, 32, 33, seed=4, shared=shared), 32
    else:
        clients = int(workload)
        prompts, output = prompt_ids(vocab, clients * 2, 64, seed=5), 32
    ctx = max(len(p) for p in prompts) + output + 16
    requests = [SampleRequest(prompt=tokenizer.decode(p[1:]), prompt_len=len(p), expected_output_len=output)
                for p in prompts]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*(localserve_command if system == "localserve" else llama_server_command)(path, port, args.threads,
                                                                                        clients, ctx), *extra]
    ready = url + ("/health" if system == "localserve" else "/v1/models")
    with serving(command, ready, args.threads, workdir / f"{system}.log") as process:
        first_request_s = time_first_request(url, tokenizer.decode(prompts[0][1:17]))
        config = BenchConfig(url=url, model="bench", num_prompts=len(requests), max_concurrency=clients,
                             ignore_eos=True, num_warmups=warmups, api_key="bench",
                             request_timeout=3600.0)  # an 8k prompt at 8B: 15-30 min to its first token
        result = asyncio.run(arun_benchmark(config, tokenizer=tokenizer, requests=requests))
        rss = peak_rss(process.pid)
    m = result.metrics
    if m.failed:
        log = (workdir / f"{system}.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{system}: {m.failed} of {len(requests)} requests failed; its log ends:\n{log}")
    acceptance = result.spec_decode.acceptance_rate if result.spec_decode else \
        llama_server_acceptance((workdir / f"{system}.log").read_text(errors="replace"))
    tpot = m.latencies["tpot"].median if "tpot" in m.latencies else float("nan")
    ttft = m.latencies["ttft"].median
    value = tpot if workload in LOWER_IS_BETTER else m.output_throughput
    return Sample(system, workload, value, {"first_request_s": first_request_s,
                                            "output_tps": m.output_throughput, "tpot_ms": tpot, "rss": rss,
                                            "failed": m.failed, "ttft_ms": ttft, "acceptance": acceptance,
                                            "prompt_tps": len(prompts[0]) / (ttft / 1000)})


def llama_server_acceptance(log: str) -> float | None:
    """The share of draft tokens llama-server accepted, over the requests its log reports
    ("draft acceptance = 0.5 (  10 accepted /   20 generated)"); None: it drafted none."""
    import re

    pairs = [(int(a), int(g)) for a, g in re.findall(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated",
                                                      log)]
    generated = sum(g for _, g in pairs)
    return sum(a for a, _ in pairs) / generated if generated else None


def measure(system: str, path: Path, workload: str, args: argparse.Namespace, workdir: Path) -> Sample:
    if workload in PROMPT_LENGTHS:
        from localserve.bench.tokenizer import load_tokenizer

        vocab, length = load_tokenizer(str(path)).vocab_size, PROMPT_LENGTHS[workload]
        value = prompt_localserve(path, args.threads, length) if system == "localserve" else \
            prompt_llama_cpp(path, args.threads, vocab, length)
        return Sample(system, workload, value)
    if workload == "offline":
        from localserve.bench.tokenizer import load_tokenizer

        vocab = load_tokenizer(str(path)).vocab_size
        value = offline_tpot_localserve(path, args.threads) if system == "localserve" else \
            offline_tpot_llama_cpp(path, args.threads, vocab)
        return Sample(system, workload, value)
    return served(system, path, workload, args, workdir)


# -- report -----------------------------------------------------------------------------------

LOWER_IS_BETTER = {"one", "own", "offline", "8k"}  # TPOT in ms
UNITS = {"pp512": "prompt tok/s", "one": "TPOT ms", "offline": "TPOT ms", "16": "output tok/s", "32": "output tok/s",
         "prefix": "output tok/s", "pp8k": "prompt tok/s", "8k": "TPOT ms"}
PROMPT_LENGTHS = {"pp512": 512, "pp8k": 8000}  # the offline prompt workloads
SYSTEMS = ("localserve", "llama.cpp")


def summarize(samples: list[Sample]) -> list[dict]:
    rows = []
    for workload in dict.fromkeys(s.workload for s in samples):
        row: dict = {"workload": workload, "unit": UNITS[workload]}
        for system in SYSTEMS:
            values = [s.value for s in samples if s.system == system and s.workload == workload]
            extras = [s.extra for s in samples if s.system == system and s.workload == workload and s.extra]
            row[system] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                           "runs": values, "peak_rss": max((e["rss"] for e in extras), default=None),
                           "first_request_s": max((e["first_request_s"] for e in extras), default=None)}
        ours, theirs = row["localserve"]["median"], row["llama.cpp"]["median"]
        row["ratio"] = theirs / ours if workload in LOWER_IS_BETTER else ours / theirs
        if row["localserve"]["peak_rss"] and row["llama.cpp"]["peak_rss"]:
            row["rss_ratio"] = row["localserve"]["peak_rss"] / row["llama.cpp"]["peak_rss"]
        rows.append(row)
    return rows


def format_rows(label: str, rows: list[dict]) -> str:
    def cell(figures: dict) -> str:
        return f"{figures['median']:8.1f} ({figures['min']:.1f}-{figures['max']:.1f})"

    def first(figures: dict) -> str:
        return "-" if figures["first_request_s"] is None else f"{figures['first_request_s']:.2f}"

    lines = [f"\n{label}", f"{'workload':9s} {'unit':13s} {'localserve':>24s} {'llama.cpp':>24s} {'ratio':>6s} "
             f"{'RSS ours/theirs':>16s} {'first request s':>16s}"]
    for row in rows:
        rss = f"{row['rss_ratio']:.2f}" if "rss_ratio" in row else "-"
        firsts = f"{first(row['localserve'])} / {first(row['llama.cpp'])}"
        lines.append(f"{row['workload']:9s} {row['unit']:13s} {cell(row['localserve']):>24s} "
                     f"{cell(row['llama.cpp']):>24s} {row['ratio']:6.2f} {rss:>16s} {firsts:>16s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"], choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--workloads", nargs="+", default=["pp512", "offline", "one", "16", "32", "prefix"],
                        choices=list(UNITS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = []
    with tempfile.TemporaryDirectory(prefix="localserve-real-shapes-") as tmp:
        for shape in args.shapes:
            for ftype in args.types:
                path = model_path(shape, ftype)
                samples = []
                for workload in args.workloads:
                    for repeat in range(args.repeats):
                        # Interleaved: a slow spell of this shared machine hits both systems.
                        order = SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]
                        for system in order:
                            sample = measure(system, path, workload, args, Path(tmp))
                            print(f"  {shape} {ftype} {workload} {system}: {sample.value:.1f} {UNITS[workload]} "
                                  f"{sample.extra}", flush=True)
                            samples.append(sample)
                rows = summarize(samples)
                report.append({"shape": shape, "type": ftype, "rows": rows})
                print(format_rows(f"{shape} {ftype}", rows), flush=True)
    print(f"\n{args.threads} threads; medians of {args.repeats} runs (min-max); ratio > 1: localserve better")
    for entry in report:
        print(format_rows(f"{entry['shape']} {entry['type']}", entry["rows"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
