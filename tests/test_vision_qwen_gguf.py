"""Qwen2.5-VL from llama.cpp's two files: the text model as GGUF arch ``qwen2vl`` (Qwen2 with
M-RoPE sections) and its ``qwen2.5vl_merger`` projector, written with gguf-py as llama.cpp's
converter writes them (tests/mmproj_util.py) from the tiny checkpoint of
tests/test_vision_qwen_engine.py (its tower's windows at the released 112 px, which llama.cpp
assumes).

Against llama.cpp itself (llama-cpp-python's libmtmd): each image's embeddings and greedy
tokens with one and two images, the images at sizes neither side resizes (llama.cpp resizes
with a bicubic filter of its own); against the HF checkpoint the files were written from:
the same image tokens and the same greedy tokens."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from localserve.formats import open_checkpoint
from localserve.vision import load_image_encoder
from localserve.vision.image_input import image_from_bytes

from .mmproj_util import llama_cpp_generate, rewrite_gguf, write_qwen25vl_pair
from .test_vision_qwen_engine import IM_END, SPECIAL, TEMPLATE, VOCAB, _engine, _greedy, _picture, _prompt
from .test_vision_qwen_engine import save_checkpoint

MODEL, PROJECTOR = "tiny-qwen25vl.gguf", "mmproj-tiny-qwen25vl-f32.gguf"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The HF checkpoint and the folder of its two GGUF files."""
    hf = tmp_path_factory.mktemp("qwen25vl-hf")
    save_checkpoint(hf, "qwen2.5-vl", window=112)
    return hf, write_qwen25vl_pair(hf, tmp_path_factory.mktemp("qwen25vl-gguf") / "pair", SPECIAL, VOCAB, TEMPLATE,
                                   IM_END)


def _at(kind: int, width: int, height: int) -> bytes:
    """Picture ``kind`` at a size both processors keep: whole merged patches (28 px)."""
    image = Image.open(io.BytesIO(_picture(kind))).convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


PICTURES = [_at(0, 112, 84), _at(2, 168, 56)]


def test_the_files_read_as_the_checkpoint(folders: tuple[Path, Path]) -> None:
    hf, pair = folders
    checkpoint = open_checkpoint(pair)
    assert checkpoint.spec.architecture == "qwen2" and checkpoint.spec.rope.mrope_section == (2, 3, 3)
    assert checkpoint.mmproj is not None and checkpoint.mmproj.path.name == PROJECTOR
    check_against_checkpoint(hf, pair, PICTURES)


def check_against_checkpoint(hf: Path, pair: Path, pictures: list[bytes]):  # type: ignore[no-untyped-def]
    """The pair's image tokens equal (F32 files: bit for bit) and its greedy tokens equal
    those of the HF checkpoint it was written from; both image encoders, for more checks."""
    cpu = torch.device("cpu")
    ours, theirs = (load_image_encoder(c, c.tokenizer(), cpu, torch.float32)
                    for c in (open_checkpoint(pair), open_checkpoint(hf)))
    assert ours is not None and theirs is not None
    images = [image_from_bytes(p) for p in (*pictures, _picture(1))]  # the last one resized
    for got, expected in zip(ours.model.encode_images(images), theirs.model.encode_images(images), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # F32 files: the very same numbers
    prompt = (_prompt(2), [_picture(0), _picture(2)])
    assert _greedy(_engine(pair), [prompt]) == _greedy(_engine(hf), [prompt])
    return ours, theirs


def test_embeddings_and_greedy_tokens_equal_llama_cpps(folders: tuple[Path, Path]) -> None:
    check_against_llama_cpp(folders[1], MODEL, PROJECTOR, PICTURES)


def check_against_llama_cpp(pair: Path, model: str, projector: str, pictures: list[bytes]) -> None:
    """Each image's embeddings and the greedy tokens with one image, then two, equal
    llama.cpp's (libmtmd) from the same two files (both Qwen families)."""
    engine = _engine(pair)
    assert engine.images is not None
    answers = []
    for count in (1, 2):
        chosen = pictures[:count]
        media = "".join("<__media__>" for _ in range(count))  # llama.cpp adds the vision tokens around each
        theirs = f"<|im_start|>user\n{media}what is in the picture?<|im_end|>\n<|im_start|>assistant\n"
        expected, embeddings = llama_cpp_generate(pair / model, pair / projector, theirs, chosen, 8)
        got = engine.images.model.encode_images([image_from_bytes(p) for p in chosen])
        for ours, reference in zip(got, embeddings, strict=True):
            # [tokens, parts, hidden] side by side (Qwen3-VL's deepstack parts): llama.cpp's row per token.
            np.testing.assert_allclose(ours.flatten(1).detach().numpy(), reference, rtol=0,
                                       atol=2e-3 * np.abs(reference).max())
        answers.append(_greedy(engine, [(_prompt(count), chosen)], 8)[0])
        assert answers[-1] == expected
    assert answers[0] != answers[1]  # the second image changes the answer: images are read


def test_a_projector_with_a_piece_missing_is_refused(folders: tuple[Path, Path], tmp_path: Path) -> None:
    from localserve.errors import LocalserveError

    _, pair = folders
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MODEL).symlink_to(pair / MODEL)
    rewrite_gguf(pair / PROJECTOR, broken / PROJECTOR, drop=("v.blk.0.attn_k.weight",))  # k's rows of q/k/v
    checkpoint = open_checkpoint(broken)
    with pytest.raises(LocalserveError, match=r"holds pieces \[0, 2\] of blocks.0.attn.qkv.weight"):
        load_image_encoder(checkpoint, checkpoint.tokenizer(), torch.device("cpu"), torch.float32)


def test_a_q8_0_projector_runs_quantized_as_llama_cpp_runs_it(folders: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The tower's matrices in Q8_0 (q, k and v in three pieces) kept quantized (as on a
    CPU with VNNI): one int8-kernel weight for the joined q/k/v; the embeddings as
    llama.cpp's from the same file."""
    from localserve.kernels.quant_linear_cpu import TiledWeight
    from localserve.vision import quantized
    from localserve.vision.quantized import QuantizedLinear

    monkeypatch.setattr(quantized, "runs_quantized", lambda device: True)
    hf, _ = folders
    pair = write_qwen25vl_pair(hf, tmp_path / "pair", SPECIAL, VOCAB, TEMPLATE, IM_END, matrices="Q8_0")
    checkpoint = open_checkpoint(pair)
    encoder = load_image_encoder(checkpoint, checkpoint.tokenizer(), torch.device("cpu"), torch.float32)
    assert encoder is not None
    qkv = encoder.model.blocks[0].attn.qkv
    assert isinstance(qkv, QuantizedLinear) and isinstance(qkv.weight, TiledWeight) and qkv.out_features == 96
    assert not any(isinstance(m, torch.nn.Linear) for m in encoder.model.modules())
    media = "<__media__>"
    theirs = f"<|im_start|>user\n{media}what is in the picture?<|im_end|>\n<|im_start|>assistant\n"
    _, embeddings = llama_cpp_generate(pair / MODEL, pair / "mmproj-tiny-qwen25vl-q8_0.gguf", theirs, PICTURES[:1], 1)
    [got] = encoder.model.encode_images([image_from_bytes(PICTURES[0])])
    # Q8_0's rounding moves this tiny random tower's output ~1.3% from the F32 file's (on
    # either side); ours stays within 0.8% of llama.cpp's, widening the codes would be 1.1%.
    np.testing.assert_allclose(got[:, 0].detach().numpy(), embeddings[0], rtol=0, atol=1e-2 * np.abs(embeddings[0]).max())
