"""What makes an HF folder an embedding model, and how its tensors are named.

An embedding model in our architectures (Qwen3-Embedding: a qwen3 decoder) is served
as sentence-transformers describes it: ``modules.json`` lists the pipeline (the
transformer, a Pooling module, usually Normalize) and the Pooling module's
``config.json`` says which pooling (``pooling_mode``: ``lasttoken``, ``mean`` or ``cls``;
earlier versions wrote ``pooling_mode_lasttoken: true`` and the like). Embeddings are always L2-normalized, as OpenAI's and Ollama's
``/api/embed`` are; any other module (a Dense projection) would change the vector, so
such a pipeline is refused rather than served wrong.

Such checkpoints are often saved from the bare model class (``Qwen3Model``): their
tensors lack the ``model.`` prefix (``layers.0.self_attn.q_proj.weight``) and there is
no LM head, which an embedding model never uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import LocalserveError
from ..json_files import read_json

# sentence-transformers' Pooling modes (its config's ``pooling_mode`` since version 6) ->
# our pooling names; the flags earlier versions wrote (``pooling_mode_<flag>: true``).
_POOLING = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}
_MODULES = "sentence_transformers.models."
_HARMLESS_MODULES = {"Transformer", "Normalize"}  # the model itself; a normalization we always apply
_MAX_JSON_BYTES = 1 << 20


def pooling_from_modules(model_dir: Path) -> str | None:
    """The pooling a sentence-transformers folder declares ("mean", "cls", "last"), or
    None when it is no such folder (a generative model)."""
    modules = _read_json(model_dir / "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise LocalserveError(f"{model_dir / 'modules.json'}: expected a list of modules")
    pooling_dirs = []
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_MODULES)
        if kind == "Pooling":
            pooling_dirs.append(str(module.get("path", "")))
        elif kind not in _HARMLESS_MODULES:
            raise LocalserveError(f"{model_dir.name}: the sentence-transformers module {kind!r} is not supported "
                                  "(Transformer, Pooling and Normalize are)")
    if len(pooling_dirs) != 1:
        raise LocalserveError(f"{model_dir / 'modules.json'}: expected one Pooling module, found {len(pooling_dirs)}")
    config_path = (model_dir / pooling_dirs[0] / "config.json").resolve()
    if not config_path.is_relative_to(model_dir.resolve()):
        raise LocalserveError(f"{model_dir / 'modules.json'}: the Pooling module's path leaves the model folder")
    return read_pooling(config_path)


def read_pooling(config_path: Path) -> str:
    """A Pooling module's ``config.json`` -> "cls", "mean" or "last" (either form
    sentence-transformers writes); any other pooling, or one that leaves out the prompt,
    is refused."""
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise LocalserveError(f"{config_path}: missing, or not a JSON object")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _POOLING_FLAGS.items() if config.get(key) is True]
    elif isinstance(modes, str):
        modes = [modes]
    if not isinstance(modes, list) or len(modes) != 1 or modes[0] not in _POOLING or \
            config.get("include_prompt", True) is not True:
        shown = ", ".join(map(str, modes)) if isinstance(modes, list) else str(modes)
        raise LocalserveError(f"{config_path}: one of CLS, mean or last-token pooling over the whole input is "
                              f"supported (this one: {shown or 'none'}"
                              f"{'' if config.get('include_prompt', True) is True else ', prompt excluded'})")
    return _POOLING[modes[0]]


def _read_json(path: Path) -> Any:
    return read_json(path, _MAX_JSON_BYTES) if path.exists() else None


def saved_bare(names: set[str]) -> bool:
    """Whether the tensors were saved from the bare model class: no ``model.`` prefix."""
    return "embed_tokens.weight" in names and not any(name.startswith("model.") for name in names)


def bare_name(name: str) -> str:
    """A bare model's tensor under the name a causal LM's checkpoint gives it."""
    return f"model.{name}"
