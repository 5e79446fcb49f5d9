"""What structured outputs cost a decode step: 16 streams at a real shape (default the
Llama-3.2-1B shape in Q4_K_M, vocabulary 128,256, from real_shapes.py's cache), all free,
all held to a JSON schema, and half of each, in-process on the CPU.

    python benchmarks/structured_overhead.py
    python benchmarks/structured_overhead.py --model path/to/model.gguf --streams 16 --repeats 3

Prints the median decode step time of each batch (the runs interleaved) and the overhead
of the constrained ones over the free one. The masks are computed on a worker thread
while the model runs; what remains on the step's path is waiting for them, unpacking
them and setting the forbidden logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from localserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from localserve.engine.output_format import OutputFormat  # noqa: E402

# Long enough that every step of the run is inside the grammar.
SCHEMA = {"type": "array", "minItems": 100,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                    "required": ["name", "age"], "additionalProperties": False}}


def decode_step_ms(engine: Engine, constrained: list[bool], tokens: int) -> float:
    """Median time of the decode steps of one batch (after every prompt is in)."""
    for i, held in enumerate(constrained):
        params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=not held,
                                output_format=OutputFormat("json", SCHEMA) if held else None)
        engine.add_request(list(range(300 + i, 364 + i)), params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) == len(constrained) and not any(o.finished for o in outputs):
            times.append(elapsed)  # a decode step of the whole batch
    return 1000 * statistics.median(times)


def main() -> None:
    import real_shapes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: real_shapes' llama-3.2-1b Q4_K_M")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per stream")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.model or real_shapes.model_path("llama-3.2-1b", "Q4_K_M")
    engine = Engine(path, EngineConfig(max_num_seqs=args.streams), device="cpu", dtype=torch.float32)
    n = args.streams
    batches = {"free": [False] * n, "constrained": [True] * n, "half": [i % 2 == 0 for i in range(n)]}
    # The first constrained request indexes the vocabulary for llguidance: outside the timing.
    start = time.perf_counter()
    decode_step_ms(engine, [True], 2)
    print(f"{path.name}: vocabulary indexed for llguidance in {time.perf_counter() - start:.1f} s")
    results: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.repeats):
        for name, constrained in batches.items():
            results[name].append(decode_step_ms(engine, constrained, args.tokens))
    free = statistics.median(results["free"])
    print(f"{n} streams, decode step, median of {args.repeats} runs (min-max):")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"  {name:12} {median:7.1f} ms ({min(values):.1f}-{max(values):.1f})  overhead {100 * (median / free - 1):+.1f}%")


if __name__ == "__main__":
    main()
