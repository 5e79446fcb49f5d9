"""An encoder's architecture, read from its config.json (no torch).

Three families share one layout (embeddings, then post-norm layers: attention and an MLP,
each added to its input and then layer-normed):

- ``bert``: learned absolute positions from 0, GELU MLP, biases everywhere.
- ``roberta`` (RoBERTa, XLM-RoBERTa): as BERT, but positions count from the pad id + 1 and
  pad tokens keep the pad id as their position (transformers' rule, reproduced exactly).
- ``nomic_bert``: rotary positions (half-split pairs), a gated MLP (SiLU of the gate times
  the up projection), biases as its config says. Read from nomic's own config keys
  (``n_embd``, ``rotary_emb_base``, ...: its trust_remote_code checkpoints) or from
  transformers' NomicBertConfig keys (``hidden_size``, ``rope_parameters``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import LocalserveError
from ..json_files import read_json_object

_MAX_CONFIG_BYTES = 1 << 20

# config.json's model_type -> family.
_FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "nomic_bert": "nomic_bert"}
# transformers' hidden_act names -> the activation we run ("gelu_new" is the tanh form too).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                "silu": "silu", "swish": "silu"}

Family = Literal["bert", "roberta", "nomic_bert"]


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    activation: str  # "gelu", "gelu_tanh", "relu", "silu"
    gated_mlp: bool  # down(act(gate(x)) * up(x)) rather than down(act(up(x)))
    layer_norm_eps: float
    type_vocab_size: int
    max_positions: int  # the longest input the position scheme covers
    rope_theta: float | None  # rotary positions; None: learned absolute ones
    pad_token_id: int
    attention_bias: bool  # Q/K/V and output projections
    up_bias: bool
    down_bias: bool
    num_labels: int | None  # a cross-encoder's classifier outputs; None: an embedding model

    @property
    def position_offset(self) -> int:
        """The learned position row of an input's first token (RoBERTa skips the rows up to its pad id)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def classifies(self) -> bool:
        return self.num_labels is not None


def read_config(model_dir: Path) -> EncoderConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise LocalserveError(f"{model_dir}: no config.json; not a transformers model folder")
    config = read_json_object(path, _MAX_CONFIG_BYTES)
    try:
        return config_from_dict(config)
    except LocalserveError as exc:
        raise LocalserveError(f"{path}: {exc}") from None


def config_from_dict(config: dict[str, Any]) -> EncoderConfig:
    model_type = config.get("model_type")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise LocalserveError(f"model_type {model_type!r} is not an encoder localserve runs "
                              f"({', '.join(sorted(_FAMILIES))} are)")
    num_labels = _num_labels(config)
    try:
        made = _nomic(config, num_labels) if family == "nomic_bert" else _bert(config, family, num_labels)
    except (KeyError, TypeError, ValueError) as exc:
        raise LocalserveError(f"missing or bad value for {exc}") from None
    return check_config(made)


def _num_labels(config: dict[str, Any]) -> int | None:
    """A sequence classifier's label count (None for an embedding model's bare encoder)."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise LocalserveError("architectures is not a list of class names")
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return None
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, dict) else config.get("num_labels", 2)
    if count != 1:
        raise LocalserveError(f"a classifier with {count} labels; a reranker has one (its relevance score)")
    return 1


def _bert(config: dict[str, Any], family: Family, num_labels: int | None) -> EncoderConfig:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise LocalserveError(f"position_embedding_type {config['position_embedding_type']!r} is not supported "
                              "(absolute is)")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    pad = int(config.get("pad_token_id", 1 if family == "roberta" else 0))
    table = int(config["max_position_embeddings"])
    return EncoderConfig(
        family=family, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]), num_heads=heads, head_dim=hidden // heads if heads > 0 else 0,
        intermediate_size=int(config["intermediate_size"]), activation=_activation(config.get("hidden_act", "gelu")),
        gated_mlp=False, layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
        max_positions=table - (pad + 1 if family == "roberta" else 0), rope_theta=None, pad_token_id=pad,
        attention_bias=True, up_bias=True, down_bias=True, num_labels=num_labels)


def _nomic(config: dict[str, Any], num_labels: int | None) -> EncoderConfig:
    if num_labels is not None:
        raise LocalserveError("nomic-bert rerankers are not supported (its embedding models are)")
    if "n_embd" in config:
        return _nomic_original(config)
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or \
            rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise LocalserveError("rope_parameters: only plain rotary over the whole head is supported")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return EncoderConfig(
        family="nomic_bert", vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        head_dim=int(config.get("head_dim") or (hidden // heads if heads > 0 else 0)),
        intermediate_size=int(config["intermediate_size"]), activation=_activation(config.get("hidden_act", "silu")),
        gated_mlp=True, layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
        max_positions=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", 1000.0)), pad_token_id=int(config.get("pad_token_id", 0)),
        attention_bias=False, up_bias=False, down_bias=False, num_labels=None)


def _nomic_original(config: dict[str, Any]) -> EncoderConfig:
    """nomic's own NomicBertConfig (a GPT2Config with extra keys), as nomic-embed-text ships it.
    Its variants that change the computation (pre-norm, RMSNorm, interleaved or partial or
    scaled rotary, parallel blocks, causal) are refused rather than run wrong."""
    unsupported = {"prenorm": False, "use_rms_norm": False, "rotary_emb_interleaved": False, "causal": False,
                   "parallel_block": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
                   "rotary_emb_fraction": 1.0}
    for key, plain in unsupported.items():
        if config.get(key, plain) != plain:
            raise LocalserveError(f"nomic-bert with {key} = {config[key]!r} is not supported ({plain!r} is)")
    if config.get("activation_function", "swiglu") != "swiglu":
        raise LocalserveError(f"nomic-bert with activation_function {config['activation_function']!r} "
                              "is not supported (swiglu is)")
    hidden, heads = int(config["n_embd"]), int(config["n_head"])
    qkv_bias = bool(config.get("qkv_proj_bias", True))
    return EncoderConfig(
        family="nomic_bert", vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        num_layers=int(config["n_layer"]), num_heads=heads, head_dim=hidden // heads if heads > 0 else 0,
        intermediate_size=int(config.get("n_inner") or 4 * hidden), activation="silu", gated_mlp=True,
        layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        type_vocab_size=int(config.get("type_vocab_size", 2)), max_positions=int(config.get("n_positions", 2048)),
        rope_theta=float(config.get("rotary_emb_base", 10_000)), pad_token_id=int(config.get("pad_token_id") or 0),
        attention_bias=qkv_bias, up_bias=bool(config.get("mlp_fc1_bias", True)),
        down_bias=bool(config.get("mlp_fc2_bias", True)), num_labels=None)


def _activation(name: Any) -> str:
    if name not in _ACTIVATIONS:
        raise LocalserveError(f"hidden_act {name!r} is not supported ({', '.join(_ACTIVATIONS)} are)")
    return _ACTIVATIONS[name]


def check_config(config: EncoderConfig) -> EncoderConfig:
    sizes = (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.head_dim,
             config.intermediate_size, config.type_vocab_size, config.max_positions)
    if min(sizes) < 1 or max(sizes) > 1 << 24 or config.num_layers > 256:
        raise LocalserveError("the model's sizes are out of range")
    if config.head_dim % 2 and config.rope_theta is not None:
        raise LocalserveError("rotary positions need an even head size")
    if config.rope_theta is None and config.head_dim * config.num_heads != config.hidden_size:
        raise LocalserveError(f"hidden_size {config.hidden_size} is not a multiple of {config.num_heads} heads")
    if not 0 <= config.pad_token_id < config.vocab_size:
        raise LocalserveError(f"pad_token_id {config.pad_token_id} is outside the vocabulary")
    if not 0 < config.layer_norm_eps < 1 or (config.rope_theta is not None and not config.rope_theta > 0):
        raise LocalserveError("layer_norm_eps or the rotary base is out of range")
    return config
