"""MoE decode speed on CPU: the fused path (tokens grouped by expert, chosen experts
only, the C++ kernel for quantized experts) against the per-expert loop reference,
and against llama-cpp-python on the same file.

    python benchmarks/moe_decode.py [--batches 1 8 32] [--output-len 32]

Builds a Mixtral-shaped model with random weights scaled to ~200M parameters (8
experts, top-2; hidden 768, 8 layers, expert FFN 1280, the stories 512-token
vocabulary so llama.cpp can load it), writes it as F32 GGUF and quantizes it to Q8_0
with llama.cpp's quantizer. Prints output tokens/s for batches of 1, 8 and 32
requests (4-token prompts, greedy, EOS ignored) for both localserve paths, llama.cpp
at batch 1 (its Llama object serves one sequence), and the ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.gguf_writers and gguf_decode
from benchmarks.gguf_decode import bench_llama_cpp, quantize, random_prompts  # noqa: E402
from tests.gguf_writers import write_gguf  # noqa: E402


def build_f32_gguf(path: Path) -> None:
    import gguf
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=512, hidden_size=768, intermediate_size=1280, num_hidden_layers=8,
                           num_attention_heads=12, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           sliding_window=None)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"model: {total / 1e6:.0f}M parameters, {(total - experts * 6 // 8) / 1e6:.0f}M active per token")
    write_gguf(path, model, gguf.GGMLQuantizationType.F32)


def bench_localserve(path: Path, prompts: list[list[int]], output_len: int) -> float:
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", num_kv_blocks=512)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    return time.perf_counter() - start


def main() -> None:
    import localserve.kernels.moe as moe
    from localserve.kernels.moe_ref import fused_moe_ref

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    prompts = random_prompts(generator, max(args.batches), 4)
    fused_cpu = moe.fused_moe_cpu
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source, path = Path(tmp) / "f32.gguf", Path(tmp) / "q8_0.gguf"
        build_f32_gguf(source)
        quantize(source, path, "Q8_0")
        for batch in args.batches:
            tokens = batch * args.output_len
            fused = tokens / bench_localserve(path, prompts[:batch], args.output_len)
            moe.fused_moe_cpu = fused_moe_ref  # what the CPU dispatch runs, for this measurement only
            try:
                loop = tokens / bench_localserve(path, prompts[:batch], args.output_len)
            finally:
                moe.fused_moe_cpu = fused_cpu
            llama = tokens / bench_llama_cpp(path, prompts[:batch], args.output_len) if batch == 1 else None
            rows.append((batch, fused, loop, llama))
            print(f"batch {batch:3d}: fused {fused:7.1f} tok/s, per-expert loop {loop:7.1f} tok/s"
                  + (f", llama.cpp {llama:7.1f} tok/s" if llama else ""), flush=True)
    print(f"\n{'batch':>5s} {'fused':>9s} {'loop':>9s} {'fused/loop':>10s} {'llama.cpp':>10s} {'fused/llama.cpp':>15s}")
    for batch, fused, loop, llama in rows:
        versus = f"{llama:10.1f} {fused / llama:15.2f}" if llama else f"{'':10s} {'':15s}"
        print(f"{batch:5d} {fused:9.1f} {loop:9.1f} {fused / loop:10.2f} {versus}")


if __name__ == "__main__":
    main()
