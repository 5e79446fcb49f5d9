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

from .mmproj_util import llama_cpp_generate, write_qwen25vl_pair
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
    checkpoint, reference = open_checkpoint(pair), open_checkpoint(hf)
    assert checkpoint.spec.architecture == "qwen2" and checkpoint.spec.rope.mrope_section == (2, 3, 3)
    assert checkpoint.mmproj is not None and checkpoint.mmproj.path.name == PROJECTOR
    cpu = torch.device("cpu")
    ours, theirs = (load_image_encoder(c, c.tokenizer(), cpu, torch.float32) for c in (checkpoint, reference))
    assert ours is not None and theirs is not None
    images = [image_from_bytes(p) for p in (*PICTURES, _picture(1))]
    for got, expected in zip(ours.model.encode_images(images), theirs.model.encode_images(images), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # F32 files: the very same numbers
    prompt = (_prompt(2), [_picture(0), _picture(2)])
    assert _greedy(_engine(pair), [prompt]) == _greedy(_engine(hf), [prompt])


def test_embeddings_and_greedy_tokens_equal_llama_cpps(folders: tuple[Path, Path]) -> None:
    _, pair = folders
    engine = _engine(pair)
    assert engine.images is not None
    answers = []
    for count in (1, 2):
        pictures = PICTURES[:count]
        media = "".join("<__media__>" for _ in range(count))  # llama.cpp adds the vision tokens around each
        theirs = f"<|im_start|>user\n{media}what is in the picture?<|im_end|>\n<|im_start|>assistant\n"
        expected, embeddings = llama_cpp_generate(pair / MODEL, pair / PROJECTOR, theirs, pictures, 8)
        got = engine.images.model.encode_images([image_from_bytes(p) for p in pictures])
        for ours, reference in zip(got, embeddings, strict=True):
            np.testing.assert_allclose(ours[:, 0].detach().numpy(), reference, rtol=0,
                                       atol=2e-3 * np.abs(reference).max())
        answers.append(_greedy(engine, [(_prompt(count), pictures)], 8)[0])
        assert answers[-1] == expected
    assert answers[0] != answers[1]  # the second image changes the answer: images are read


def test_a_projector_with_a_piece_missing_is_refused(folders: tuple[Path, Path], tmp_path: Path) -> None:
    import gguf

    from localserve.errors import LocalserveError

    _, pair = folders
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MODEL).symlink_to(pair / MODEL)
    source = gguf.GGUFReader(pair / PROJECTOR)
    writer = gguf.GGUFWriter(str(broken / PROJECTOR), "clip")
    for name, field in source.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            main = field.types[0]
            writer.add_key_value(name, field.contents(), main,
                                 sub_type=field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    for tensor in source.tensors:
        if tensor.name != "v.blk.0.attn_k.weight":  # k's rows of the fused projection
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = open_checkpoint(broken)
    with pytest.raises(LocalserveError, match=r"holds pieces \[0, 2\] of blocks.0.attn.qkv.weight"):
        load_image_encoder(checkpoint, checkpoint.tokenizer(), torch.device("cpu"), torch.float32)
