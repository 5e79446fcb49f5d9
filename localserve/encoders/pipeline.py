"""What an encoder folder does with its encoder, as sentence-transformers would (no torch).

An embedding model is a sentence-transformers folder: ``modules.json`` lists a
Transformer (its files at the module's path, usually the folder itself), one Pooling
module (CLS, mean or last-token; read from the ``pooling_mode`` key sentence-transformers
6 writes or the ``pooling_mode_*_token`` flags older releases wrote) and usually
Normalize. A cross-encoder (reranker) is a ``*ForSequenceClassification`` checkpoint, with
or without ``modules.json``; its score goes through the activation its files name
(sentence-transformers' precedence: config_sentence_transformers.json, then config.json's
``sentence_transformers`` or legacy key), by default the sigmoid that CrossEncoder applies
to a one-label model. Modules that would change the vector (Dense, other poolings, a
prompt excluded from pooling) are refused rather than served wrong.

The input length limit is sentence_bert_config.json's ``max_seq_length``, else the
tokenizer's ``model_max_length``; the runner caps it at what the positions cover.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import LocalserveError
from ..formats.embedding import read_pooling
from ..json_files import read_json

_MAX_JSON_BYTES = 1 << 20
# The activations a cross-encoder's files may name (sentence-transformers writes the class's
# full name) -> the runner's.
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                "torch.nn.modules.activation.Tanh": "tanh"}
# transformers' model_max_length for a tokenizer with no limit of its own (int(1e30)).
_NO_LIMIT = 1e29
Task = Literal["embed", "score"]


@dataclass(frozen=True, slots=True)
class Pipeline:
    task: Task
    model_dir: Path  # the Transformer module's files: config.json, weights, tokenizer
    pooling: str | None  # embed: "cls", "mean" or "last"
    normalize: bool  # embed: a Normalize module follows the pooling
    activation: str | None  # score: "sigmoid", "identity" or "tanh"
    max_length: int | None  # tokens an input keeps (None: only the model's positions limit it)
    lowercase: bool  # sentence_bert_config's do_lower_case: lowercase before tokenizing


def read_pipeline(folder: Path) -> Pipeline:
    modules = _json(folder / "modules.json")
    model_dir, pooling, normalize = folder, None, False
    if modules is not None:
        model_dir, pooling, normalize = _modules(folder, modules)
    config = _json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise LocalserveError(f"{model_dir}: no config.json object; not a transformers model folder")
    architectures = config.get("architectures") or []
    classifier = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures)
    sbert = _json(model_dir / "sentence_bert_config.json") or {}
    if not isinstance(sbert, dict):
        raise LocalserveError(f"{model_dir / 'sentence_bert_config.json'}: expected a JSON object")
    task = sbert.get("transformer_task", "sequence-classification" if classifier else "feature-extraction")
    if classifier != (task == "sequence-classification") or task not in ("sequence-classification",
                                                                          "feature-extraction"):
        raise LocalserveError(f"{folder}: a {', '.join(map(str, architectures)) or 'bare encoder'} run as "
                              f"{task!r} is not supported (embedding models and sequence-classification "
                              "rerankers are)")
    if classifier and pooling is not None:
        raise LocalserveError(f"{folder}: a reranker with a Pooling module is not supported")
    if not classifier and pooling is None:
        raise LocalserveError(f"{folder}: no modules.json with a Pooling module, so how this encoder's "
                              "embeddings are pooled is unknown; use a sentence-transformers folder")
    return Pipeline(task="score" if classifier else "embed", model_dir=model_dir, pooling=pooling,
                    normalize=normalize, activation=_activation(folder, model_dir, config) if classifier else None,
                    max_length=_max_length(model_dir, sbert), lowercase=sbert.get("do_lower_case") is True)


def _modules(folder: Path, modules: Any) -> tuple[Path, str | None, bool]:
    """(the Transformer's folder, the pooling, whether Normalize follows it)."""
    where = folder / "modules.json"
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise LocalserveError(f"{where}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds[:1] != ["Transformer"] or kinds.count("Transformer") != 1 or kinds.count("Pooling") > 1 or \
            kinds.count("Normalize") > 1:
        raise LocalserveError(f"{where}: expected a Transformer module first, then at most one Pooling and "
                              f"one Normalize (found {', '.join(kinds) or 'none'})")
    for kind in kinds:
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise LocalserveError(f"{folder.name}: the sentence-transformers module {kind!r} is not supported "
                                  "(Transformer, Pooling and Normalize are)")
    model_dir = _inside(folder, modules[0].get("path", ""), where)
    pooling = None
    if "Pooling" in kinds:
        pooling = read_pooling(_inside(folder, modules[kinds.index("Pooling")].get("path", ""), where) / "config.json")
    normalize = "Normalize" in kinds
    if normalize:
        if pooling is None or kinds.index("Normalize") < kinds.index("Pooling"):
            raise LocalserveError(f"{where}: Normalize comes before any Pooling module")
        settings = _json(_inside(folder, modules[kinds.index("Normalize")].get("path", ""), where) / "config.json")
        if isinstance(settings, dict) and settings.get("module_input_name", "sentence_embedding") != \
                "sentence_embedding":
            raise LocalserveError(f"{where}: a Normalize of token embeddings is not supported")
    return model_dir, pooling, normalize


def _activation(folder: Path, model_dir: Path, config: dict[str, Any]) -> str:
    named = None
    for settings in (_json(folder / "config_sentence_transformers.json"), config.get("sentence_transformers")):
        if isinstance(settings, dict) and settings.get("activation_fn") is not None:
            named = settings["activation_fn"]
            break
    else:
        named = config.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid"  # CrossEncoder's default for a one-label model
    if named not in _ACTIVATIONS:
        raise LocalserveError(f"{model_dir}: the reranker's activation {str(named)[:80]!r} is not supported "
                              "(Sigmoid, Identity and Tanh are)")
    return _ACTIVATIONS[named]


def _max_length(model_dir: Path, sbert: dict[str, Any]) -> int | None:
    length = sbert.get("max_seq_length")
    if length is None:
        path = model_dir / "tokenizer_config.json"  # large with many added tokens: the default bound
        tokenizer_config = read_json(path) if path.exists() else None
        length = tokenizer_config.get("model_max_length") if isinstance(tokenizer_config, dict) else None
        if isinstance(length, (int, float)) and length >= _NO_LIMIT:
            return None
    if length is None:
        return None
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise LocalserveError(f"{model_dir}: the maximum input length {str(length)[:40]} is not a positive integer")
    return length


def _inside(folder: Path, relative: Any, where: Path) -> Path:
    """A module's folder; modules.json is untrusted, so it must stay inside the model folder."""
    path = (folder / str(relative)).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise LocalserveError(f"{where}: a module's path leaves the model folder")
    return path


def _json(path: Path) -> Any:
    return read_json(path, _MAX_JSON_BYTES) if path.exists() else None
