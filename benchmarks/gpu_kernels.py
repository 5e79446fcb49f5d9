"""The GPU kernels at real model shapes, each as a share of the physical limit it is bound by,
beside torch's own baseline for the same work (the GPU proof's kernel stage).

    python benchmarks/gpu_kernels.py [--json FILE]
    python benchmarks/gpu_kernels.py --dry-run      # tiny shapes on the CPU: the harness only

Rows (Llama-3.1-8B: hidden 4096, 32/8 heads of 128, FFN 14336, vocabulary 128,256;
Qwen3-30B-A3B: hidden 2048, 32/4 heads, 128 experts of width 768, 8 used):

* ``gemv``: one token through each of a decode step's linears (q/k/v, o, gate/up, down, LM
  head) in GPTQ 4-bit (groups of 128), GGUF Q4_K, Q6_K and Q8_0: weight bytes moved per
  second over the HBM peak (target 60% for the 4-bit types); cuBLAS on fp16 weights beside.
* ``gemm``: a 2,048-token prefill chunk through the gate/up projection: TFLOP/s over the
  tensor cores' dense fp16 peak; cuBLAS fp16 beside.
* ``attention``: paged decode attention (fp16, int8 and, from compute 8.9, fp8 caches) for
  1, 16 and 64 sequences of 1,024 and 8,192 tokens: cache bytes read per second over the HBM
  peak; torch's SDPA over the same keys and values laid out contiguously beside (target:
  at most 1.2x its time for the fp16 cache).
* ``moe``: the fused MoE layer at Qwen3-30B-A3B's shape for 1, 16 and 256 tokens (Q4_K and
  fp16 experts): the bytes of the experts used per second over the HBM peak; the per-expert
  loop (moe_ref) beside.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_shapes import random_quant_blocks  # noqa: E402

from localserve.doctor.bench import ATTENTION_TARGET, GEMV_BANDWIDTH_TARGET, median_seconds  # noqa: E402
from localserve.doctor.checks import random_experts, random_quant_weight  # noqa: E402
from localserve.doctor.host import peak_bandwidth, peak_fp16_flops  # noqa: E402
from localserve.formats.gguf_quants import gguf_to_weight  # noqa: E402
from localserve.kernels import AttentionMetadata, KVCache, attention, moe, moe_ref, quant_linear  # noqa: E402
from localserve.kernels.experts import ExpertMLP, ExpertWeights  # noqa: E402
from localserve.kernels.quant_weight import QuantWeight  # noqa: E402

GGML_TYPE_IDS = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


@dataclass
class Row:
    stage: str  # gemv, gemm, attention, moe
    name: str
    seconds: float
    achieved: float  # bytes/s or flop/s
    limit: float | None  # the physical limit, same unit
    share: float | None  # achieved / limit
    baseline: str
    baseline_seconds: float
    baseline_share: float | None
    target: str = ""
    status: str = "info"  # pass, fail or info


@dataclass(frozen=True)
class Scale:
    """The shapes, divided for a dry run on the CPU."""

    hidden: int = 4096
    ffn: int = 14336
    vocab: int = 128256
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    prefill: int = 2048
    contexts: tuple[int, ...] = (1024, 8192)
    batches: tuple[int, ...] = (1, 16, 64)
    moe_hidden: int = 2048
    experts: int = 128
    expert_ffn: int = 768
    moe_tokens: tuple[int, ...] = (1, 16, 256)


FULL = Scale()
DRY = Scale(hidden=256, ffn=512, vocab=1024, heads=4, kv_heads=2, head_dim=64, prefill=32, contexts=(64,),
            batches=(1, 4), moe_hidden=256, experts=8, expert_ffn=256, moe_tokens=(1, 4))


def cpu_timer(fn: Callable[[], object]) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gguf_weight(kind: str, rows: int, columns: int, device: torch.device, rng: np.random.Generator) -> QuantWeight:
    raw = random_quant_blocks(rng, kind, rows, columns, columns ** -0.5)
    weight = gguf_to_weight("w", raw, GGML_TYPE_IDS[kind], (rows, columns))
    assert isinstance(weight, QuantWeight)
    return weight.to(device)


def make_weight(kind: str, rows: int, columns: int, device: torch.device, rng: np.random.Generator) -> QuantWeight:
    """GPTQ 4-bit in groups of 128 (the doctor's random weight), or random GGUF blocks."""
    if kind == "GPTQ-4bit":
        return random_quant_weight(rows, columns, 128, device)
    return gguf_weight(kind, rows, columns, device, rng)


def gemv_rows(scale: Scale, device: torch.device, dtype: torch.dtype, timer: Callable, peak: float | None
              ) -> list[Row]:
    """A decode step's linears at batch 1, summed over one layer's matrices and the LM head."""
    q, kv = scale.heads * scale.head_dim, scale.kv_heads * scale.head_dim
    matrices = {"qkv": (q + 2 * kv, scale.hidden), "o": (scale.hidden, q), "gate_up": (2 * scale.ffn, scale.hidden),
                "down": (scale.hidden, scale.ffn), "lm_head": (scale.vocab, scale.hidden)}
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("GPTQ-4bit", "Q4_K", "Q6_K", "Q8_0"):
        for name, (n, k) in matrices.items():
            weight = make_weight(kind, n, k, device, rng)
            x = torch.randn(1, k, device=device, dtype=dtype)
            dense = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
            ours = timer(lambda: quant_linear.quant_linear(x, weight))
            cublas = timer(lambda: F.linear(x, dense))
            moved, dense_moved = weight.nbytes + x.nbytes + n * x.element_size(), dense.nbytes + x.nbytes
            four_bit = kind in ("GPTQ-4bit", "Q4_K")
            share = moved / ours / peak if peak else None
            rows.append(Row("gemv", f"{kind} {name} {n}x{k}", ours, moved / ours, peak, share, "fp16 F.linear",
                            cublas, dense_moved / cublas / peak if peak else None,
                            target=f">= {GEMV_BANDWIDTH_TARGET:.0%} of HBM" if four_bit else "",
                            status=("pass" if share >= GEMV_BANDWIDTH_TARGET else "fail") if four_bit and share else "info"))
            del weight, dense
    return rows


def gemm_rows(scale: Scale, device: torch.device, dtype: torch.dtype, timer: Callable, peak: float | None
              ) -> list[Row]:
    n, k = 2 * scale.ffn, scale.hidden
    x = torch.randn(scale.prefill, k, device=device, dtype=dtype)
    dense = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
    cublas = timer(lambda: F.linear(x, dense))
    flops = 2 * scale.prefill * n * k
    rows = []
    for kind in ("GPTQ-4bit", "Q4_K"):
        weight = make_weight(kind, n, k, device, np.random.default_rng(1))
        ours = timer(lambda: quant_linear.quant_linear(x, weight))
        rows.append(Row("gemm", f"{kind} gate_up, {scale.prefill} tokens", ours, flops / ours, peak,
                        flops / ours / peak if peak else None, "fp16 F.linear (cuBLAS)", cublas,
                        flops / cublas / peak if peak else None))
    return rows


def attention_rows(scale: Scale, device: torch.device, dtype: torch.dtype, timer: Callable, peak: float | None
                   ) -> list[Row]:
    caches = [("fp16", dtype)]
    if device.type == "cuda":
        caches.append(("int8", torch.int8))
        if torch.cuda.get_device_capability(device) >= (8, 9):
            caches.append(("fp8", torch.float8_e4m3fn))
    block_size, rows = 16, []
    for batch in scale.batches:
        for context in scale.contexts:
            per_seq = context // block_size
            tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).to(torch.int32)
            query = torch.randn(batch, scale.heads, scale.head_dim, device=device, dtype=dtype)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_tables=tables,
                max_query_len=1, max_seq_len=context, query_lens_host=[1] * batch, seq_lens_host=[context] * batch)
            attn_scale = scale.head_dim ** -0.5
            keys = torch.randn(batch * context, scale.kv_heads, scale.head_dim, device=device, dtype=dtype)
            values = torch.randn_like(keys)
            # The baseline: the same keys and values contiguous per sequence, heads shared by
            # GQA inside SDPA (no copies).
            contiguous_k = keys.view(batch, context, scale.kv_heads, scale.head_dim).transpose(1, 2).contiguous()
            contiguous_v = values.view(batch, context, scale.kv_heads, scale.head_dim).transpose(1, 2).contiguous()
            sdpa = timer(lambda: F.scaled_dot_product_attention(query.unsqueeze(2), contiguous_k, contiguous_v,
                                                                scale=attn_scale, enable_gqa=True))
            sdpa_bytes = contiguous_k.nbytes + contiguous_v.nbytes
            for cache_name, cache_dtype in caches:
                cache = KVCache.allocate(batch * per_seq, block_size, scale.kv_heads, scale.head_dim, cache_dtype, device)
                slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten()
                attention.write_kv(keys, values, cache, slots)
                ours = timer(lambda: attention.paged_attention(query, cache, meta, attn_scale))
                read = cache.key.nbytes + cache.value.nbytes + sum(
                    s.nbytes for s in (cache.key_scale, cache.value_scale) if s is not None)
                ratio = ours / sdpa
                checked = cache_name == "fp16" and peak is not None  # judged on a GPU only
                rows.append(Row("attention", f"{cache_name} cache, {batch} x {context} tokens", ours, read / ours, peak,
                                read / ours / peak if peak else None, "SDPA, contiguous fp16 KV", sdpa,
                                sdpa_bytes / sdpa / peak if peak else None,
                                target=f"<= {ATTENTION_TARGET}x SDPA ({ratio:.2f}x)" if checked else f"{ratio:.2f}x SDPA",
                                status=("pass" if ratio <= ATTENTION_TARGET else "fail") if checked else "info"))
                del cache
    return rows


def moe_rows(scale: Scale, device: torch.device, dtype: torch.dtype, timer: Callable, peak: float | None
             ) -> list[Row]:
    rng = np.random.default_rng(2)
    e, h, w = scale.experts, scale.moe_hidden, scale.expert_ffn

    def q4_k(out_features: int, in_features: int) -> ExpertWeights:
        return ExpertWeights(gguf_weight("Q4_K", e * out_features, in_features, device, rng), e)

    rows = []
    for kind in ("Q4_K", "fp16"):
        experts = ExpertMLP([q4_k(2 * w, h)], q4_k(h, w)) if kind == "Q4_K" else random_experts(e, h, w, device, dtype)
        expert_bytes = sum(part.weight.nbytes for part in (*experts.gate_up, experts.down)) / e
        for tokens in scale.moe_tokens:
            x = torch.randn(tokens, h, device=device, dtype=dtype)
            gates, ids = moe.route(torch.randn(tokens, e, device=device), 8, renormalize=True)
            used = ids.unique().numel()
            ours = timer(lambda: moe.fused_moe(x, experts, gates, ids))
            loop = timer(lambda: moe_ref.fused_moe_ref(x, experts, gates, ids))
            moved = used * expert_bytes
            rows.append(Row("moe", f"{kind} experts, {tokens} tokens ({used} experts used)", ours, moved / ours, peak,
                            moved / ours / peak if peak else None, "per-expert loop (moe_ref)", loop,
                            moved / loop / peak if peak else None, target=f"{loop / ours:.1f}x faster than the loop"))
        del experts
    return rows


def run(dry_run: bool) -> dict[str, object]:
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    timer = median_seconds if cuda else cpu_timer
    scale = FULL if cuda else DRY
    bandwidth = peak_bandwidth(0) if cuda else None
    flops = peak_fp16_flops(0) if cuda else None
    torch.manual_seed(0)
    rows: list[Row] = []
    stages = {"gemv": (gemv_rows, bandwidth), "gemm": (gemm_rows, flops), "attention": (attention_rows, bandwidth),
              "moe": (moe_rows, bandwidth)}
    errors = {}
    for stage, (measure, peak) in stages.items():
        try:
            with torch.inference_mode():
                rows += measure(scale, device, dtype, timer, peak)
        except Exception as exc:  # one stage's failure is a finding; the others still run
            errors[stage] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if cuda:
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run: tiny shapes, no limits)",
            "peak_bandwidth_bytes_per_second": bandwidth, "peak_fp16_flops": flops,
            "rows": [asdict(row) for row in rows], "errors": errors,
            "failed": bool(errors) or any(row.status == "fail" for row in rows)}


def summary(result: dict[str, object]) -> list[str]:
    lines = [f"kernels on {result['device']}"]
    if result["peak_bandwidth_bytes_per_second"]:
        lines.append(f"limits: HBM {result['peak_bandwidth_bytes_per_second'] / 1e9:.0f} GB/s, "
                     f"fp16 tensor cores {(result['peak_fp16_flops'] or math.nan) / 1e12:.0f} TFLOP/s")
    for row in result["rows"]:  # type: ignore[union-attr]
        unit, div = ("TFLOP/s", 1e12) if row["stage"] == "gemm" else ("GB/s", 1e9)
        share = f" = {row['share']:.0%}" if row["share"] is not None else ""
        base_share = f" = {row['baseline_share']:.0%}" if row["baseline_share"] is not None else ""
        lines.append(f"{row['status'].upper():<4}  {row['stage']:<9} {row['name']}: {row['seconds'] * 1e6:.0f} us, "
                     f"{row['achieved'] / div:.0f} {unit}{share}; {row['baseline']} {row['baseline_seconds'] * 1e6:.0f} us"
                     f"{base_share}" + (f"; {row['target']}" if row["target"] else ""))
    for stage, error in result["errors"].items():  # type: ignore[union-attr]
        lines.append(f"FAIL  {stage}: {error}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (checks the harness)")
    args = parser.parse_args()
    result = run(args.dry_run)
    print("\n".join(summary(result)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
