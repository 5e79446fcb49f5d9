"""Speculative decoding: what verifying draft tokens in the batch costs and gains.

    python benchmarks/speculative.py                       # Llama-3.2-1B shape, Q4_K_M (real_shapes.py's file)
    python benchmarks/speculative.py --type Q8_0 --repeats 3
    python benchmarks/speculative.py --parts mechanics --clients 1     # or: --parts lookup, draft

In-process (the engine as the daemon runs it, without HTTP), greedy, 2 threads.

mechanics: a drafter made for the benchmark proposes each request's own greedy continuation,
recorded by a first run without drafts, with each draft token replaced by a wrong one with
probability 1 - a: acceptance a by construction (0, 0.5, 0.8, 1.0), k = 2, 4, 8 draft tokens a
step, every step (adaptive off); then a = 0 with the adaptive draft length, which should cost
almost nothing. One client (requests one after another: TPOT) and 16 (all at once: output
tokens/s), each against the same requests without drafts, runs interleaved.

lookup: prompt lookup (the ngram drafter, adaptive) where the answer copies its prompt: the
prompt holds a text and the answer's start, and the model's greedy continuation of that text,
recorded first, is the answer.

lookup-served: prompt lookup against llama-server's (ngram-simple, its defaults), served,
one client, on lookup's prompts.

draft: a draft model against llama-server's speculative mode (-md), served, the same two
files (the target and a draft made of its first two layers, or --draft-model's file), the
same k: one client's TPOT and 16 clients' output tokens/s, each server with and without its
draft. A draft that never agrees: --shape llama-3.1-8b --draft-model the 1B file (unrelated
random weights of the same vocabulary).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_shapes  # noqa: E402
from host_facts import cpu_summary  # noqa: E402

from localserve.engine.speculative.drafter import PerRequestDrafter  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64


class CorruptedDrafter(PerRequestDrafter):
    """Each request's recorded continuation, each token of it wrong with probability
    1 - ``acceptance`` (decided by a hash of the request and position: a position is
    proposed the same way every time)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], acceptance: float, vocab: int) -> None:
        self.continuations, self.acceptance, self.vocab = continuations, acceptance, vocab

    def propose(self, request, tokens, count: int) -> list[int]:  # type: ignore[no-untyped-def]
        prompt = tuple(request.prompt_token_ids)
        known = self.continuations[prompt]
        start = len(tokens) - len(prompt)
        drafts = []
        for position in range(start, min(start + count, len(known))):
            draw = zlib.crc32(repr((prompt[:8], position)).encode()) / 2**32
            drafts.append(known[position] if draw < self.acceptance else (known[position] + 1) % self.vocab)
        return drafts


@dataclasses.dataclass
class Figures:
    tpot_ms: float  # median over the requests
    tokens_per_s: float  # output tokens over the wall time (prompts' prefill included)
    decode_tokens_per_s: float  # tokens after each request's first over the time from the first to the last
    acceptance: float  # draft tokens accepted / verified (nan without drafts)


def run(llm, prompts: list[list[int]], clients: int, draft_tokens: int) -> Figures:  # type: ignore[no-untyped-def]
    from localserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True,
                            num_speculative_tokens=draft_tokens)
    before = llm.stats()
    start = time.perf_counter()
    outputs, decode_seconds = [], 0.0
    for first in range(0, len(prompts), clients):
        batch = llm.generate(prompts[first:first + clients], params)
        decode_seconds += max(o.finish_time for o in batch) - min(o.first_token_time for o in batch)
        outputs += batch
    elapsed = time.perf_counter() - start
    after = llm.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    kept = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    tpots = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) * 1000 for o in outputs]
    return Figures(statistics.median(tpots), sum(len(o.token_ids) for o in outputs) / elapsed,
                   sum(len(o.token_ids) - 1 for o in outputs) / decode_seconds, kept / drafted if drafted else float("nan"))


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def mechanics(llm, vocab: int, repeats: int, client_counts: list[int]) -> None:  # type: ignore[no-untyped-def]
    from localserve import SamplingParams
    from localserve.engine.speculative.ngram import NgramDrafter

    speculator = llm.engine.speculator
    for clients in client_counts:
        count = max(clients, 4)
        prompts = real_shapes.prompt_ids(vocab, count, PROMPT_TOKENS, seed=11 + clients)
        recorded = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True,
                                                        num_speculative_tokens=0))
        continuations = {tuple(p): o.token_ids for p, o in zip(prompts, recorded)}
        cases = [(a, k, False) for a in (0.0, 0.5, 0.8, 1.0) for k in (2, 4, 8)] + [(0.0, 8, True)]
        results: dict[tuple[float, int, bool] | None, list[Figures]] = {}
        for repeat in range(repeats):
            for case in ([None, *cases] if repeat % 2 == 0 else [*cases[::-1], None]):
                if case is None:
                    results.setdefault(None, []).append(run(llm, prompts, clients, 0))
                    continue
                acceptance, k, adaptive = case
                speculator.config = dataclasses.replace(speculator.config, adaptive=adaptive)
                speculator.drafter = CorruptedDrafter(continuations, acceptance, vocab)
                results.setdefault(case, []).append(run(llm, prompts, clients, k))
        speculator.drafter = NgramDrafter(speculator.config.ngram_min, speculator.config.ngram_max)
        speculator.config = dataclasses.replace(speculator.config, adaptive=True)
        base = results[None]
        base_tpot = statistics.median(f.tpot_ms for f in base)
        base_rate = statistics.median(f.tokens_per_s for f in base)
        base_decode = statistics.median(f.decode_tokens_per_s for f in base)
        what = "TPOT ms" if clients == 1 else "output tok/s"
        print(f"\n{clients} client{'s' if clients > 1 else ''}, {count} requests of {PROMPT_TOKENS} in / "
              f"{OUTPUT_TOKENS} out, {repeats} interleaved repeats, medians (min-max); ratio > 1: faster"
              + ("" if clients == 1 else "; decode: tokens/s from the first token to the last"))
        print(f"{'acceptance':>10} {'k':>2} {'adaptive':>8} {'measured':>8} {what:>22} {'ratio':>6}"
              + ("" if clients == 1 else f" {'decode tok/s':>22} {'ratio':>6}"))

        def line(label: str, figures: list[Figures]) -> str:
            if clients == 1:
                return f"{label} {cell([f.tpot_ms for f in figures]):>22} " \
                       f"{base_tpot / statistics.median(f.tpot_ms for f in figures):6.2f}"
            return (f"{label} {cell([f.tokens_per_s for f in figures]):>22} "
                    f"{statistics.median(f.tokens_per_s for f in figures) / base_rate:6.2f} "
                    f"{cell([f.decode_tokens_per_s for f in figures]):>22} "
                    f"{statistics.median(f.decode_tokens_per_s for f in figures) / base_decode:6.2f}")

        print(line(f"{'no drafts':>10} {'':>2} {'':>8} {'':>8}", base))
        for case in cases:
            acceptance, k, adaptive = case
            measured = statistics.median(f.acceptance for f in results[case])
            print(line(f"{acceptance:10.1f} {k:2d} {'yes' if adaptive else 'no':>8} {measured:8.2f}", results[case]))


def lookup(llm, vocab: int, repeats: int) -> None:  # type: ignore[no-untyped-def]
    """Prompt lookup where the answer is in the prompt: text, then the start of the answer."""
    from localserve import SamplingParams

    texts = real_shapes.prompt_ids(vocab, 4, PROMPT_TOKENS, seed=29)
    greedy = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, num_speculative_tokens=0)
    answers = [o.token_ids for o in llm.generate(texts, greedy)]
    # The text, its answer, the text again: the model answers the second time as the first.
    prompts = [t + a + t[1:] for t, a in zip(texts, answers)]
    results: dict[int, list[Figures]] = {}
    for repeat in range(repeats):
        for k in ((0, 4, 8) if repeat % 2 == 0 else (8, 4, 0)):
            results.setdefault(k, []).append(run(llm, prompts, 1, k))
    base = statistics.median(f.tpot_ms for f in results[0])
    print(f"\nprompt lookup (ngram, adaptive), one client, {len(prompts)} prompts of "
          f"{len(prompts[0])} tokens repeating their answer, {OUTPUT_TOKENS} out")
    for k, figures in results.items():
        tpot = statistics.median(f.tpot_ms for f in figures)
        print(f"  k {k}: TPOT {cell([f.tpot_ms for f in figures])} ms, acceptance "
              f"{statistics.median(f.acceptance for f in figures):.2f}, ratio {base / tpot:.2f}")


def draft_pair(args: argparse.Namespace, k: int, workloads: list[str]) -> None:
    """A draft model against llama-server's, served, on the same two files: the target and
    its first two layers (real_shapes' llama-3.2-1b-draft), k draft tokens at most."""
    target = real_shapes.model_path(args.shape, args.type)
    draft = args.draft_model or real_shapes.model_path(f"{args.shape}-draft", args.type)
    # Room for the draft's cache too: the two pools split --kv-cache-memory.
    per_token = real_shapes.kv_bytes_per_token(target) + real_shapes.kv_bytes_per_token(draft)
    print(f"\ndraft model {draft.name} for {target.name}, k {k}, served ({args.repeats} interleaved repeats)")
    compare_served(args, target, workloads, None, (
        "--draft-model", str(draft), "--num-speculative-tokens", str(k), "--kv-cache-memory", str(32 * 512 * per_token)),
        ("-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
         "-td", str(args.threads), "-tbd", str(args.threads)))


def lookup_served(args: argparse.Namespace, k: int) -> None:
    """Prompt lookup (k draft tokens at most) against llama-server's (ngram-simple, its
    defaults), served, one client, on lookup's copying prompts."""
    from localserve import LLM, SamplingParams

    target = real_shapes.model_path(args.shape, args.type)
    vocab = real_shapes.SHAPES[args.shape].vocab
    texts = real_shapes.prompt_ids(vocab, 4, PROMPT_TOKENS, seed=29)
    llm = LLM(target, device="cpu", threads=args.threads, kv_cache_memory=1 << 30)
    answers = [o.token_ids for o in llm.generate(texts, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS,
                                                                         ignore_eos=True))]
    del llm  # one system at a time
    prompts = [t + a + t[1:] for t, a in zip(texts, answers)]
    print(f"\nprompt lookup, served, one client, {len(prompts)} prompts of {len(prompts[0])} tokens repeating "
          f"their answer, k {k} ({args.repeats} interleaved repeats)")
    # llama-server's own defaults (a 12-token lookup, up to 48 draft tokens): with a lookup
    # of 4 and k draft tokens like ours it gained nothing here (0.97x).
    compare_served(args, target, ["own"], prompts, ("--speculative", "ngram", "--num-speculative-tokens", str(k)),
                   ("--spec-type", "ngram-simple"))


def compare_served(args: argparse.Namespace, target: Path, workloads: list[str], prompts: list[list[int]] | None,
                   ours: tuple[str, ...], theirs: tuple[str, ...]) -> None:
    """Each server with and without its speculative options, interleaved; the figures,
    drafting's gain in each, and ours over theirs with it."""
    import tempfile

    options = {("localserve", False): (), ("localserve", True): ours, ("llama.cpp", False): (),
               ("llama.cpp", True): theirs}
    with tempfile.TemporaryDirectory() as workdir:
        for workload in workloads:
            samples: dict[tuple[str, bool], list[float]] = {}
            accepted: dict[tuple[str, bool], list[float]] = {}
            for repeat in range(args.repeats):
                for case in (list(options) if repeat % 2 == 0 else list(options)[::-1]):
                    sample = real_shapes.served(case[0], target, workload, args, Path(workdir), options[case], prompts)
                    samples.setdefault(case, []).append(sample.value)
                    if sample.extra.get("acceptance") is not None:
                        accepted.setdefault(case, []).append(sample.extra["acceptance"])
            tpot = workload in real_shapes.LOWER_IS_BETTER
            print(f"  {'one client' if tpot else workload + ' clients'} ({'TPOT ms' if tpot else 'output tok/s'}):")
            for case, values in samples.items():
                rate = f", drafts accepted {statistics.median(accepted[case]):.2f}" if case in accepted else ""
                print(f"    {case[0]:>10} {'drafting' if case[1] else 'plain':>10}: {cell(values)}{rate}")

            def gain(faster: tuple[str, bool], slower: tuple[str, bool]) -> float:
                ratio = statistics.median(samples[faster]) / statistics.median(samples[slower])
                return 1 / ratio if tpot else ratio

            print(f"    drafting's gain: localserve {gain(('localserve', True), ('localserve', False)):.2f}x, "
                  f"llama.cpp {gain(('llama.cpp', True), ('llama.cpp', False)):.2f}x; localserve drafting over "
                  f"llama.cpp drafting: {gain(('localserve', True), ('llama.cpp', True)):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(real_shapes.SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", nargs="+", default=["mechanics", "lookup", "lookup-served", "draft"],
                        choices=["mechanics", "lookup", "lookup-served", "draft"])
    parser.add_argument("--draft-workloads", nargs="+", default=["one", "16"], choices=["one", "16"],
                        help="the draft pair's served workloads (real_shapes' one and 16)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k of the served comparisons")
    parser.add_argument("--draft-model", type=Path, help="the draft part's draft (default: the shape's first two layers)")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 16], help="mechanics' client counts")
    args = parser.parse_args()
    from localserve import LLM, SpeculativeConfig

    print(cpu_summary())
    if {"mechanics", "lookup"} & set(args.parts):
        path = real_shapes.model_path(args.shape, args.type)
        print(f"{path.name}, {args.threads} threads")
        llm = LLM(path, device="cpu", threads=args.threads, max_num_seqs=16, enable_prefix_caching=False,
                  kv_cache_memory=16 * (PROMPT_TOKENS * 3 + 2 * OUTPUT_TOKENS) * real_shapes.kv_bytes_per_token(path),
                  speculative=SpeculativeConfig(num_tokens=8))
        vocab = real_shapes.SHAPES[args.shape].vocab
        if "mechanics" in args.parts:
            mechanics(llm, vocab, args.repeats, args.clients)
        if "lookup" in args.parts:
            lookup(llm, vocab, args.repeats)
        del llm  # one system at a time
    if "lookup-served" in args.parts:
        lookup_served(args, args.draft_tokens)
    if "draft" in args.parts:
        draft_pair(args, args.draft_tokens, args.draft_workloads)


if __name__ == "__main__":
    main()
