"""Image requests against llama-server on the same files: a GGUF model and llama.cpp's
vision projector (mmproj), random weights at Gemma-3-4B's or Qwen2.5-VL-3B's shape.

    python benchmarks/llama_server.py                 # once: build llama-server (~20 min)
    python benchmarks/image_ttft.py                   # Gemma-3-4B: one image, then 8 clients
    python benchmarks/image_ttft.py --shape qwen2.5-vl-3b --workloads one --repeats 3
    python benchmarks/image_ttft.py --projector Q8_0  # the tower's matrices in Q8_0 (both systems)

Files: the text model (benchmarks/real_shapes.py's ``gemma-3-4b`` or ``qwen2.5-vl-3b``, Q4_K_M
by llama.cpp's quantizer) and an F16 (or Q8_0) projector at the model's image side (Gemma 3: SigLIP
so400m at 896 px, 27 layers 1,152 wide, 256 tokens per image projected to 2,560; Qwen2.5-VL:
its 32-layer, 1,280-wide window-attention tower, a token per 28 x 28 pixels, projected to
2,048), both cached in ``$LOCALSERVE_BENCH_CACHE``.

Workloads (each server started in turn, with the same thread count; the request is a chat
with one 1024 x 768 JPEG and a short question, streamed, 8 tokens out):

* ``one``: one request at a time, each with an image of its own (no encoder cache helps);
  time to the first token, which is the image's encoding plus the prompt's prefill.
* ``8``: 8 clients at once, each sending its own image; requests per minute (and the median
  time to first token).

localserve: ``serve --model bench=MODEL --mmproj bench=MMPROJ``; llama-server: ``-m MODEL
--mmproj MMPROJ -np N -c N*ctx``. With --repeats R the systems are interleaved R times and the
report gives medians with the spread; the ratio is localserve's over llama.cpp's (above 1:
localserve is better).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_server  # noqa: E402
from host_facts import cpu_summary  # noqa: E402
from real_shapes import SHAPES, kv_bytes_per_token, model_path  # noqa: E402
from servers import free_port, serving  # noqa: E402

# Gemma-3-4B's vision_config (its config.json) and its text model's width.
VISION = {"hidden": 1152, "ffn": 4304, "layers": 27, "heads": 16, "image_size": 896, "patch": 14}
TEXT_HIDDEN = 2560
# Qwen2.5-VL-3B's vision_config: blocks 7, 15, 23, 31 attend across the image, the rest in windows.
QWEN_VISION = {"hidden": 1280, "ffn": 3420, "layers": 32, "heads": 16, "patch": 14, "full_every": 8, "out": 2048}
QUESTION = "Describe this image in one sentence."
OUTPUT_TOKENS = 8
# Per request: the image's tokens (Gemma 3: 256; Qwen2.5-VL: 999 for 1024 x 768), the question, the answer.
CONTEXTS = {"gemma-3-4b": 512, "qwen2.5-vl-3b": 1280}


def projector_path(shape: str, matrices: str) -> Path:
    """Random weights at the model's image side, written as llama.cpp's converter writes
    an mmproj file with ``--outtype f16`` or ``q8_0``: the tower's matrices in that type
    (Q8_0 falls back to F16 for rows not a multiple of 32 long, as the converter's does)."""
    target = llama_server.cache_dir() / "models" / f"{shape}-mmproj-{matrices}.gguf"
    if not target.exists():
        print(f"writing {target.name} (random weights)", flush=True)
        write = _write_gemma3_projector if shape == "gemma-3-4b" else _write_qwen25vl_projector
        write(target.with_suffix(".partial"), matrices)
        target.with_suffix(".partial").replace(target)
    return target


def _add_matrix(writer, name: str, array: np.ndarray, matrices: str) -> None:  # type: ignore[no-untyped-def]
    import gguf

    if matrices == "Q8_0" and array.shape[-1] % 32 == 0:
        writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, array.astype(np.float16))


def _write_qwen25vl_projector(path: Path, matrices: str) -> None:
    """Qwen2.5-VL-3B's tower as a ``qwen2.5vl_merger`` projector: q/k/v apart, the patch
    kernel's two frames apart (F16), the merger's two linears, F32 vectors."""
    import gguf

    rng = np.random.default_rng(2)
    vision = QWEN_VISION
    hidden, ffn, joined = vision["hidden"], vision["ffn"], vision["hidden"] * 4
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(vision["out"])
    writer.add_vision_image_size(560)
    writer.add_vision_patch_size(vision["patch"])
    writer.add_vision_embedding_length(hidden)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(vision["layers"])
    writer.add_vision_head_count(vision["heads"])
    writer.add_vision_image_mean([0.48145466, 0.4578275, 0.40821073])
    writer.add_vision_image_std([0.26862954, 0.26130258, 0.27577711])
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(vision["full_every"])
    writer.add_vision_attention_layernorm_eps(1e-6)

    def matrix(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * (np.prod(shape[1:]) ** -0.5)

    def vector(size: int, value: float | None = None) -> np.ndarray:
        return np.full(size, value, np.float32) if value is not None else rng.standard_normal(size, np.float32) * 0.02

    for frame in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        writer.add_tensor(frame, matrix(hidden, 3, vision["patch"], vision["patch"]).astype(np.float16))
    for layer in range(vision["layers"]):
        block = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            _add_matrix(writer, f"{block}.{name}.weight", matrix(hidden, hidden), matrices)
            writer.add_tensor(f"{block}.{name}.bias", vector(hidden))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{block}.{name}.weight", vector(hidden, 1.0))
        for name, rows, columns in (("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            _add_matrix(writer, f"{block}.{name}.weight", matrix(rows, columns), matrices)
            writer.add_tensor(f"{block}.{name}.bias", vector(rows))
    writer.add_tensor("v.post_ln.weight", vector(hidden, 1.0))
    _add_matrix(writer, "mm.0.weight", matrix(joined, joined), matrices)
    writer.add_tensor("mm.0.bias", vector(joined))
    _add_matrix(writer, "mm.2.weight", matrix(vision["out"], joined), matrices)
    writer.add_tensor("mm.2.bias", vector(vision["out"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_gemma3_projector(path: Path, matrices: str) -> None:
    """Gemma-3-4B's image side (patch and position embeddings in F32, the input projection
    F16, as the converter forces them)."""
    import gguf

    rng = np.random.default_rng(1)
    hidden, ffn = VISION["hidden"], VISION["ffn"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(TEXT_HIDDEN)
    writer.add_vision_image_size(VISION["image_size"])
    writer.add_vision_patch_size(VISION["patch"])
    writer.add_vision_embedding_length(hidden)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(VISION["layers"])
    writer.add_vision_head_count(VISION["heads"])
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_gelu(True)

    def matrix(*shape: int, dtype: type = np.float16) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(dtype)

    def vector(size: int, value: float | None = None) -> np.ndarray:
        return np.full(size, value, np.float32) if value is not None else rng.standard_normal(size, np.float32) * 0.02

    patches = (VISION["image_size"] // VISION["patch"]) ** 2
    writer.add_tensor("v.patch_embd.weight", matrix(hidden, 3, VISION["patch"], VISION["patch"], dtype=np.float32))
    writer.add_tensor("v.patch_embd.bias", vector(hidden))
    writer.add_tensor("v.position_embd.weight", matrix(patches, hidden, dtype=np.float32))
    for layer in range(VISION["layers"]):
        block = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            _add_matrix(writer, f"{block}.{name}.weight", matrix(hidden, hidden, dtype=np.float32), matrices)
            writer.add_tensor(f"{block}.{name}.bias", vector(hidden))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{block}.{name}.weight", vector(hidden, 1.0))
            writer.add_tensor(f"{block}.{name}.bias", vector(hidden))
        _add_matrix(writer, f"{block}.ffn_up.weight", matrix(ffn, hidden, dtype=np.float32), matrices)
        writer.add_tensor(f"{block}.ffn_up.bias", vector(ffn))
        _add_matrix(writer, f"{block}.ffn_down.weight", matrix(hidden, ffn, dtype=np.float32), matrices)
        writer.add_tensor(f"{block}.ffn_down.bias", vector(hidden))
    writer.add_tensor("v.post_ln.weight", vector(hidden, 1.0))
    writer.add_tensor("v.post_ln.bias", vector(hidden))
    writer.add_tensor("mm.input_projection.weight", matrix(hidden, TEXT_HIDDEN))  # [vision, text], as HF's
    writer.add_tensor("mm.soft_emb_norm.weight", vector(hidden, 1.0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def jpeg(seed: int) -> str:
    """A 1024 x 768 photo-like JPEG (smooth gradients and noise) as a data URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:768, 0:1024]
    base = np.stack([(x * rng.uniform(0.1, 0.3)) % 256, (y * rng.uniform(0.1, 0.3)) % 256,
                     ((x + y) * rng.uniform(0.05, 0.2)) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def request_ttft(url: str, image: str) -> tuple[float, float]:
    """(time to the first token, time to the last) of one streamed chat with ``image``."""
    body = {"model": "bench", "stream": True, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": QUESTION}]}]}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800,
                      headers={"Authorization": "Bearer bench"}) as response:
        if response.status_code != 200:
            raise SystemExit(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if first is None and delta.get("content"):
                first = time.perf_counter() - start
    return (first if first is not None else float("nan")), time.perf_counter() - start


def server_command(system: str, model: Path, projector: Path, port: int, threads: int, clients: int,
                   context: int) -> list[str]:
    if system == "localserve":
        return [sys.executable, "-m", "localserve.cli", "serve", "--model", f"bench={model}", "--mmproj",
                f"bench={projector}", "--device", "cpu", "--port", str(port), "--log-level", "warning",
                "--max-num-seqs", str(clients), "--max-model-len", str(context),
                "--kv-cache-memory", str(clients * context * kv_bytes_per_token(model)), "--threads", str(threads),
                "--insecure-no-auth"]
    binary = llama_server.binary()
    if binary is None:
        raise SystemExit("llama-server is not built: run python benchmarks/llama_server.py first")
    return [str(binary), "-m", str(model), "--mmproj", str(projector), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(clients), "-c", str(clients * context), "-fa", "on",
            "--no-webui", "-a", "bench", "--no-mmproj-offload"]


def measure(system: str, workload: str, model: Path, projector: Path, threads: int, seed: int,
            workdir: Path, context: int) -> dict[str, float]:
    clients = 1 if workload == "one" else int(workload)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ready = url + ("/health" if system == "localserve" else "/v1/models")
    with serving(server_command(system, model, projector, port, threads, clients, context), ready, threads,
                 workdir / f"{system}.log"):
        request_ttft(url, jpeg(10_000 + seed))  # warm-up: first-use set-up, not counted
        if workload == "one":
            first, _ = request_ttft(url, jpeg(seed))
            return {"ttft_s": first}
        results: list[tuple[float, float]] = []
        start = time.perf_counter()
        threads_ = [threading.Thread(target=lambda i=i: results.append(request_ttft(url, jpeg(seed * 100 + i))))
                    for i in range(clients)]
        for thread in threads_:
            thread.start()
        for thread in threads_:
            thread.join()
        wall = time.perf_counter() - start
        return {"requests_per_min": 60 * clients / wall, "median_ttft_s": statistics.median(r[0] for r in results),
                "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["one", "8"], choices=["one", "8"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=["localserve", "llama.cpp"])
    parser.add_argument("--shape", default="gemma-3-4b", choices=list(CONTEXTS))
    parser.add_argument("--projector", default="F16", choices=["F16", "Q8_0"],
                        help="the type of the projector's matrices, as the converter's --outtype")
    args = parser.parse_args()
    print(cpu_summary())
    assert SHAPES[args.shape].chat_template
    model, projector = model_path(args.shape, "Q4_K_M"), projector_path(args.shape, args.projector)
    print(f"model {model.name} ({model.stat().st_size / 2**30:.2f} GiB), projector {projector.name} "
          f"({projector.stat().st_size / 2**30:.2f} GiB), {args.threads} threads")
    with tempfile.TemporaryDirectory() as folder:
        for workload in args.workloads:
            figures: dict[str, list[dict[str, float]]] = {system: [] for system in args.systems}
            for repeat in range(args.repeats):
                for system in args.systems:
                    result = measure(system, workload, model, projector, args.threads, repeat, Path(folder),
                                     CONTEXTS[args.shape])
                    figures[system].append(result)
                    print(f"  {workload} {system} #{repeat + 1}: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
            key = "ttft_s" if workload == "one" else "requests_per_min"
            medians = {system: statistics.median(r[key] for r in runs) for system, runs in figures.items()}
            spread = {system: (min(r[key] for r in runs), max(r[key] for r in runs)) for system, runs in figures.items()}
            line = ", ".join(f"{system} {medians[system]:.2f} ({spread[system][0]:.2f}-{spread[system][1]:.2f})"
                             for system in args.systems)
            if {"localserve", "llama.cpp"} <= set(medians):
                ratio = (medians["llama.cpp"] / medians["localserve"] if workload == "one"
                         else medians["localserve"] / medians["llama.cpp"])
                line += f"; localserve over llama.cpp {ratio:.2f}x"
            print(f"{workload}: {key} {line}", flush=True)


if __name__ == "__main__":
    main()
