"""The GPU kernels' microbenchmarks, with the performance targets as pass/fail lines:

- the 4-bit dequantize-GEMV at batch 1 (a decode step's linears) moves its weight at 60% or
  more of the GPU's peak memory bandwidth;
- paged decode attention takes at most 1.2x the time of torch's SDPA over the same keys
  and values laid out contiguously (what paging may cost).

The other figures (4-bit GEMM vs fp16 matmul at 1-64 rows, fused MoE vs a per-expert
loop) are information. Times are medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels import AttentionMetadata, KVCache, attention, moe, moe_ref, quant_linear
from .checks import random_experts, random_quant_weight
from .host import peak_bandwidth
from .report import Report

GEMV_BANDWIDTH_TARGET = 0.60  # share of peak
ATTENTION_TARGET = 1.2  # times SDPA


def median_seconds(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median")) / 1000


def gpu_benchmarks(report: Report, device: torch.device, timer: Callable[[Callable[[], object]], float] = median_seconds
                   ) -> None:
    _gemv(report, device, timer)
    _gemm(report, device, timer)
    _decode_attention(report, device, timer)
    _moe(report, device, timer)


def _gemv(report: Report, device: torch.device, timer: Callable[[Callable[[], object]], float]) -> None:
    """Llama-3.1-8B's down projection (4096 x 14336), 4-bit in groups of 128."""
    weight = random_quant_weight(4096, 14336, 128, device)
    x = torch.randn(1, 14336, device=device, dtype=torch.float16)
    seconds = timer(lambda: quant_linear.quant_linear(x, weight))
    moved = weight.nbytes + x.nbytes + 4096 * 2
    achieved = moved / seconds
    peak = peak_bandwidth(device.index or 0) if device.type == "cuda" else None
    if peak is None:
        report.add("4-bit GEMV, batch 1", "info", f"{achieved / 1e9:.0f} GB/s; the GPU's peak is unknown",
                   bandwidth_bytes_per_second=achieved)
        return
    share = achieved / peak
    report.add("4-bit GEMV, batch 1", "pass" if share >= GEMV_BANDWIDTH_TARGET else "fail",
               f"{achieved / 1e9:.0f} GB/s = {share:.0%} of peak {peak / 1e9:.0f} GB/s "
               f"(target {GEMV_BANDWIDTH_TARGET:.0%}), {seconds * 1e6:.0f} us",
               bandwidth_bytes_per_second=achieved, share_of_peak=share, seconds=seconds)


def _gemm(report: Report, device: torch.device, timer: Callable[[Callable[[], object]], float]) -> None:
    weight = random_quant_weight(4096, 4096, 128, device)
    dense = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    for rows in (1, 16, 64):
        x = torch.randn(rows, 4096, device=device, dtype=torch.float16)
        ours = timer(lambda: quant_linear.quant_linear(x, weight))
        fp16 = timer(lambda: F.linear(x, dense))
        report.add(f"4-bit GEMM vs fp16 matmul, {rows} rows", "info",
                   f"{ours * 1e6:.0f} us vs {fp16 * 1e6:.0f} us = {ours / fp16:.2f}x", seconds=ours,
                   fp16_seconds=fp16)


def _decode_attention(report: Report, device: torch.device, timer: Callable[[Callable[[], object]], float]) -> None:
    """16 sequences of 2,048 tokens decoding, Llama-3.1-8B's heads, fp16 cache."""
    batch, context, heads, kv_heads, head_dim, block_size = 16, 2048, 32, 8, 128, 16
    per_seq = context // block_size
    cache = KVCache.allocate(batch * per_seq, block_size, kv_heads, head_dim, torch.float16, device)
    cache.key.normal_()
    cache.value.normal_()
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch, heads, head_dim, device=device, dtype=torch.float16)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_tables=tables,
        max_query_len=1, max_seq_len=context, query_lens_host=[1] * batch, seq_lens_host=[context] * batch)
    # The same keys and values, contiguous per sequence and with each KV head repeated for its query heads.
    keys = cache.key[tables.long()].flatten(1, 2).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    values = cache.value[tables.long()].flatten(1, 2).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    q = query.unsqueeze(2)
    scale = head_dim ** -0.5
    ours = timer(lambda: attention.paged_attention(query, cache, meta, scale))
    sdpa = timer(lambda: F.scaled_dot_product_attention(q, keys, values, scale=scale))
    ratio = ours / sdpa
    report.add("paged decode attention vs SDPA", "pass" if ratio <= ATTENTION_TARGET else "fail",
               f"{ours * 1e6:.0f} us vs {sdpa * 1e6:.0f} us = {ratio:.2f}x (target {ATTENTION_TARGET}x or less); "
               f"{batch} sequences of {context} tokens", seconds=ours, sdpa_seconds=sdpa, ratio=ratio)


def _moe(report: Report, device: torch.device, timer: Callable[[Callable[[], object]], float]) -> None:
    """Qwen3-30B-A3B's experts (128 of hidden 2048 and width 768, top 8), 16 tokens."""
    experts = random_experts(128, 2048, 768, device, torch.float16)
    x = torch.randn(16, 2048, device=device, dtype=torch.float16)
    gates, ids = moe.route(torch.randn(16, 128, device=device), 8, renormalize=True)
    fused = timer(lambda: moe.fused_moe(x, experts, gates, ids))
    loop = timer(lambda: moe_ref.fused_moe_ref(x, experts, gates, ids))
    report.add("fused MoE vs per-expert loop, 16 tokens", "info",
               f"{fused * 1e6:.0f} us vs {loop * 1e6:.0f} us = {loop / fused:.1f}x faster", seconds=fused,
               loop_seconds=loop)
