"""A regression corpus of hostile model files: metadata and configs that declare sizes the
files do not hold, or absurd ones. Each is read the way `localserve pull` and `show` read a
checkpoint (open_checkpoint and model_info: metadata only), in a child process whose address
space is capped at 2 GiB, and must fail within seconds with its one-line error.

Before these checks: block_count 2**31 made show, pull and a load run for ever (RSS growing
~48 MB/s); embedding length 2**33 printed 442 trillion parameters and pull ended in an
OverflowError traceback from sqlite; a context of 2**40 tried 4 TiB at load (HTTP 500);
GPTQ group_size null was a TypeError traceback. The byte-level GGUF corpus (truncations,
offsets, counts, types) is in test_gguf_file.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 32, 64, 4, 128, 2


def _uint(value: int) -> tuple[int, str]:
    return value, "UINT64" if value >= 1 << 32 else "UINT32"


def write_gguf(path: Path, metadata: dict[str, tuple[Any, str]] | None = None,
               drop: tuple[str, ...] = (), tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A tiny llama GGUF with F32 weights; ``metadata`` replaces or adds keys (value, type
    name), ``drop`` removes keys or tensors, ``tensors`` replaces or adds tensors."""
    import gguf

    keys: dict[str, tuple[Any, str]] = {
        "llama.context_length": _uint(256), "llama.embedding_length": _uint(HIDDEN),
        "llama.block_count": _uint(LAYERS), "llama.feed_forward_length": _uint(FFN),
        "llama.attention.head_count": _uint(HEADS), "llama.attention.head_count_kv": _uint(HEADS),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32"),
    }
    keys.update(metadata or {})
    rng = np.random.default_rng(0)
    weights = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)), "output_norm.weight": np.ones(HIDDEN)}
    for layer in range(LAYERS):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (HIDDEN, HIDDEN)), ("attn_v", (HIDDEN, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN)), ("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,))):
            weights[f"blk.{layer}.{name}.weight"] = rng.standard_normal(shape)
    weights.update(tensors or {})
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in keys.items():
        if key not in drop:
            writer.add_key_value(key, value, getattr(gguf.GGUFValueType, kind))
    for name, array in weights.items():
        if name not in drop:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf(folder: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A tiny Llama folder (config.json, model.safetensors with F32 weights)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    settings = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    settings.update(config or {})
    for key in drop:
        settings.pop(key, None)
    (folder / "config.json").write_text(json.dumps(settings))
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)), "model.norm.weight": np.ones(HIDDEN),
               "lm_head.weight": rng.standard_normal((VOCAB, HIDDEN))}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (HIDDEN, HIDDEN)),
                            ("self_attn.v_proj", (HIDDEN, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
                            ("mlp.gate_proj", (FFN, HIDDEN)), ("mlp.up_proj", (FFN, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, FFN)), ("input_layernorm", (HIDDEN,)),
                            ("post_attention_layernorm", (HIDDEN,))):
            tensors[prefix + name + ".weight"] = rng.standard_normal(shape)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _gptq(group_size: Any, bits: Any = 4) -> dict[str, Any]:
    return {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": group_size}}


# (id, how to write it, the error's pattern)
GGUF_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("block_count 2**31", {"metadata": {"llama.block_count": _uint(1 << 31)}}, "block_count 2,147,483,648 is outside"),
    ("block_count 3 of 2", {"metadata": {"llama.block_count": _uint(3)}}, "block_count is 3 but the file holds tensors of 2"),
    ("block_count 0", {"metadata": {"llama.block_count": _uint(0)}}, "block_count 0 is outside"),
    ("embedding 2**33", {"metadata": {"llama.embedding_length": _uint(1 << 33)}}, "embedding_length 8,589,934,592 is outside"),
    ("embedding 128 of 64", {"metadata": {"llama.embedding_length": _uint(128)}}, "token_embd.weight is"),
    ("context 2**40", {"metadata": {"llama.context_length": _uint(1 << 40)}}, "context_length 1,099,511,627,776 is outside"),
    ("context 0", {"metadata": {"llama.context_length": _uint(0)}}, "context_length 0 is outside"),
    ("heads 0", {"metadata": {"llama.attention.head_count": _uint(0)}}, "must be positive"),
    ("heads 2**20", {"metadata": {"llama.attention.head_count": _uint(1 << 20)}}, "over head_count 1,048,576 heads"),
    ("kv heads 3 of 4", {"metadata": {"llama.attention.head_count_kv": _uint(3)}}, "not a multiple"),
    ("key length 2**20", {"metadata": {"llama.attention.key_length": _uint(1 << 20)}}, "key_length 1,048,576 is outside"),
    ("ffn 2**31", {"metadata": {"llama.feed_forward_length": _uint(1 << 31)}}, "feed_forward_length 2,147,483,648 is outside"),
    ("experts 2**20", {"metadata": {"llama.expert_count": _uint(1 << 20), "llama.expert_used_count": _uint(2)}},
     "expert_count 1,048,576 is outside"),
    ("experts used 9 of 8", {"metadata": {"llama.expert_count": _uint(8), "llama.expert_used_count": _uint(9)}},
     "not a valid routing"),
    ("experts with none used", {"metadata": {"llama.expert_count": _uint(8)}}, "not a valid routing"),
    ("block_count a string", {"metadata": {"llama.block_count": ("2", "STRING")}}, "unexpected value"),
    ("block_count negative", {"metadata": {"llama.block_count": (-2, "INT32")}}, "unexpected value"),
    ("epsilon a string", {"metadata": {"llama.attention.layer_norm_rms_epsilon": ("x", "STRING")}}, "unexpected value"),
    ("no block_count", {"drop": ("llama.block_count",)}, "block_count is missing"),
    ("no embedding", {"drop": ("token_embd.weight",)}, "token_embd.weight is missing"),
    ("rope dims 2**20", {"metadata": {"llama.rope.dimension_count": _uint(1 << 20)}}, "does not fit head size"),
    ("rope scaling unknown", {"metadata": {"llama.rope.scaling.type": ("weird", "STRING")}}, "not supported"),
    ("yarn without context", {"metadata": {"llama.rope.scaling.type": ("yarn", "STRING")}},
     "original_context_length"),
    ("rope_freqs wrong length", {"tensors": {"rope_freqs.weight": np.ones(5)}}, "plain floats"),
    ("longrope long factors alone", {"tensors": {"rope_factors_long.weight": np.ones(8)}}, "come together"),
    ("longrope without original context", {"tensors": {"rope_factors_long.weight": np.ones(8),
                                                       "rope_factors_short.weight": np.ones(8)}},
     "original_context_length is missing"),
    ("longrope factors wrong length", {"tensors": {"rope_factors_long.weight": np.ones(3),
                                                   "rope_factors_short.weight": np.ones(3)}}, "plain floats"),
    ("vocab longer than the embedding", {"metadata": {"tokenizer.ggml.tokens": (["a"] * 40, "ARRAY")}},
     "40 tokens but 32 embedding rows"),
]

HF_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("layers 2**31", {"config": {"num_hidden_layers": 1 << 31}}, "num_hidden_layers 2,147,483,648 is outside"),
    ("layers 3 of 2", {"config": {"num_hidden_layers": 3}}, "num_hidden_layers is 3 but the weights hold tensors of 2"),
    ("hidden 2**33", {"config": {"hidden_size": 1 << 33}}, "hidden_size 8,589,934,592 is outside"),
    ("hidden 128 of 64", {"config": {"hidden_size": 128}}, "model.embed_tokens.weight is 32 x 64"),
    ("vocab 33 of 32", {"config": {"vocab_size": 33}}, "model.embed_tokens.weight is 32 x 64"),
    ("context 2**40", {"config": {"max_position_embeddings": 1 << 40}}, "max_position_embeddings 1,099,511,627,776"),
    ("heads 0", {"config": {"num_attention_heads": 0}}, "ZeroDivisionError"),
    ("kv heads 3 of 4", {"config": {"num_key_value_heads": 3}}, "not a multiple"),
    ("intermediate negative", {"config": {"intermediate_size": -5}}, "intermediate_size -5 is outside"),
    ("hidden infinite", {"config": {"hidden_size": 1e400}}, "OverflowError"),
    ("hidden a string", {"config": {"hidden_size": "big"}}, "malformed"),
    ("no vocab", {"drop": ("vocab_size",)}, "malformed"),
    ("gptq group_size null", {"config": _gptq(None)}, "group_size None must be -1 or a positive integer"),
    ("gptq group_size 7", {"config": _gptq(7)}, "group_size 7 does not divide"),
    ("gptq group_size 0", {"config": _gptq(0)}, "group_size 0 must be"),
    ("gptq 3 bits", {"config": _gptq(32, bits=3)}, "3 bits is not supported"),
    ("unknown quantization", {"config": {"quantization_config": {"quant_method": "bnb"}}}, "not supported"),
    ("model_type unknown", {"config": {"model_type": "gpt2"}}, "model_type 'gpt2' is not supported"),
    ("sliding window negative", {"config": {"sliding_window": -4}}, "sliding_window -4 is outside"),
    ("sliding window 2**70", {"config": {"sliding_window": 1 << 70}}, "sliding_window 1,180,591,620,717,411,303,424"),
]

# Runs in the child: read each checkpoint as pull and show do, one JSON line per case.
_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from localserve.errors import LocalserveError
from localserve.facts.checkpoint import model_info
from localserve.formats import open_checkpoint
for path in sys.argv[1:]:
    start = time.monotonic()
    try:
        model_info(open_checkpoint(path))
        error = None
    except LocalserveError as exc:
        error = str(exc)
    print(json.dumps({"path": path, "error": error, "seconds": time.monotonic() - start}), flush=True)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hostile")
    paths = []
    for index, (_, how, _) in enumerate(GGUF_CASES):
        paths.append(write_gguf(root / f"g{index}.gguf", how.get("metadata"), how.get("drop", ()), how.get("tensors")))
    for index, (_, how, _) in enumerate(HF_CASES):
        paths.append(write_hf(root / f"h{index}", how.get("config"), how.get("drop", ())))
    result = subprocess.run([sys.executable, "-c", _CHILD, *map(str, paths)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # a traceback or MemoryError would end here
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == len(paths)
    return {Path(line["path"]).name.removesuffix(".gguf"): line for line in lines}


def _check(outcome: dict[str, Any], pattern: str) -> None:
    assert outcome["error"] is not None, "read without an error"
    assert "\n" not in outcome["error"]
    assert pytest.importorskip("re").search(pattern, outcome["error"]), outcome["error"]
    assert outcome["seconds"] < 5


@pytest.mark.parametrize("index", range(len(GGUF_CASES)), ids=[case[0] for case in GGUF_CASES])
def test_hostile_gguf_metadata_is_one_line_error(outcomes: dict[str, dict[str, Any]], index: int) -> None:
    _check(outcomes[f"g{index}"], GGUF_CASES[index][2])


@pytest.mark.parametrize("index", range(len(HF_CASES)), ids=[case[0] for case in HF_CASES])
def test_hostile_hf_config_is_one_line_error(outcomes: dict[str, dict[str, Any]], index: int) -> None:
    _check(outcomes[f"h{index}"], HF_CASES[index][2])


def test_the_builders_make_readable_models(tmp_path: Path) -> None:
    """The corpus's untouched files read and generate, so each case fails for its own change."""
    from localserve import LLM, SamplingParams

    for path in (write_gguf(tmp_path / "ok.gguf"), write_hf(tmp_path / "ok")):
        [out] = LLM(path, device="cpu", num_kv_blocks=16).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        assert len(out.token_ids) == 3


# -- every tensor checked before a model is registered ----------------------------------------

def _gguf_with_type(path: Path, name: str, ggml_type: str) -> Path:
    """The corpus GGUF with tensor ``name`` stored as raw blocks of another GGML type."""
    import gguf

    write_gguf(path, drop=(name,))
    rows, columns = (HIDDEN, HIDDEN)
    kind = getattr(gguf.GGMLQuantizationType, ggml_type)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = np.zeros((rows, columns // block * size), dtype=np.uint8)
    rewritten = path.with_suffix(".typed.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(rewritten), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return rewritten


def _hf_with(folder: Path, change: dict[str, Any]) -> Path:
    from safetensors.numpy import load_file, save_file

    write_hf(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


TENSOR_CASES: list[tuple[str, Any, str]] = [
    ("gguf: a Q8_1 tensor", lambda root: _gguf_with_type(root / "q81.gguf", "blk.0.attn_q.weight", "Q8_1"),
     "blk.0.attn_q.weight is of GGML type Q8_1"),
    ("gguf: a missing tensor", lambda root: write_gguf(root / "missing.gguf", drop=("blk.1.ffn_down.weight",)),
     "missing 1 tensors, e.g. model.layers.1.mlp.down_proj.weight"),
    ("gguf: a mis-shaped tensor", lambda root: write_gguf(root / "shape.gguf", tensors={
        "blk.0.attn_k.weight": np.ones((HIDDEN // 2, HIDDEN))}), r"has shape \(32, 64\), expected \(64, 64\)"),
    ("gguf: a stranger tensor", lambda root: write_gguf(root / "extra.gguf", tensors={
        "blk.0.weird.weight": np.ones(4)}), "blk.0.weird.weight is not part of a llama model"),
    ("hf: a missing tensor", lambda root: _hf_with(root / "hf-missing", {"model.layers.0.mlp.up_proj.weight": None}),
     "missing 1 tensors"),
    ("hf: a mis-shaped tensor", lambda root: _hf_with(root / "hf-shape", {
        "model.layers.1.self_attn.o_proj.weight": np.ones((HIDDEN, 3), np.float32)}), "has shape"),
    ("hf: integer weights", lambda root: _hf_with(root / "hf-int", {
        "model.norm.weight": np.ones(HIDDEN, np.int32)}), "dtype I32"),
    ("hf: offsets past the end of the file", lambda root: _truncated(write_hf(root / "hf-cut")),
     "not a valid safetensors file"),
]


def _truncated(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size - 1000)
    return folder


@pytest.mark.parametrize("index", range(len(TENSOR_CASES)), ids=[case[0] for case in TENSOR_CASES])
def test_pull_registers_only_what_the_engine_loads(tmp_path: Path, index: int) -> None:
    """Before: a model the engine could not open (an unknown type, a missing or mis-shaped
    tensor) was registered, `list` showed it and the daemon answered 400."""
    import re

    from localserve import LLM
    from localserve.errors import LocalserveError
    from localserve.registry import open_registry
    from localserve.registry.local import import_local

    _, make, pattern = TENSOR_CASES[index]
    path = make(tmp_path)
    registry = open_registry(tmp_path / "home")
    before = registry.list()
    with pytest.raises(LocalserveError) as error:
        import_local(registry, path, "bad")
    assert re.search(pattern, str(error.value)), str(error.value)
    assert registry.list() == before
    with pytest.raises(LocalserveError):  # the engine refuses it too, whatever it says first
        LLM(path, device="cpu", num_kv_blocks=8)
