"""Does each kernel this host runs agree with its torch reference, and does a model run
end to end? On a GPU the first call of each Triton kernel compiles it for the device, so a
compile failure shows here as that check failing, with the compiler's message."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import AttentionMetadata, KVCache, attention, attention_ref, moe, moe_ref, quant_linear
from ..kernels.experts import ExpertMLP, ExpertWeights
from ..kernels.quant_weight import QuantWeight, pack_codes
from .report import Report


def kernel_checks(report: Report, device: torch.device) -> None:
    """Each kernel on small real-shaped inputs against its reference, in the dtype the
    engine computes in on this device."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    cases: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = [
        ("paged attention", lambda: _attention(device, dtype, kv_dtype=dtype)),
        ("4-bit linear, groups of 128 (GPTQ/AWQ)", lambda: _linear(device, dtype, rows=4, group=128)),
        ("4-bit linear, K-quant two-level scales", lambda: _linear(device, dtype, rows=4, group=32, two_level=True)),
        ("fused MoE", lambda: _moe(device, dtype)),
    ]
    if device.type == "cuda":  # on the CPU an 8-bit cache runs the reference itself
        cases.insert(1, ("paged attention, int8 cache", lambda: _attention(device, dtype, kv_dtype=torch.int8)))
    kind = "Triton" if device.type == "cuda" else "CPU kernel"
    for name, case in cases:
        start = time.perf_counter()
        try:
            ours, reference = case()
        except Exception as exc:  # a compile or launch failure is the finding
            report.add(f"{name} ({kind})", "fail", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        seconds = time.perf_counter() - start
        error = ((ours.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()
        ok = math.isfinite(error) and error <= tolerance
        report.add(f"{name} ({kind})", "pass" if ok else "fail",
                   f"relative error {error:.1e} (limit {tolerance:.0e}), first call {seconds * 1000:.0f} ms",
                   relative_error=error, first_call_seconds=seconds)


def _generator(device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


def _attention(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-3.1-8B's heads (32 query, 8 KV, 128 wide): decodes and a prefill chunk."""
    g = _generator()
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    query_lens, seq_lens = [1, 1, 45, 1], [300, 17, 60, 1000]
    blocks = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=g).tolist()
    tables, start = [], 0
    for count in blocks:
        tables.append(order[start:start + count] + [0] * (max(blocks) - count))
        start += count
    shape = (sum(blocks), block_size, kv_heads, head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    cache = KVCache.allocate(shape[0], block_size, kv_heads, head_dim, kv_dtype, device)
    slots = torch.arange(shape[0] * block_size, device=device)
    attention.write_kv(keys.flatten(0, 1).to(device, dtype), values.flatten(0, 1).to(device, dtype), cache, slots)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(device, dtype)

    def on(values: list[int], kind: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=kind, device=device)

    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    meta = AttentionMetadata(slot_mapping=on([0] * len(query), torch.int64), query_start_loc=on(starts, torch.int32),
                             seq_lens=on(seq_lens, torch.int32), block_tables=on(tables, torch.int32),
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_host=query_lens,
                             seq_lens_host=seq_lens)
    scale = head_dim ** -0.5
    ours = attention.paged_attention(query, cache, meta, scale)
    reference = attention_ref.paged_attention(query.float(), cache.key, cache.value, meta, scale, cache.key_scale,
                                              cache.value_scale)
    return ours, reference


def random_quant_weight(out_features: int, in_features: int, group: int, device: torch.device,
                        two_level: bool = False) -> QuantWeight:
    """A 4-bit QuantWeight of random codes: zero points and fp16 scales per group, or
    GGUF K-quant style integer sub-scales and mins under fp16 super-scales. Drawn on the
    device: an 8B model's LM head would take gigabytes of int64 codes on the host."""
    g, on = _generator(device), {"device": device}
    groups = in_features // group
    codes = pack_codes(torch.randint(0, 16, (out_features, in_features), generator=g, **on), 4)
    if not two_level:
        scales = (torch.rand(out_features, groups, generator=g, **on) * 0.02).half()
        zeros = torch.randint(0, 16, (out_features, groups), generator=g, **on).to(torch.uint8)
        return QuantWeight(4, group, codes, scales, zeros=zeros)
    per_super = 256 // group
    sub = torch.randint(0, 64, (out_features, groups), generator=g, **on).to(torch.uint8)
    mins = torch.randint(0, 64, (out_features, groups), generator=g, **on).to(torch.uint8)
    supers = (torch.rand(out_features, groups // per_super, generator=g, **on) * 1e-3).half()
    return QuantWeight(4, group, codes, sub, mins=mins, super_scales=supers, super_mins=supers / 4,
                       groups_per_super=per_super)


def _linear(device: torch.device, dtype: torch.dtype, rows: int, group: int,
            two_level: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    weight = random_quant_weight(1024, 2048, group, device, two_level)
    x = torch.randn(rows, 2048, generator=_generator()).to(device, dtype)
    return quant_linear.quant_linear(x, weight), quant_linear.quant_linear_ref(x.float(), weight)


def random_experts(num_experts: int, hidden: int, intermediate: int, device: torch.device,
                   dtype: torch.dtype) -> ExpertMLP:
    g = _generator(device)

    def stack(out_features: int, in_features: int) -> ExpertWeights:
        weight = torch.randn(num_experts, out_features, in_features, generator=g, device=device) * in_features ** -0.5
        return ExpertWeights(weight.to(dtype), num_experts)

    return ExpertMLP([stack(2 * intermediate, hidden)], stack(hidden, intermediate))


def _moe(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-30B-A3B's routing (128 experts, top 8) at narrower widths, 16 tokens."""
    experts = random_experts(128, 256, 128, device, dtype)
    g = _generator()
    x = torch.randn(16, 256, generator=g).to(device, dtype)
    gates, ids = moe.route(torch.randn(16, 128, generator=g).to(device), 8, renormalize=True)
    ours = moe.fused_moe(x, experts, gates, ids)
    reference = moe_ref.fused_moe_ref(x.float(), experts.to(device, torch.float32), gates, ids)
    return ours, reference


SPEED_REPEATS = 5  # timed generations of the demo model after the first; the figure is their median
BUSY_CORES = 0.5  # other programs' mean use of the cores above which the host counts as busy


@dataclass(frozen=True, slots=True)
class Speed:
    """Tokens/s of repeated generations, and how many cores other programs kept busy meanwhile."""

    rates: list[float]
    others_cores: float

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def describe(self) -> str:
        line = (f"{self.median:.0f} tokens/s (median of {len(self.rates)}, "
                f"{min(self.rates):.0f}-{max(self.rates):.0f})")
        if self.others_cores >= BUSY_CORES:
            line += f"; the host was busy: other programs used {self.others_cores:.1f} cores meanwhile"
        return line


def others_busy_cores(run: Callable[[], object]) -> float:
    """Run ``run``; the cores other processes kept busy meanwhile, on average (steal time
    included: a VM's neighbours take the cores too)."""
    import psutil

    me = psutil.Process()
    before, own_before, start = psutil.cpu_times(), me.cpu_times(), time.perf_counter()
    run()
    after, own_after, wall = psutil.cpu_times(), me.cpu_times(), time.perf_counter() - start

    def busy(t: Any) -> float:
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    own = (own_after.user - own_before.user) + (own_after.system - own_before.system)
    return max(0.0, (busy(after) - busy(before) - own) / wall) if wall > 0 else 0.0


def model_check(report: Report, device: torch.device, demo: str) -> None:
    """The built-in demo model generates greedily on ``device``; on a GPU, the same tokens
    as on the CPU (fp32 both, so they agree to the last token). Its speed is the median of
    repeats, with their spread and a note when other programs kept the host busy."""
    from ..engine.engine import Engine
    from ..engine.sampling_params import SamplingParams

    def generate(engine: Engine) -> tuple[list[int], float]:
        start = time.perf_counter()
        engine.add_request("Once upon a time", SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens = output.token_ids
        return tokens, len(tokens) / (time.perf_counter() - start)

    try:
        engine = Engine(demo, device=device, dtype=torch.float32)
        tokens, _ = generate(engine)  # the first also warms up
        rates: list[float] = []
        others = others_busy_cores(lambda: rates.extend(generate(engine)[1] for _ in range(SPEED_REPEATS)))
        speed = Speed(rates, others)
        expected = tokens
        if device.type == "cuda":
            expected = generate(Engine(demo, device=torch.device("cpu"), dtype=torch.float32))[0]
    except Exception as exc:
        report.add(f"demo model on {device.type}", "fail", f"{type(exc).__name__}: {exc}")
        return
    ok = len(tokens) == 32 and tokens == expected
    detail = f"32 tokens at {speed.describe()}" + (", the CPU's tokens" if device.type == "cuda" else "")
    if not ok:
        detail = f"generated {len(tokens)} tokens; they differ from the CPU's at position " + str(
            next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected))))
    report.add(f"demo model on {device.type}", "pass" if ok else "fail", detail, tokens_per_second=speed.median,
               tokens_per_second_min=min(speed.rates), tokens_per_second_max=max(speed.rates),
               other_programs_cores=others)
