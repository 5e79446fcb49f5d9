"""Where one stream's decode step goes, part by part, against the memory-bandwidth bound.

    python benchmarks/decode_profile.py                          # Llama-3.2-1B shape, Q4_K_M (real_shapes.py's file)
    python benchmarks/decode_profile.py --type Q8_0 --context 1024
    python benchmarks/decode_profile.py --model my.gguf --steps 64

One request decodes greedily in-process after a prompt of --context tokens. Each decode
step is timed whole and by part: inside the layers (the CPU's decoder stack times its own
steps: each projection kind with the bytes of weights it streams, rotary and the KV
write, attention with the bytes of cache it reads, norms, residual adds and the
activation), the rest of the model's forward (embedding lookup, final norm, the Python
around the stack), the LM head, sampling, the runner's inputs and the engine around it
(scheduling, output processing). The bandwidth bound is the bytes a step must read over
the read bandwidth this machine gives 2 threads (host_facts.py, measured here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_facts import cpu_summary, measure_bandwidth  # noqa: E402


class Timer:
    """Seconds in wrapped calls since the last reset."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        return call


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of weights each stack step and the LM head read per decode step (one token: a
    mixture of experts reads its router and top_k of its experts)."""
    from localserve.kernels.decoder_cpu import PROFILE_STEPS
    from localserve.models.moe import SparseMoE

    experts_step = PROFILE_STEPS[-1]
    totals = {"qkv": 0, "o_proj": 0, "gate_up": 0, "down": 0, experts_step: 0}
    for layer in model.layers:
        totals["qkv"] += layer.attn.qkv.nbytes
        totals["o_proj"] += layer.attn.o_proj.nbytes
        if isinstance(layer.mlp, SparseMoE):
            experts = layer.mlp.experts.mlp
            totals[experts_step] += layer.mlp.router.nbytes + experts.nbytes * layer.mlp.top_k // experts.num_experts
        else:
            totals["gate_up"] += layer.mlp.gate_up.nbytes
            totals["down"] += layer.mlp.down.nbytes
    totals["LM head"] = model.lm_head.nbytes
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (fp32 here), fp16, bf16 or int8")
    args = parser.parse_args()
    if args.model is None:
        import real_shapes

        args.model = real_shapes.model_path(args.shape, args.type)
    from localserve import LLM, SamplingParams
    from localserve.kernels import decoder_cpu

    print(cpu_summary())
    bandwidth = measure_bandwidth(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s (best of 7 sums over 512 MiB)")
    blocks = -(-(args.context + args.steps + 32) // 16) + 2
    llm = LLM(args.model, device="cpu", num_kv_blocks=blocks, threads=args.threads, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    model, runner = engine.runner.model, engine.runner
    prompt = torch.randint(260, engine.spec.vocab_size, (args.context,), generator=torch.Generator().manual_seed(3))
    llm.generate([prompt[:16].tolist()], SamplingParams(max_tokens=4, temperature=0))  # warm-up

    timer = Timer()
    model.forward = timer.wrap("forward", model.forward)
    model.lm_head.forward = timer.wrap("LM head", model.lm_head.forward)
    runner.sampler = timer.wrap("sampling", runner.sampler)
    runner.execute = timer.wrap("execute", runner.execute)
    engine.add_request(prompt.tolist(), SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True))
    # The prompt, in as many chunks as max_num_batched_tokens makes of it, and the first token.
    while not engine.requests[next(iter(engine.requests))].output_token_ids:
        engine.step()
    steps, stacked = [], {name: 0.0 for name in decoder_cpu.PROFILE_STEPS}
    totals: dict[str, list[float]] = {}
    decoder_cpu.profile(True)
    while engine.has_unfinished_requests():
        timer.seconds = {}
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        for name, seconds in decoder_cpu.profile(True).items():
            stacked[name] += seconds
        for name, seconds in timer.seconds.items():
            totals.setdefault(name, []).append(seconds)
    decoder_cpu.profile(False)
    if model._stack is None or model._stack[1] is None:
        raise SystemExit("this model's layers do not run as one stack: no breakdown of them")

    count = len(steps)
    # Means throughout, so that the parts add up to the step.
    step = statistics.mean(steps)
    median = {name: statistics.mean(values) for name, values in totals.items()}
    inside = {name: seconds / count for name, seconds in stacked.items()}
    nbytes = weight_bytes(model)
    spec = engine.spec
    # K and V per position and layer, in the cache's type (an 8-bit cache's scales left out).
    kv_row = 2 * spec.num_kv_heads * spec.head_dim * llm.engine.kv_dtype.itemsize
    nbytes["attention"] = spec.num_layers * (args.context + args.steps // 2) * kv_row
    rows = [(name, seconds, nbytes.get(name, 0)) for name, seconds in inside.items()]
    layers = sum(inside.values())
    forward = median["forward"]
    rows.append(("forward outside layers", forward - layers, 0))
    rows.append(("LM head", median["LM head"], nbytes["LM head"]))
    rows.append(("sampling", median.get("sampling", 0.0), 0))
    rows.append(("runner inputs", median["execute"] - forward - median["LM head"] - median.get("sampling", 0.0), 0))
    rows.append(("engine around runner", step - median["execute"], 0))
    total_bytes = sum(b for _, _, b in rows)
    bound = total_bytes / bandwidth
    print(f"\n{args.model.name}, {args.threads} threads: {count} decode steps after {args.context} prompt tokens; "
          f"mean step {step * 1e3:.2f} ms ({1 / step:.1f} tokens/s)")
    print(f"{'part':28s} {'ms':>7s} {'share':>6s} {'MB':>8s} {'GB/s':>6s} {'of bandwidth':>12s}")
    for name, seconds, moved in rows:
        rate = moved / seconds if seconds > 0 and moved else 0.0
        print(f"{name:28s} {seconds * 1e3:7.2f} {100 * seconds / step:5.1f}% {moved / 1e6:8.1f} "
              f"{rate / 1e9:6.1f} {100 * rate / bandwidth:11.0f}%" if moved else
              f"{name:28s} {seconds * 1e3:7.2f} {100 * seconds / step:5.1f}%")
    print(f"{'step':28s} {step * 1e3:7.2f} {100.0:5.1f}% {total_bytes / 1e6:8.1f} {total_bytes / step / 1e9:6.1f} "
          f"{100 * bound / step:11.0f}%")
    print(f"bandwidth bound: {total_bytes / 1e6:.0f} MB a token at {bandwidth / 1e9:.1f} GB/s = {bound * 1e3:.1f} ms; "
          f"this step reaches {100 * bound / step:.0f}% of it")


if __name__ == "__main__":
    main()
