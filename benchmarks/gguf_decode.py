"""Decode speed on GGUF files: localserve vs llama-cpp-python on the same file.

    python benchmarks/gguf_decode.py [--types Q8_0 Q4_0 Q4_K_M] [--output-len 32]

Builds a ~100M-parameter llama-shaped model with random weights (hidden 1024, 9
layers, FFN 2816, the stories 512-token vocabulary so llama.cpp can load it), writes
it as F32 GGUF, quantizes it with llama.cpp's own quantizer, and for each type runs
one stream, then 16 requests (localserve batches them; llama-cpp-python's Llama
serves one sequence, so it runs them one after another, as its server would).
Prints output tokens/s (32-token prompts, greedy, EOS ignored) and ratios. Each figure is
the best of --repeats runs (both systems alike): on a shared machine the slowest runs
measure the neighbours.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.gguf_writers
from tests.gguf_writers import write_gguf  # noqa: E402


def build_f32_gguf(path: Path) -> None:
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=9,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    write_gguf(path, model, gguf.GGMLQuantizationType.F32)


def random_prompts(generator: torch.Generator, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of BOS then ``length - 1`` random ids from the stories vocabulary."""
    return [[1, *torch.randint(3, 512, (length - 1,), generator=generator).tolist()] for _ in range(count)]


def quantize(source: Path, target: Path, ftype: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize to {ftype}")


def bench_llama_cpp(path: Path, prompts: list[list[int]], output_len: int, repeats: int = 1) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=torch.get_num_threads(),
                          verbose=False)

    def run() -> None:
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            for _ in range(output_len):
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                llm.eval([token])

    elapsed = best_time(run, repeats)
    llm.close()
    return elapsed


def bench_localserve(path: Path, prompts: list[list[int]], output_len: int, repeats: int = 1) -> float:
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    return best_time(lambda: llm.generate(prompts, params), repeats)


def best_time(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    prompts = random_prompts(generator, args.concurrent, 32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "f32.gguf"
        build_f32_gguf(source)
        for ftype in args.types:
            path = Path(tmp) / f"{ftype}.gguf"
            quantize(source, path, ftype)
            for label, batch in (("1 stream", prompts[:1]), (f"{args.concurrent} requests", prompts)):
                tokens = len(batch) * args.output_len
                ours = tokens / bench_localserve(path, batch, args.output_len, args.repeats)
                theirs = tokens / bench_llama_cpp(path, batch, args.output_len, args.repeats)
                rows.append((ftype, label, ours, theirs))
                print(f"{ftype:8s} {label:12s} localserve {ours:8.1f} tok/s  llama.cpp {theirs:8.1f} tok/s  "
                      f"ratio {ours / theirs:.2f}", flush=True)
    print(f"\n{'type':8s} {'workload':12s} {'localserve':>12s} {'llama.cpp':>12s} {'ratio':>7s}")
    for ftype, label, ours, theirs in rows:
        print(f"{ftype:8s} {label:12s} {ours:12.1f} {theirs:12.1f} {ours / theirs:7.2f}")


if __name__ == "__main__":
    main()
