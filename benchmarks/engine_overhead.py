"""Engine overhead per decode step on GGUF files: how much of a step is not the model.

    python benchmarks/engine_overhead.py                     # Q8_0 and Q4_0, batch 1 and 32, 128 in / 128 out
    python benchmarks/engine_overhead.py --types Q4_0 --batch-sizes 1 4 --input-len 16 --output-len 8
    python benchmarks/engine_overhead.py --model my.gguf --json overhead.json

Without --model it builds the ~100M-parameter random llama of benchmarks/gguf_decode.py and
quantizes it with llama.cpp's quantizer to each of --types. For each batch size it adds that
many random prompts (--input-len tokens, greedy, --output-len tokens, EOS ignored) to one
CPU engine and steps it by hand, timing every ``Engine.step()`` and, inside it, the parts
of ``ModelRunner.execute``. Each decode step's wall time is split into:

* model forward: ``model(input_ids, positions, kv_caches, meta)`` (embedding, decoder
  layers, final norm);
* lm head: ``model.compute_logits`` (the vocabulary projection of the sampled rows);
* sampling: ``runner.sampler``;
* input prep: the rest of ``execute`` (flat input tensors, block tables, the gather of the
  sampled rows' hidden states, sampling rows);
* outside runner: the rest of ``step`` (scheduling, KV bookkeeping, detokenization, stop
  checks, outputs).

"overhead" is everything but model forward and lm head: the lm head is part of the model,
so it counts as model forward for the issue's target of engine overhead under 15% of step
time at batch 32. Only decode steps at the full batch size count (see ``is_decode``).
The timers cost a few ``perf_counter`` calls per step; they are right because every CPU op
is synchronous (on CUDA they would not be, so this runs on CPU only).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # localserve and tests.gguf_writers from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling gguf_decode module

from gguf_decode import build_f32_gguf, quantize, random_prompts

from localserve import LLM, EngineConfig, SamplingParams

PARTS = ("forward", "lm_head", "sampling", "execute")


class Stopwatch:
    """Wall time of the timed calls during the current step, by part, and what the step ran."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.batch, self.decode = 0, False  # a step that schedules nothing never reaches execute

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        return call


class TimedModel:
    """Stands in for the runner's model: times the forward and ``compute_logits`` and passes
    every other attribute through. Not an nn.Module, so it adds no hooks or module state."""

    def __init__(self, model: torch.nn.Module, watch: Stopwatch) -> None:
        self._model = model
        self._forward = watch.timed("forward", model)
        self.compute_logits = watch.timed("lm_head", model.compute_logits)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # reached only for names not set in __init__
        return getattr(self._model, name)


def is_decode(batch: Any) -> bool:
    # A decode step is one where every scheduled request is past its prompt: checked on the
    # batch itself before it runs, so chunked prefill, a prompt's last chunk (which samples
    # too) and a prefix-cache hit leaving one prompt token all count as prefill, which a
    # count of input tokens could mistake for decodes.
    return all(r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests)


def instrument(llm: LLM) -> Stopwatch:
    watch = Stopwatch()
    runner = llm.engine.runner
    runner.model = TimedModel(runner.model, watch)
    runner.sampler = watch.timed("sampling", runner.sampler)
    execute = watch.timed("execute", runner.execute)

    def execute_and_classify(batch: Any) -> Any:
        watch.batch, watch.decode = len(batch.requests), is_decode(batch)
        return execute(batch)

    runner.execute = execute_and_classify  # an instance attribute: Engine.step calls it
    return watch


def measure(llm: LLM, watch: Stopwatch, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Run the prompts to completion; sums over decode steps at the full batch size."""
    engine, batch_size = llm.engine, len(prompts)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    totals = dict.fromkeys(("step", *PARTS), 0.0)
    decode_steps = prefill_steps = partial_steps = 0
    while engine.has_unfinished_requests():
        watch.reset()
        start = time.perf_counter()
        engine.step()
        step_seconds = time.perf_counter() - start
        if not watch.decode:
            prefill_steps += 1
        elif watch.batch < batch_size:  # the tail once some requests finished: a smaller batch
            partial_steps += 1
        else:
            decode_steps += 1
            totals["step"] += step_seconds
            for part, seconds in watch.seconds.items():
                totals[part] += seconds
    step = totals["step"] or math.nan
    shares = {
        "forward": totals["forward"] / step,
        "lm_head": totals["lm_head"] / step,
        "sampling": totals["sampling"] / step,
        "input_prep": (totals["execute"] - totals["forward"] - totals["lm_head"] - totals["sampling"]) / step,
        "outside_runner": (totals["step"] - totals["execute"]) / step,
    }
    return {"batch": batch_size, "decode_steps": decode_steps, "prefill_steps": prefill_steps,
            "partial_steps": partial_steps, "mean_step_ms": 1e3 * step / max(decode_steps, 1),
            "steps_per_s": decode_steps / step, "output_tok_per_s": decode_steps * batch_size / step,
            **{f"{name}_pct": 100 * share for name, share in shares.items()},
            "overhead_pct": 100 * (1 - shares["forward"] - shares["lm_head"])}


def bench_file(path: Path, label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    block_size = EngineConfig().block_size  # LLM below keeps the default
    blocks_per_seq = math.ceil((args.input_len + args.output_len) / block_size) + 1
    llm = LLM(path, device="cpu", num_kv_blocks=max(args.batch_sizes) * blocks_per_seq)
    watch = instrument(llm)
    generator = torch.Generator().manual_seed(1)  # the same prompts for every type
    warmup = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rows = []
    for batch_size in args.batch_sizes:
        # Warm up at this batch size (decode kernels differ between one row and many) on short
        # prompts of their own, so nothing of the measured prompts is in the prefix cache.
        llm.generate(random_prompts(torch.Generator().manual_seed(0), batch_size, 8), warmup)
        prompts = random_prompts(generator, batch_size, args.input_len)
        row = {"type": label, **measure(llm, watch, prompts, args.output_len)}
        print(f"{label:8s} batch {batch_size:3d}: {row['decode_steps']} decode steps "
              f"({row['prefill_steps']} with prefill, {row['partial_steps']} at a smaller batch excluded), "
              f"{row['mean_step_ms']:.1f} ms/step, {row['steps_per_s']:.1f} steps/s, "
              f"{row['output_tok_per_s']:.1f} tok/s, overhead {row['overhead_pct']:.1f}%", flush=True)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [("forward_pct", "forward%"), ("lm_head_pct", "lm head%"), ("sampling_pct", "sampling%"),
               ("input_prep_pct", "input prep%"), ("outside_runner_pct", "outside runner%"),
               ("overhead_pct", "overhead%")]
    print(f"\n{'type':8s} {'batch':>5s} {'steps':>6s} {'step ms':>8s} " + " ".join(f"{h:>15s}" for _, h in columns))
    for row in rows:
        print(f"{row['type']:8s} {row['batch']:5d} {row['decode_steps']:6d} {row['mean_step_ms']:8.2f} "
              + " ".join(f"{row[key]:15.1f}" for key, _ in columns))
    print("overhead% = everything but model forward and lm head (target at batch 32: under 15%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: build and quantize the random llama)")
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    if args.model:
        rows = bench_file(args.model, args.model.stem, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            build_f32_gguf(source := Path(tmp) / "f32.gguf")
            for ftype in args.types:
                quantize(source, path := Path(tmp) / f"{ftype}.gguf", ftype)
                rows += bench_file(path, ftype, args)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
