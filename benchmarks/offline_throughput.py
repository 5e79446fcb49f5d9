"""Offline throughput: localserve vs HF transformers (one request at a time, and one
padded static batch), same random-weight Llama-shaped model, measured in one run.

    python benchmarks/offline_throughput.py [--requests 32] [--prompt-len 128] [--output-len 128]

Prints output tokens/s for each and the ratios. Every request generates exactly
--output-len tokens (EOS ignored), so all three do the same work.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # std 1/sqrt(fan_in): non-degenerate logits
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32")
    model.save_pretrained(path)


def bench_localserve(path: Path, prompts: list[list[int]], output_len: int) -> float:
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=torch.float32, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outputs)
    return elapsed


def load_hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, batch: torch.Tensor, output_len: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return model.generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False,
        )


def bench_hf_one_at_a_time(model, prompts: list[list[int]], output_len: int) -> float:  # type: ignore[no-untyped-def]
    hf_generate(model, torch.tensor([prompts[0]]), 4)  # warm-up
    start = time.perf_counter()
    for prompt in prompts:
        hf_generate(model, torch.tensor([prompt]), output_len)
    return time.perf_counter() - start


def bench_hf_static_batch(model, prompts: list[list[int]], output_len: int) -> float:  # type: ignore[no-untyped-def]
    batch = torch.tensor(prompts)  # equal lengths: no padding needed
    hf_generate(model, batch[:2], 4)  # warm-up
    start = time.perf_counter()
    out = hf_generate(model, batch, output_len)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == batch.shape[1] + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-one-at-a-time", action="store_true", help="the slowest of the three")
    args = parser.parse_args()
    torch.manual_seed(1)
    prompts = torch.randint(3, 32000, (args.requests, args.prompt_len)).tolist()
    total_tokens = args.requests * args.output_len
    print(f"threads: {torch.get_num_threads()}; {args.requests} requests x {args.prompt_len} prompt "
          f"+ {args.output_len} output tokens")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args)
        times = {"localserve": bench_localserve(path, prompts, args.output_len)}
        hf = load_hf(path)
        times["HF static batch"] = bench_hf_static_batch(hf, prompts, args.output_len)
        if not args.skip_one_at_a_time:
            times["HF one at a time"] = bench_hf_one_at_a_time(hf, prompts, args.output_len)

    ours = total_tokens / times["localserve"]
    print(f"\n{'engine':<20}{'seconds':>10}{'output tok/s':>14}{'localserve is':>16}")
    for name, seconds in times.items():
        rate = total_tokens / seconds
        print(f"{name:<20}{seconds:>10.2f}{rate:>14.1f}{ours / rate:>15.2f}x")


if __name__ == "__main__":
    main()
