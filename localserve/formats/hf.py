"""HF checkpoints' metadata: config.json -> ModelSpec and QuantConfig, the safetensors
shards and their headers. Reads no tensor data and needs no torch (formats/weights.py
loads the tensors).

Tensor names stay in HF's naming (``model.layers.N.self_attn.q_proj.weight``); it is
the canonical naming that other readers (GGUF) map onto.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ..errors import LocalserveError
from ..json_files import read_json_object
from .architectures import HF_MODEL_TYPES, Architecture
from .spec import HIDDEN_ACTIVATIONS, ModelSpec, RopeSpec

_MAX_SHARDS = 4096
# config.json and the shard index: a few KB, the index of a 1,000-shard model a few MB.
_MAX_CONFIG_BYTES = 16 << 20


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.exists():
        raise LocalserveError(f"{model_dir}: no config.json; expected an HF checkpoint folder")
    return read_json_object(path, _MAX_CONFIG_BYTES)


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    model_type = config.get("model_type")
    arch = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        supported = ", ".join(sorted(HF_MODEL_TYPES))
        raise LocalserveError(f"model_type {model_type!r} is not supported (supported: {supported})")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        rope, local_rope = _rope_from_config(config)
        spec = ModelSpec(
            architecture=arch.name,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope,
            local_rope=local_rope,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", arch.tied_embeddings)),
            # Where config.json says attention_bias, every attention projection has one (o_proj
            # too); Qwen2's q/k/v biases are the architecture's own.
            attention_bias=arch.attention_bias or bool(config.get("attention_bias", False)),
            attention_out_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch.qk_norm,
            **_variant_fields(arch, config, hidden_size),
            sliding_window=_sliding_window(arch, config),
            full_attention_layers=_full_attention_layers(arch, config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            torch_dtype=config.get("dtype") or config.get("torch_dtype"),
            **_moe_fields(arch, config),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise LocalserveError(f"config.json: missing or malformed field ({type(exc).__name__}: {exc})") from exc
    problem = spec.check(_CONFIG_KEYS)
    if problem:
        raise LocalserveError(f"config.json: {problem}")
    return spec


# What config.json calls the spec's fields (MoE models vary; these are the common names).
_CONFIG_KEYS = {
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "rope.theta": "rope_theta", "rope.factor": "rope_scaling.factor", "local_rope.theta": "rope_local_base_freq",
}


def _moe_fields(arch: Architecture, config: dict[str, Any]) -> dict[str, Any]:
    if arch.moe is None:
        return {}
    # The hub's Qwen MoE files say num_experts; Mixtral and transformers 5 num_local_experts.
    fields: dict[str, Any] = dict(num_experts=int(config.get("num_experts") or config["num_local_experts"]),
                                  num_experts_per_tok=int(config["num_experts_per_tok"]))
    if arch.moe == "mixtral":
        # Mixtral's experts are intermediate_size wide and its gates always renormalised.
        return fields | dict(moe_intermediate_size=int(config["intermediate_size"]))
    if arch.moe == "olmoe":  # intermediate_size wide too; every layer sparse, no shared expert
        return fields | dict(moe_intermediate_size=int(config["intermediate_size"]),
                             norm_topk_prob=bool(config.get("norm_topk_prob", False)))
    if arch.moe == "gpt_oss":
        # A softmax over the chosen experts' logits is the full softmax renormalised over them.
        assert arch.clamped_swiglu is not None
        alpha, limit = arch.clamped_swiglu
        return fields | dict(moe_intermediate_size=int(config["intermediate_size"]), norm_topk_prob=True,
                             expert_bias=arch.expert_bias, clamped_swiglu=(float(config.get("swiglu_alpha", alpha)),
                                                                           float(config.get("swiglu_limit", limit))))
    # Qwen MoE: a layer is sparse unless listed in mlp_only_layers or off decoder_sparse_step.
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = {int(i) for i in config.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(int(config["num_hidden_layers"])) if i in only_dense or (i + 1) % step)
    return fields | dict(moe_intermediate_size=int(config["moe_intermediate_size"]),
                         shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
                         norm_topk_prob=bool(config.get("norm_topk_prob", False)), dense_mlp_layers=dense)


def _variant_fields(arch: Architecture, config: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """How the model departs from Llama's arithmetic: its activation, Gemma's norms and
    scales, Granite's multipliers, soft caps, the attention's scale."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in HIDDEN_ACTIVATIONS:
        raise LocalserveError(f"config.json: activation {act!r} is not supported "
                              f"({', '.join(HIDDEN_ACTIVATIONS)})")
    query_scalar = config.get("query_pre_attn_scalar")
    attention_multiplier = config.get("attention_multiplier")
    attention_scale = (float(query_scalar) ** -0.5 if arch.gemma and query_scalar
                       else float(attention_multiplier) if attention_multiplier is not None else None)
    return dict(
        hidden_act=HIDDEN_ACTIVATIONS[act],
        norm_weight_offset=1.0 if arch.gemma else 0.0,
        sandwich_norms=arch.gemma,
        embedding_scale=hidden_size**0.5 if arch.gemma else float(config.get("embedding_multiplier") or 1.0),
        residual_scale=float(config.get("residual_multiplier") or 1.0),
        logit_scale=1.0 / float(config.get("logits_scaling") or 1.0),
        attention_scale=attention_scale,
        attention_softcap=float(config.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        clip_qkv=float(config["clip_qkv"]) if config.get("clip_qkv") is not None else None,
        attention_sinks=arch.attention_sinks,
    )


def _sliding_window(arch: Architecture, config: dict[str, Any]) -> int | None:
    # Qwen2 ships a sliding_window value but only uses it when use_sliding_window is set.
    if arch.sliding_window_needs_flag and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _full_attention_layers(arch: Architecture, config: dict[str, Any]) -> tuple[int, ...]:
    """The layers that ignore the sliding window: as ``layer_types`` lists them, else for
    Qwen2's family the first ``max_window_layers`` (transformers' rule); none for Mistral,
    and none to name when the model has no window."""
    if _sliding_window(arch, config) is None:
        return ()
    num_layers = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return tuple(i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    pattern = config.get("sliding_window_pattern") or arch.sliding_window_pattern
    if pattern:  # Gemma: every pattern-th layer attends to everything
        return tuple(i for i in range(num_layers) if (i + 1) % int(pattern) == 0)
    if arch.sliding_window_needs_flag:
        return tuple(range(min(int(config.get("max_window_layers", num_layers)), num_layers)))
    return ()


def _rope_from_config(config: dict[str, Any]) -> tuple[RopeSpec, RopeSpec | None]:
    """The rotary settings of the full-attention layers, and the sliding layers' own when
    they differ (Gemma 3: ``rope_local_base_freq``, or transformers 5's ``rope_parameters``
    keyed by layer type)."""
    # transformers 5 writes rope_parameters (theta inside); older files rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        by_type = {kind: _rope_spec(config, dict(params.get(kind) or {})) for kind in ("full_attention",
                                                                                     "sliding_attention")}
        return by_type["full_attention"], by_type["sliding_attention"]
    scaling = dict(config.get("rope_scaling") or {})
    rope = _rope_spec(config, {**scaling, **params})
    local_theta = config.get("rope_local_base_freq")
    local = RopeSpec(theta=float(local_theta)) if local_theta is not None else None
    return rope, local


_ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def _rope_spec(config: dict[str, Any], merged: dict[str, Any]) -> RopeSpec:
    theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "mrope":  # Qwen2-VL's older spelling: default frequencies, turned by three positions
        kind = "default"
    if kind not in _ROPE_KINDS:
        raise LocalserveError(f"rope type {kind!r} is not supported (supported: {', '.join(_ROPE_KINDS)})")
    max_position = int(config.get("max_position_embeddings", 8192))
    original = merged.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if kind in ("llama3", "yarn", "dynamic", "longrope") and original is None:
        original = max_position
    factor = merged.get("factor")
    if factor is None:  # longrope (Phi-3) states the growth as the two context lengths
        factor = max_position / int(original) if kind == "longrope" else 1.0
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(factor),
        original_max_position=int(original) if original is not None else None,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=merged.get("attention_factor"),
        partial_rotary_factor=float(merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
        short_factor=_floats(merged.get("short_factor")),
        long_factor=_floats(merged.get("long_factor")),
        mrope_section=_mrope_section(merged.get("mrope_section")),
        mrope_interleaved=bool(merged.get("mrope_interleaved", False)),
    )


def _mrope_section(values: Any) -> tuple[int, ...] | None:
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != 3 or any(type(v) is not int or v < 0 for v in values):
        raise LocalserveError(f"config.json: mrope_section must be three counts, not {values!r}")
    return tuple(values)


def _floats(values: Any) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, _MAX_CONFIG_BYTES).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LocalserveError(f"{index}: weight_map is not an object of tensor names and shard files")
        if any(not isinstance(name, str) for name in weight_map.values()):
            raise LocalserveError(f"{index}: weight_map has a shard that is not a file name")
        names = sorted(set(weight_map.values()))
        if len(names) > _MAX_SHARDS:
            raise LocalserveError(f"{index}: too many shards ({len(names)})")
        files = []
        for name in names:
            # A shard name comes from an untrusted file: it must be a plain file name.
            if Path(name).name != name or name in (".", "..") or len(name) > 255 or "\0" in name:
                raise LocalserveError(f"{index}: invalid shard file name {name[:80]!r}")
            path = model_dir / name
            if not path.is_file():
                raise LocalserveError(f"{index}: shard {name} is missing")
            files.append(path)
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LocalserveError(f"{model_dir}: no .safetensors weights found")
    return files


# safetensors dtype names -> bytes per element.
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                          "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def check_headers(spec: ModelSpec, headers: list[TensorHeader]) -> None:
    """The config's layer count and widths against the tensors the shards hold, from
    their headers: a config that claims more than the files hold is refused before
    anything is sized by it."""
    layers: set[int] = set()
    embed: tuple[int, ...] | None = None
    for name, shape, _ in headers:
        if match := _LAYER_TENSOR.match(name):
            layers.add(int(match[1]))
        elif name == "model.embed_tokens.weight":
            embed = shape
    if layers != set(range(spec.num_layers)):
        raise LocalserveError(f"config.json: num_hidden_layers is {spec.num_layers:,} but the weights hold "
                              f"tensors of {len(layers):,} layers{_numbered(layers)}")
    if embed is not None and embed != (spec.vocab_size, spec.hidden_size):
        raise LocalserveError(f"config.json: vocab_size x hidden_size is {spec.vocab_size:,} x {spec.hidden_size:,} "
                              f"but model.embed_tokens.weight is {' x '.join(map(str, embed))}")


def _numbered(layers: set[int]) -> str:
    return f", numbered up to {max(layers):,}" if layers else ""


# (name, shape, safetensors dtype name) of one tensor.
TensorHeader = tuple[str, tuple[int, ...], str]


def read_headers(files: list[Path]) -> list[TensorHeader]:
    """Every tensor's header, from the files' headers alone: no tensor data is read.
    Read once when a checkpoint is opened (``Checkpoint.headers``)."""
    headers = []
    for path in files:
        try:
            with safe_open(path, framework="numpy") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    headers.append((name, tuple(view.get_shape()), view.get_dtype()))
        except SafetensorError as exc:
            raise LocalserveError(f"{path}: not a valid safetensors file ({exc})") from exc
    return headers


@dataclass(slots=True, frozen=True)
class QuantConfig:
    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over all inputs
    zeros_minus_one: bool = False  # GPTQ v1
    zero_point: bool = True  # AWQ: False means symmetric (zero 8)

    @property
    def parts(self) -> tuple[str, ...]:
        """Tensor name suffixes that belong to a quantized layer."""
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")


def quant_config_from(config: dict[str, Any]) -> QuantConfig | None:
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise LocalserveError("config.json: quantization_config must be an object")
    method = raw.get("quant_method")
    arch = HF_MODEL_TYPES.get(config.get("model_type"))  # type: ignore[arg-type]
    if method == "mxfp4" and arch is not None and arch.packed_experts:
        return None  # its MXFP4 experts are read by formats/gpt_oss.py
    bits = raw.get("bits", raw.get("w_bit"))
    group_size = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise LocalserveError(f"config.json: quantization_config group_size {group_size!r} must be -1 or a "
                              "positive integer")
    if method == "gptq":
        if bits not in (4, 8):
            raise LocalserveError(f"GPTQ with {bits} bits is not supported (4 and 8 are)")
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise LocalserveError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return QuantConfig("gptq", bits, int(group_size), zeros_minus_one=fmt == "gptq")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise LocalserveError(f"AWQ version {version!r} is not supported (only 'gemm')")
        if bits != 4:
            raise LocalserveError(f"AWQ with {bits} bits is not supported (4 is)")
        return QuantConfig("awq", 4, int(group_size), zero_point=bool(raw.get("zero_point", True)))
    raise LocalserveError(f"quant_method {method!r} is not supported (gptq, awq)")
