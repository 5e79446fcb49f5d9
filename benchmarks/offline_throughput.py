"""Offline throughput: localserve vs HF transformers (one request at a time, and one
padded static batch), same random-weight Llama-shaped model, measured in one run.

    python benchmarks/offline_throughput.py [--requests 32] [--prompt-len 128] [--output-len 128]
        [--varied] [--skip-one-at-a-time]

Prints useful output tokens/s for each and the ratios. EOS is ignored, so every
request generates exactly its own output length and all three do the same useful work.
The default workload gives every request the same lengths (the best case for a static
batch: no padding, nobody finishes early). --varied draws prompt and output lengths
uniformly from [len/4, 7*len/4] (same means): the static batch then pads prompts to the
longest and decodes until the longest output is done, as static batching must.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from random_model import save_random_llama


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    save_random_llama(
        path, vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    )


def bench_localserve(path: Path, prompts: list[list[int]], output_lens: list[int]) -> float:
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=torch.float32, max_num_seqs=len(prompts))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == output_lens
    return elapsed


def load_hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts: list[list[int]], output_len: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One generate call over the prompts, left-padded to the longest."""
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            batch, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False
        )
    assert out.shape[1] == width + output_len
    return out


def bench_hf_one_at_a_time(model, prompts: list[list[int]], output_lens: list[int]) -> float:  # type: ignore[no-untyped-def]
    hf_generate(model, prompts[:1], 4)  # warm-up
    start = time.perf_counter()
    for prompt, output_len in zip(prompts, output_lens):
        hf_generate(model, [prompt], output_len)
    return time.perf_counter() - start


def bench_hf_static_batch(model, prompts: list[list[int]], output_lens: list[int]) -> float:  # type: ignore[no-untyped-def]
    hf_generate(model, prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    # A static batch runs until its longest request is done.
    hf_generate(model, prompts, max(output_lens))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--varied", action="store_true", help="lengths drawn from [len/4, 7*len/4]")
    parser.add_argument("--skip-one-at-a-time", action="store_true", help="the slowest of the three")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)

    def lengths(mean: int) -> list[int]:
        if not args.varied:
            return [mean] * args.requests
        return torch.randint(mean // 4, mean * 7 // 4 + 1, (args.requests,), generator=generator).tolist()

    prompts = [torch.randint(3, 32000, (n,), generator=generator).tolist() for n in lengths(args.prompt_len)]
    output_lens = lengths(args.output_len)
    total_tokens = sum(output_lens)
    shape = "varied lengths, means" if args.varied else "each"
    print(f"threads: {torch.get_num_threads()}; {args.requests} requests, {shape} {args.prompt_len} prompt "
          f"+ {args.output_len} output tokens ({total_tokens} output tokens in all)")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args)
        times = {"localserve": bench_localserve(path, prompts, output_lens)}
        hf = load_hf(path)
        times["HF static batch"] = bench_hf_static_batch(hf, prompts, output_lens)
        if not args.skip_one_at_a_time:
            times["HF one at a time"] = bench_hf_one_at_a_time(hf, prompts, output_lens)

    ours = total_tokens / times["localserve"]
    print(f"\n{'engine':<20}{'seconds':>10}{'output tok/s':>14}{'localserve is':>16}")
    for name, seconds in times.items():
        rate = total_tokens / seconds
        print(f"{name:<20}{seconds:>10.2f}{rate:>14.1f}{ours / rate:>15.2f}x")


if __name__ == "__main__":
    main()
