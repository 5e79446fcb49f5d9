"""Checkpoint readers: every on-disk format becomes a ModelSpec plus named weights.

Opening a checkpoint reads its metadata alone (spec, tokenizer, chat template) and
needs no torch, so ``localserve pull`` and ``show`` stay light; the weights come from
``formats/weights.py`` when a model is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LocalserveError
from ..json_files import read_json_object
from ..text.chat_template import ChatTemplate, NoChatTemplateError
from ..text.gguf_tokenizer import tokenizer_from_gguf_metadata
from ..text.tokenizer import Tokenizer
from . import embedding, gpt_oss, hf, mmproj, multimodal
from .architectures import ARCHITECTURES
from .gguf import chat_template_from_gguf, spec_from_gguf
from .gguf_file import GGUFFile, read_gguf
from .hf import QuantConfig, TensorHeader, quant_config_from
from .spec import ModelSpec, RopeSpec

if TYPE_CHECKING:
    from .weights import NamedWeight


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint's description; weights are read when ``weights()`` is iterated."""

    path: Path
    spec: ModelSpec
    files: list[Path]  # HF safetensors shards (empty for GGUF)
    # The shards' tensor headers (HF), under canonical names (formats/gpt_oss.py renames GPT-OSS's).
    headers: list[TensorHeader] = field(default_factory=list)
    quant: QuantConfig | None = None  # GPTQ/AWQ layers come out as QuantWeights
    gguf: GGUFFile | None = None  # the parsed file, for .gguf checkpoints
    # An image-text HF checkpoint whose text model alone is read (formats/multimodal.py).
    image_text: bool = False
    # Tensors saved from the bare model class, without the ``model.`` prefix (formats/embedding.py).
    bare: bool = False
    # An image-text checkpoint's vision tower and projector, under multimodal.vision_name's names.
    vision_headers: list[TensorHeader] = field(default_factory=list)
    # A GGUF model's vision projector file (llama.cpp's mmproj, formats/mmproj.py).
    mmproj: GGUFFile | None = None

    @property
    def reads_images(self) -> bool:
        """It has a vision side: an image-text HF checkpoint, or a GGUF model with a projector."""
        return self.image_text or self.mmproj is not None

    @property
    def quantized_gguf(self) -> bool:
        """A GGUF file whose matrices are quantized (not F32, F16 or BF16)."""
        dense = (0, 1, 30)  # ggml's F32, F16, BF16
        return self.gguf is not None and any(len(info.shape) >= 2 and info.ggml_type not in dense
                                             for info in self.gguf.tensors.values())

    def weights(self) -> Iterator[NamedWeight]:
        """(HF name, weight) for every weight, read from the files as iterated."""
        from .weights import iter_weights  # torch: only when a model is loaded

        return iter_weights(self)

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none."""
        return read_tokenizer(self.path, self.gguf)

    def check_loadable(self) -> Tokenizer | None:
        """What a load checks before it allocates anything, and a pull before it registers
        a model, so that what is listed loads: every tensor there, shaped and of a type
        localserve loads (from the headers); the tokenizer builds; the chat template, when
        the model has one, compiles. Returns the tokenizer. (A registration also checks
        the image side: facts.checkpoint.check_images.)"""
        from .layout import check_tensors  # layout imports this module

        check_tensors(self)
        tokenizer = self.tokenizer()
        self.chat_template_or_none()
        return tokenizer

    def chat_template(self, source: str | None = None) -> ChatTemplate:
        """The checkpoint's chat template (tokenizer_config.json / chat_template.jinja, or
        GGUF metadata), or ``source`` (a model's own TEMPLATE) with the checkpoint's special
        tokens; a LocalserveError says when there is none or it is broken."""
        if self.gguf is not None:
            return chat_template_from_gguf(self.gguf, source)
        return ChatTemplate.from_dir(self.path, source=source)

    def chat_template_or_none(self, source: str | None = None) -> ChatTemplate | None:
        """The chat template, or None when the model ships none: then prompts are completed
        as plain text. A broken one (or one over the size limit) is a LocalserveError."""
        try:
            return self.chat_template(source)
        except NoChatTemplateError:
            return None


def read_tokenizer(path: Path, gguf: GGUFFile | None = None) -> Tokenizer | None:
    """The tokenizer of an HF folder (tokenizer.json) or of a GGUF file (its vocabulary,
    from ``gguf`` when already open), or None when it ships none; reads nothing else, so
    it works for architectures localserve cannot run."""
    if gguf is None and path.is_file():
        with read_gguf(path) as opened:
            return read_tokenizer(path, opened)
    if gguf is not None:
        if "tokenizer.ggml.model" not in gguf.metadata:
            return None
        return tokenizer_from_gguf_metadata(gguf.metadata)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's description (not its weights yet): an HF folder, a .gguf file,
    or a folder holding a .gguf model and its vision projector (formats/mmproj.py)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LocalserveError(f"{path}: no such file or folder")
    if path.is_file():
        return open_gguf(path)
    if not (path / "config.json").exists() and (files := mmproj.gguf_folder_files(path)) is not None:
        return open_gguf(*files)
    config = hf.read_config(path)
    text_config = multimodal.text_config(config)
    spec = hf.spec_from_config(text_config or config)
    quant = quant_config_from(config)
    if quant is not None:
        _check_group_size(spec, quant)
    files = hf.shard_files(path)
    headers = hf.read_headers(files)
    vision_headers: list[TensorHeader] = []
    if text_config is not None:
        vision_headers = multimodal.vision_headers(headers)
        headers = multimodal.text_headers(headers)
    bare = embedding.saved_bare({name for name, _, _ in headers})
    if bare:
        headers = [(embedding.bare_name(name), shape, dtype) for name, shape, dtype in headers]
    if ARCHITECTURES[spec.architecture].packed_experts:
        headers = gpt_oss.canonical_headers(headers)
    spec.pooling = embedding.pooling_from_modules(path)
    if spec.pooling and all(name != "lm_head.weight" for name, _, _ in headers):
        spec.tie_word_embeddings = True  # an embedding model's LM head is never used: none is loaded
    hf.check_headers(spec, headers)
    _merge_generation_eos(path, spec)
    return Checkpoint(path=path, spec=spec, files=files, headers=headers, quant=quant,
                      image_text=text_config is not None, bare=bare, vision_headers=vision_headers)


def open_gguf(path: Path, projector: Path | None = None) -> Checkpoint:
    """A .gguf model file (a split model's first shard), with its vision projector file when given."""
    gguf = read_gguf(path)
    try:
        if mmproj.is_projector(gguf):
            raise LocalserveError(f"{path} is a vision projector (mmproj), not a model: open its model with it "
                                  "(--mmproj, or a folder holding both)")
        checkpoint = Checkpoint(path=path, spec=spec_from_gguf(gguf), files=[], gguf=gguf)
        if projector is not None:
            checkpoint.mmproj = mmproj.open_projector(projector)
    except BaseException:
        gguf.close()
        raise
    return checkpoint


def _check_group_size(spec: ModelSpec, quant: QuantConfig) -> None:
    # Every quantized layer's inputs are one of these widths; a group must divide each.
    widths = {spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size,
              spec.moe_intermediate_size, spec.shared_expert_intermediate_size} - {0}
    if quant.group_size != -1 and any(width % quant.group_size for width in widths):
        raise LocalserveError(f"config.json: {quant.method.upper()} group_size {quant.group_size} does not divide "
                              f"the layers' input widths ({', '.join(map(str, sorted(widths)))})")


def _merge_generation_eos(path: Path, spec: ModelSpec) -> None:
    # generation_config.json may list more end tokens than config.json (Llama 3's
    # <|eot_id|>); HF generate stops on all of them.
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return
    eos = read_json_object(gen_path, 1 << 20).get("eos_token_id")
    tokens = [eos] if isinstance(eos, int) else eos or []
    if not isinstance(tokens, list) or any(type(token) is not int or not 0 <= token < spec.vocab_size
                                           for token in tokens):
        raise LocalserveError(f"{gen_path}: eos_token_id {str(eos)[:80]} is not a token id or a list of them "
                              f"(0..{spec.vocab_size - 1:,})")
    spec.eos_token_ids.extend(token for token in dict.fromkeys(tokens) if token not in spec.eos_token_ids)


__all__ = ["Checkpoint", "ModelSpec", "RopeSpec", "open_checkpoint"]
