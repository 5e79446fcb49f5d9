"""Memory under pressure, measured in one run on one random-weight Llama-shaped model:

1. throughput of a mixed workload with an unconstrained KV pool, with a device pool four
   times too small plus a CPU tier to swap into, and with that small pool and no CPU
   tier (recompute only);
2. time to first token for a request whose 1,000-token system prompt is not cached, and
   for the next request with the same system prompt (a prefix-cache hit).

    python benchmarks/memory_pressure.py [--requests 32] [--hidden 512] [--layers 8] [--repeats 3]
                                         [--prompt-len 32 320] [--output-len 32 160]
                                         [--kv-cache-dtype auto|int8]

Prints figures and ratios. Greedy outputs of the three throughput runs are compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from random_model import save_random_llama

BLOCK_SIZE = 16


def build_checkpoint(path: Path, hidden: int, layers: int) -> None:
    save_random_llama(
        path, vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096, tie_word_embeddings=True,
    )


def mixed_workload(count: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(*prompt_len))] for _ in range(count)]
    outputs = [rng.randint(*output_len) for _ in range(count)]
    return prompts, outputs


def run_throughput(path: Path, prompts, output_lens, **options) -> tuple[float, list[list[int]], dict]:  # type: ignore[no-untyped-def]
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=torch.float32, max_num_seqs=len(prompts), **options)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return tokens / elapsed, [o.token_ids for o in outputs], llm.stats()


def time_to_first_token(engine, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    from localserve import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--system-prompt", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 320), metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 160), metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, args.hidden, args.layers)
        prompts, output_lens = mixed_workload(args.requests, args.prompt_len, args.output_len)
        per_request = [-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(prompts, output_lens)]
        needed = sum(per_request)
        # A quarter of the need, but never less than the largest request alone needs.
        small = max(needed // 4, max(per_request))
        print(f"workload: {args.requests} requests, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(output_lens)} output tokens, {needed} KV blocks if all ran at once")

        runs = {
            "unconstrained pool": dict(num_kv_blocks=needed + 64),
            f"pool of {small} blocks + CPU tier (swap)": dict(num_kv_blocks=small, num_cpu_blocks=needed),
            f"pool of {small} blocks, no CPU tier (recompute)": dict(num_kv_blocks=small, num_cpu_blocks=0),
        }
        rates: dict[str, list[float]] = {name: [] for name in runs}
        results = {}
        # Round-robin repeats, so a noisy moment hits every configuration alike; medians.
        for _ in range(args.repeats):
            for name, options in runs.items():
                rate, tokens, stats = run_throughput(path, prompts, output_lens, enable_prefix_caching=False,
                                                     kv_cache_dtype=args.kv_cache_dtype, **options)
                rates[name].append(rate)
                results[name] = (statistics.median(rates[name]), tokens)
        for name, (rate, _) in results.items():
            print(f"  {name:48s} {rate:7.1f} tok/s (median of {' '.join(f'{r:.1f}' for r in rates[name])})")
        print(f"  (last run under pressure: {stats['num_preemptions']} preemptions, "
              f"{stats['num_recomputes']} recomputes)")
        base_rate, base_tokens = next(iter(results.values()))
        (swap_rate, swap_tokens), (recompute_rate, recompute_tokens) = list(results.values())[1:]
        print(f"swap keeps {swap_rate / base_rate:.0%} of unconstrained throughput; recompute keeps "
              f"{recompute_rate / base_rate:.0%}; swap / recompute = {swap_rate / recompute_rate:.2f}x")
        print(f"greedy outputs identical across the three: {base_tokens == swap_tokens == recompute_tokens}")

        from localserve import Engine, EngineConfig

        rng = random.Random(1)
        system = [rng.randrange(3, 32000) for _ in range(args.system_prompt)]
        engine = Engine(path, EngineConfig(num_kv_blocks=512), device="cpu", dtype=torch.float32)
        time_to_first_token(engine, [5, 6, 7])  # warm-up
        miss = time_to_first_token(engine, system + [rng.randrange(3, 32000) for _ in range(20)])
        hit = time_to_first_token(engine, system + [rng.randrange(3, 32000) for _ in range(20)])
        print(f"TTFT with a {args.system_prompt}-token system prompt: {miss * 1000:.0f} ms uncached, "
              f"{hit * 1000:.0f} ms on a prefix-cache hit ({miss / hit:.1f}x faster); "
              f"hits {engine.stats()['prefix_cache_hits']} tokens")


if __name__ == "__main__":
    main()
