"""Compile every Triton kernel ahead of time for real GPU targets, on a host without a GPU.

Each kernel is launched through its own dispatcher on CPU tensors of a real model's shapes,
with the launch intercepted: what the dispatcher would pass (argument types, the tile sizes
and flags it chooses) is compiled by ``triton.compile`` for sm_80, sm_86, sm_89 and sm_90
with the ptxas that ships in the triton wheel. A case fails on a compile error, on register
spills, or on shared memory above the target's limit. The interpreter the tests run in
accepts programs a real compiler rejects, so this is the check that the kernels build.

Prints one JSON line per (case, target); ``--markdown`` prints the table for the docs;
``--quick`` compiles a representative subset (what CI runs). Run it without
TRITON_INTERPRET set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter cannot compile for a GPU")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from localserve.formats.gguf_quants import gguf_to_weight  # noqa: E402
from localserve.kernels import attention_triton, moe_triton, quant_linear_triton  # noqa: E402
from localserve.kernels.experts import ExpertMLP, ExpertWeights  # noqa: E402
from localserve.kernels.paged_kv import AttentionMetadata  # noqa: E402

# Compute capability -> the most shared memory one block may use (opt-in), in bytes.
TARGETS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}


# Launch keywords that are compile options, not kernel arguments.
_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass(frozen=True)
class Launch:
    kernel: Any  # the JITFunction
    args: tuple
    constexprs: dict[str, Any]
    options: dict[str, Any]


@contextmanager
def intercepted(*kernels: Any) -> Iterator[list[Launch]]:
    """Launches of ``kernels`` are recorded instead of run."""
    launches: list[Launch] = []
    saved = [kernel.run for kernel in kernels]
    for kernel in kernels:
        kernel.run = lambda *args, grid, warmup, _k=kernel, **kw: launches.append(Launch(
            _k, args, {k: v for k, v in kw.items() if k not in _OPTIONS}, {k: v for k, v in kw.items() if k in _OPTIONS}))
    try:
        yield launches
    finally:
        for kernel, run in zip(kernels, saved):
            kernel.run = run


def signature(launch: Launch) -> tuple[dict[str, str], dict[str, Any]]:
    names = launch.kernel.arg_names
    runtime = [n for n in names if n not in launch.constexprs]
    types = {}
    for name, value in zip(runtime, launch.args, strict=True):
        if isinstance(value, torch.Tensor):
            types[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(value).__name__}")
    types |= {name: "constexpr" for name in launch.constexprs}
    return {n: types[n] for n in names}, dict(launch.constexprs)


def compile_for(launch: Launch, capability: int) -> dict[str, Any]:
    types, constexprs = signature(launch)
    start = time.monotonic()
    compiled = triton.compile(ASTSource(launch.kernel, types, constexprs), target=GPUTarget("cuda", capability, 32),
                              options=launch.options)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], capability)
    return {"registers": registers, "spill_bytes": spills, "shared_bytes": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps, "seconds": round(time.monotonic() - start, 2)}


def _ptxas_usage(ptx: str, capability: int) -> tuple[int, int]:
    """Registers per thread and spilled bytes, from ``ptxas -v`` on the kernel's PTX."""
    arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        result = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", source, "-o",
                                 os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise RuntimeError(f"ptxas failed: {result.stderr[-2000:]}")
    registers = int(re.search(r"Used (\d+) registers", result.stderr)[1])  # type: ignore[index]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", result.stderr))
    return registers, spills


# -- cases: each launches one kernel through its dispatcher on a real model's shapes --------

def _attention(dtype: torch.dtype, cache: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               query_len: int, write: bool, softcap: float = 0.0, sinks: bool = False) -> None:
    blocks, block_size, seqs = 8, 16, 2
    k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.zeros(blocks, block_size, kv_heads), torch.zeros(blocks, block_size, kv_heads)) \
        if cache in (torch.int8, torch.float8_e4m3fn) else (None, None)
    tokens = seqs * query_len
    if write:
        key = torch.zeros(tokens, kv_heads, head_dim, dtype=dtype)
        attention_triton.write_kv(key, key.clone(), k_cache, v_cache, torch.arange(tokens), *scales)
        return
    seq_len = max(query_len, 24)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens), query_start_loc=torch.arange(seqs + 1, dtype=torch.int32) * query_len,
        seq_lens=torch.full((seqs,), seq_len, dtype=torch.int32),
        block_tables=torch.arange(seqs * 4, dtype=torch.int32).view(seqs, 4),
        max_query_len=query_len, max_seq_len=seq_len, query_lens_host=[query_len] * seqs,
        seq_lens_host=[seq_len] * seqs)
    query = torch.zeros(tokens, heads, head_dim, dtype=dtype)
    attention_triton.paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5, *scales, window=128,
                                     softcap=softcap, sinks=torch.zeros(heads) if sinks else None)


# The GGUF types by the layout the reader gives them: affine codes (one or two levels of
# scales, zeros or mins) and codebooks (the IQ types' and MXFP4's lookup before scaling).
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ2_0",
              "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ1_M", "MXFP4"]


def _gguf_weight(kind: str, rows: int, columns: int) -> Any:
    """A weight as the GGUF loader makes it (zero blocks: the layout is what matters)."""
    qtype = GGMLQuantizationType[kind]
    elements, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(rows * columns // elements * size, dtype=np.uint8)
    return gguf_to_weight("w", raw, int(qtype), (rows, columns))


def _gptq_weight(bits: int, group: int, rows: int, columns: int) -> Any:
    from localserve.formats.hf import QuantConfig
    from localserve.formats.hf_quant import gptq_to_quant_weight

    pack, groups = 32 // bits, columns // group
    parts = {"qweight": torch.zeros(columns // pack, rows, dtype=torch.int32),
             "qzeros": torch.zeros(groups, rows // pack, dtype=torch.int32),
             "scales": torch.ones(groups, rows, dtype=torch.float16),
             "g_idx": torch.arange(columns, dtype=torch.int32) // group}
    return gptq_to_quant_weight("w", parts, QuantConfig("gptq", bits, group))


def _awq_weight(group: int, rows: int, columns: int) -> Any:
    from localserve.formats.hf import QuantConfig
    from localserve.formats.hf_quant import awq_to_quant_weight

    groups = columns // group
    parts = {"qweight": torch.zeros(columns, rows // 8, dtype=torch.int32),
             "qzeros": torch.zeros(groups, rows // 8, dtype=torch.int32),
             "scales": torch.ones(groups, rows, dtype=torch.float16)}
    return awq_to_quant_weight("w", parts, QuantConfig("awq", 4, group))


def _linear(dtype: torch.dtype, weight: Any, m: int) -> None:
    x = torch.zeros(m, weight.in_features, dtype=dtype)
    quant_linear_triton.quant_linear(x, weight, None)


def _moe(dtype: torch.dtype, kind: str, experts: int, top_k: int, hidden: int, width: int, tokens: int) -> None:
    def stack(rows: int, columns: int) -> ExpertWeights:
        if kind == "dense":
            return ExpertWeights(torch.zeros(experts, rows, columns, dtype=dtype), experts)
        return ExpertWeights(_gguf_weight(kind, experts * rows, columns), experts)

    mlp = ExpertMLP([stack(2 * width, hidden)], stack(hidden, width))
    ids = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    gates = torch.full((tokens, top_k), 1.0 / top_k)
    moe_triton.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), mlp, gates, ids)


def cases(quick: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    dtypes = [torch.float16] if quick else [torch.float16, torch.bfloat16]
    # (heads, kv heads, head dim) of the built-in demo (heads of 8: narrower than a tl.dot
    # operand), Llama-3.2-1B, Qwen2.5-1.5B, Llama-3.1-8B, a head-dim-256 model.
    shapes = [(8, 4, 8), (32, 8, 64), (12, 2, 128)] if quick else \
        [(8, 4, 8), (32, 8, 64), (12, 2, 128), (32, 8, 128), (16, 8, 256)]
    caches = ["model", "int8"] if quick else ["model", "int8", "fp8"]
    for dtype in dtypes:
        for heads, kv_heads, head_dim in shapes:
            for cache_name in caches:
                cache = {"model": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache_name]
                tag = f"{str(dtype)[6:]} {heads}/{kv_heads}x{head_dim} cache {cache_name}"
                yield f"write_kv {tag}", lambda a=(dtype, cache, heads, kv_heads, head_dim): _attention(*a, 1, True)
                for query_len in (1, 64):
                    phase = "decode" if query_len == 1 else "prefill"
                    yield (f"paged_attention {phase} {tag}",
                           lambda a=(dtype, cache, heads, kv_heads, head_dim, query_len): _attention(*a, False))
        # The variants' programs: Gemma 2's soft cap (8/4 x 256) and GPT-OSS's sinks (64/8 x 64).
        for query_len in (1, 64):
            phase = "decode" if query_len == 1 else "prefill"
            yield (f"paged_attention {phase} {str(dtype)[6:]} 8/4x256 softcap",
                   lambda a=(dtype, query_len): _attention(a[0], a[0], 8, 4, 256, a[1], False, softcap=50.0))
            yield (f"paged_attention {phase} {str(dtype)[6:]} 64/8x64 sinks",
                   lambda a=(dtype, query_len): _attention(a[0], a[0], 64, 8, 64, a[1], False, sinks=True))
        kinds = ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS"] if quick else GGUF_TYPES
        for m in ((1, 64) if quick else (1, 16, 32, 64)):
            for kind in kinds:
                yield f"quant_linear {str(dtype)[6:]} {kind} m={m}", \
                    lambda a=(dtype, kind, m): _linear(a[0], _gguf_weight(a[1], 2048, 2048), a[2])
            for bits in ((4,) if quick else (4, 8)):
                yield f"quant_linear {str(dtype)[6:]} GPTQ {bits}-bit g128 m={m}", \
                    lambda a=(dtype, bits, m): _linear(a[0], _gptq_weight(a[1], 128, 2048, 2048), a[2])
            if not quick:
                yield f"quant_linear {str(dtype)[6:]} AWQ 4-bit g128 m={m}", \
                    lambda a=(dtype, m): _linear(a[0], _awq_weight(128, 2048, 2048), a[1])
        for kind in (["dense", "Q4_K", "MXFP4"] if quick else ["dense", "Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "MXFP4"]):
            for tokens in ((1, 256) if quick else (1, 256, 1024)):
                yield f"fused_moe {str(dtype)[6:]} {kind} 64x top-8 tokens={tokens}", \
                    lambda a=(dtype, kind, tokens): _moe(a[0], a[1], 64, 8, 1024, 512, a[2])


KERNELS = (attention_triton._write_kv_kernel, attention_triton._paged_attention_kernel,
           quant_linear_triton._quant_linear_kernel, moe_triton._moe_gemm_kernel)


def run(quick: bool, targets: list[int], only: str = "") -> Iterator[dict[str, Any]]:
    seen: set[tuple] = set()
    for name, launch_case in cases(quick):
        if not name.startswith(only):
            continue
        with intercepted(*KERNELS) as launches:
            launch_case()
        for launch in launches:
            types, constexprs = signature(launch)
            key = (launch.kernel.__name__, tuple(types.items()), tuple(sorted(constexprs.items())),
                   tuple(sorted(launch.options.items())))
            if key in seen:
                continue  # another case chose the same program
            seen.add(key)
            config = ", ".join([f"{k}={v}" for k, v in constexprs.items() if k.startswith("BLOCK_")]
                               + [f"{k}={v}" for k, v in launch.options.items()])
            # float8 e4m3 needs compute capability 8.9 (Ada, Hopper); the engine refuses it below.
            fp8 = "*fp8e4nv" in types.values()
            for capability in (t for t in targets if t >= 89 or not fp8):
                row = {"case": name, "kernel": launch.kernel.__name__, "config": config, "target": f"sm_{capability}"}
                try:
                    row |= compile_for(launch, capability)
                    problems = []
                    if row["spill_bytes"]:
                        problems.append(f"{row['spill_bytes']} bytes of register spills")
                    if row["shared_bytes"] > TARGETS[capability]:
                        problems.append(f"{row['shared_bytes']} bytes of shared memory, over {TARGETS[capability]}")
                    row["error"] = "; ".join(problems) or None
                except Exception as exc:  # a compile error is this case's result
                    row["error"] = f"{type(exc).__name__}: {str(exc)[-500:]}"
                yield row


def markdown(rows: list[dict[str, Any]]) -> str:
    """Per kernel and target: programs compiled, the most registers and shared memory any
    takes, and the spills and failures (both 0 when all is well)."""
    lines = ["| kernel | target | programs | most registers | most shared memory | spilled bytes | failures |",
             "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["kernel"].strip("_"), row["target"]), []).append(row)
    for (kernel, target), group in groups.items():
        built = [r for r in group if "registers" in r]
        lines.append(f"| {kernel} | {target} | {len(group)} | {max((r['registers'] for r in built), default='-')} "
                     f"| {max((r['shared_bytes'] for r in built), default='-')} B "
                     f"| {sum(r['spill_bytes'] for r in built)} | {sum(1 for r in group if r['error'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset (what CI compiles)")
    parser.add_argument("--markdown", action="store_true", help="print the table for the docs")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities")
    parser.add_argument("--only", default="", help="only the cases whose name starts with this")
    options = parser.parse_args()
    rows = []
    for row in run(options.quick, [int(t) for t in options.targets.split(",")], options.only):
        rows.append(row)
        if not options.markdown:
            print(json.dumps(row), flush=True)
    if options.markdown:
        print(markdown(rows))
    sys.exit(1 if any(row["error"] for row in rows) else 0)


if __name__ == "__main__":
    main()
