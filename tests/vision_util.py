"""A tiny Gemma 3 image-text checkpoint that localserve serves over HTTP (weights, a
tokenizer whose ids agree with the config, a Gemma 3 style chat template), and small
PNG images drawn with Pillow.

The weights are those of tests/test_vision_gemma3.py's checkpoint (the config here, with the
image token inside the vocabulary, seeded the same way, saved by transformers). The
tokenizer is built here with the ``tokenizers`` library: a character-level BPE over
printable ASCII with a few merges (``"\\n\\n"`` and some English words), every one of the
model's 320 ids listed explicitly, Gemma 3's special tokens at the ids the config names.
Text round-trips exactly for ASCII; anything else encodes to ``<unk>``."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CHAT_TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
GEMMA3_TEMPLATE = CHAT_TEMPLATES / "gemma3.jinja"

VOCAB = 320
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 56, 14, 4  # a 4 x 4 patch grid pooled to 2 x 2 image tokens
PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN = 0, 1, 2, 3, 4, 5
BOI, EOI, IMAGE_TOKEN = 300, 301, 302
SPECIAL_TOKENS = {PAD: "<pad>", EOS: "<eos>", BOS: "<bos>", UNK: "<unk>", START_OF_TURN: "<start_of_turn>",
                  END_OF_TURN: "<end_of_turn>", BOI: "<start_of_image>", EOI: "<end_of_image>",
                  IMAGE_TOKEN: "<image_soft_token>"}
# Whole words (each also with a leading space) merged from their characters.
WORDS = ("the", "image", "picture", "what", "is", "this", "in", "describe", "user", "model", "hi", "colour",
         "shape", "a", "of", "and", "it", "see", "you", "do")
# Words, numbers, other runs, newlines and other whitespace: what BPE merges within.
PRE_TOKENIZER = r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\n+|[^\S\n]+"


def gemma3_config(image_token: int = IMAGE_TOKEN, **text: object) -> dict:
    """The tiny model's config; released Gemma 3 has its image token inside the vocabulary
    (the default), some configs past it. ``text`` overrides text_config's keys."""
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                        "query_pre_attn_scalar": 32, "sliding_window": 6, "sliding_window_pattern": 3,
                        "max_position_embeddings": 512},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SIZE,
                          "patch_size": PATCH, "vision_use_head": False},
        "mm_tokens_per_image": TOKENS_PER_IMAGE, "boi_token_index": BOI, "eoi_token_index": EOI,
        "image_token_index": image_token, "eos_token_id": EOS, "torch_dtype": "float32",
    }
    config["text_config"].update(text)
    return config


def _vocabulary(special_tokens: dict[int, str] = SPECIAL_TOKENS, size: int = VOCAB,
                ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Every id 0..size-1: the special tokens at their ids, newlines, printable ASCII,
    the words' merge chains, then unused fillers."""
    pieces: list[str] = ["\n", "\n\n", *(chr(c) for c in range(32, 127))]
    merges: list[tuple[str, str]] = [("\n", "\n")]
    for word in WORDS:
        for spelled in (word, " " + word):
            for end in range(2, len(spelled) + 1):
                merge = (spelled[:end - 1], spelled[end - 1])
                if merge not in merges:
                    merges.append(merge)
                if spelled[:end] not in pieces:
                    pieces.append(spelled[:end])
    vocab: dict[str, int] = {text: token for token, text in special_tokens.items()}
    free = (token for token in range(size) if token not in special_tokens)
    for piece in pieces:
        vocab[piece] = next(free)
    for token in free:
        vocab[f"<unused{token}>"] = token
    assert sorted(vocab.values()) == list(range(size)), "the pieces do not fit the vocabulary"
    return vocab, merges


def build_tokenizer(special_tokens: dict[int, str] = SPECIAL_TOKENS, size: int = VOCAB,
                    unk: str = "<unk>"):  # type: ignore[no-untyped-def]
    """The ``tokenizers.Tokenizer`` the checkpoint's tokenizer.json holds (another
    family's special tokens and vocabulary size when given)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _vocabulary(special_tokens, size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZER), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                  for _, text in sorted(special_tokens.items())])
    for token, text in special_tokens.items():
        assert tokenizer.token_to_id(text) == token, (text, tokenizer.token_to_id(text))
    return tokenizer


def tiny_gemma3_vision(root: Path, name: str = "gemma3-vision", **text: object) -> Path:
    """A complete tiny Gemma 3 image-text checkpoint folder under ``root``: config.json
    and model.safetensors (transformers' save_pretrained of tests/test_vision_gemma3.py's
    model, seeded), tokenizer.json and tokenizer_config.json (Gemma 3's chat template from
    tests/chat_templates/gemma3.jinja, ``<bos>``, ``<eos>``, no BOS added to encodings);
    ``text`` overrides text_config's keys."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    from .conftest import reinitialise

    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(gemma3_config(**text)))
    model = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(folder))
    reinitialise(model, seed=7)
    model.save_pretrained(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": GEMMA3_TEMPLATE.read_text(encoding="utf-8"), "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 512}))
    return folder


def _encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png(kind: int) -> bytes:
    """A small PNG, one of several distinct pictures: 0 a colour gradient, 1 shapes on
    white, 2 a noise field, 3 stripes on black, 4 a dark, single-colour square."""
    if kind == 0:
        gradient = np.zeros((90, 120, 3), dtype=np.uint8)
        gradient[..., 0] = np.linspace(0, 255, 120)[None, :]
        gradient[..., 1] = np.linspace(255, 0, 90)[:, None]
        return _encoded(Image.fromarray(gradient))
    if kind == 1:
        shapes = Image.new("RGB", (64, 80), "white")
        draw = ImageDraw.Draw(shapes)
        draw.ellipse((5, 5, 40, 50), fill="red")
        draw.rectangle((30, 40, 60, 75), fill="blue")
        return _encoded(shapes)
    if kind == 2:
        return _encoded(Image.fromarray(np.random.default_rng(3).integers(0, 256, (70, 70, 3), dtype=np.uint8)))
    if kind == 3:
        stripes = Image.new("RGB", (100, 60), "black")
        draw = ImageDraw.Draw(stripes)
        for x in range(0, 100, 20):
            draw.rectangle((x, 0, x + 9, 59), fill=(255, 220, 0))
        return _encoded(stripes)
    if kind == 4:
        return _encoded(Image.new("RGB", (48, 48), (20, 40, 90)))
    raise ValueError(f"no picture of kind {kind}")


def data_url(png_bytes: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode("ascii")
