"""What serving over HTTP costs: the same workload through `localserve serve` (32
concurrent streaming clients) and through the offline API, in one run.

    python benchmarks/server_overhead.py [--clients 32] [--prompt-len 128] [--output-len 128]

The model is a random-weight Llama (hidden 768, 12 layers) with stories260K's
tokenizer (from tests/data, so streamed text is real text). EOS is ignored, so both
sides generate exactly clients x output-len tokens. The server runs as its own
process, as it would in use; the clients (httpx, one asyncio loop) parse every SSE
event. Prints output tokens/s for both and the share HTTP costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from random_model import save_random_llama
from servers import free_port, serving

STORIES = Path(__file__).resolve().parents[1] / "tests" / "data" / "models" / "stories260K-hf"


def build_checkpoint(path: Path) -> None:
    save_random_llama(path, vocab_size=512, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, path / name)  # into the temporary checkpoint only


def offline(path: Path, prompts: list[list[int]], output_len: int) -> float:
    from localserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", max_num_seqs=len(prompts), kv_cache_memory=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outputs)
    return elapsed


def localserve_command(path: Path, clients: int, port: int) -> list[str]:
    return [sys.executable, "-m", "localserve.cli", "serve", "--model", f"bench={path}", "--port", str(port),
            "--device", "cpu", "--max-num-seqs", str(clients), "--kv-cache-memory", "1GiB", "--log-level", "warning"]


async def stream_one(http: httpx.AsyncClient, prompt: list[int], output_len: int) -> tuple[int, int]:
    """One streaming completion; returns (SSE events, completion tokens from usage)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            events += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return events, tokens


async def over_http(url: str, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await stream_one(http, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(http, p, output_len) for p in prompts))
        elapsed = time.perf_counter() - start
    assert all(tokens == output_len for _, tokens in results), results
    return elapsed, sum(events for events, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 512, (args.prompt_len - 1,), generator=generator).tolist()
               for _ in range(args.clients)]
    total = args.clients * args.output_len
    print(f"threads: {torch.get_num_threads()}; {args.clients} clients, {args.prompt_len} prompt + "
          f"{args.output_len} output tokens each ({total} output tokens in all)")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path)
        offline_s = offline(path, prompts, args.output_len)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with serving(localserve_command(path, args.clients, port), f"{url}/health", torch.get_num_threads(),
                     path / "server.log"):
            http_s, events = asyncio.run(over_http(url, prompts, args.output_len))

    print(f"\n{'path':<28}{'seconds':>10}{'output tok/s':>14}")
    print(f"{'offline API (LLM.generate)':<28}{offline_s:>10.2f}{total / offline_s:>14.1f}")
    print(f"{'HTTP, streaming (SSE)':<28}{http_s:>10.2f}{total / http_s:>14.1f}")
    print(f"\nSSE events received: {events} ({events / total:.2f} per token)")
    print(f"HTTP throughput is {offline_s / http_s:.2f}x the offline API's; HTTP costs "
          f"{(http_s - offline_s) / http_s:.1%} of the served run's time")


if __name__ == "__main__":
    main()
