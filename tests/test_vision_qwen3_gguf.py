"""Qwen3-VL from llama.cpp's two files: the text model as GGUF arch ``qwen3vl`` (Qwen3 with
interleaved M-RoPE sections) and its ``qwen3vl_merger`` projector (deepstack mergers under
``v.deepstack.<block>``), written with gguf-py as llama.cpp's converter writes them
(tests/mmproj_util.py) from the tiny checkpoint of tests/test_vision_qwen_engine.py, with
two changes: M-RoPE sections of 3, 3, 2 pairs, where llama.cpp's interleaving and
transformers' agree (with fewer frame pairs, llama.cpp turns the last frame pair by a fourth
position, 0 for text, where transformers turns it by the frame's), and deepstack blocks 0
and 2, so a merger's block is not its place; its processor takes the released pixel bounds,
which the GGUF side assumes.

Against llama.cpp itself (llama-cpp-python's libmtmd): each image's embeddings (its tokens
and deepstack features side by side, as llama.cpp hands them to the text model) and greedy
tokens with one and two images, at sizes neither side resizes; against the HF checkpoint:
the same image tokens and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from localserve.errors import LocalserveError
from localserve.formats import open_checkpoint

from .mmproj_util import rewrite_gguf, write_qwen3vl_pair
from .test_vision_qwen_engine import IM_END, SPECIAL, TEMPLATE, VOCAB
from .test_vision_qwen_engine import save_checkpoint
from .test_vision_qwen_gguf import _at, check_against_checkpoint, check_against_llama_cpp

MODEL, PROJECTOR = "tiny-qwen3vl.gguf", "mmproj-tiny-qwen3vl-f32.gguf"
RELEASED_PIXELS = (65_536, 16_777_216)  # Qwen3-VL's preprocessor_config.json: 64 to 16,384 tokens
# Whole merged patches (32 px), over the least area: 70 and 65 tokens.
PICTURES = [_at(0, 320, 224), _at(2, 416, 160)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The HF checkpoint and the folder of its two GGUF files."""
    hf = tmp_path_factory.mktemp("qwen3vl-hf")
    rope = {"rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    save_checkpoint(hf, "qwen3-vl", pixels=RELEASED_PIXELS, text={"rope_scaling": rope},
                    vision={"deepstack_visual_indexes": [0, 2]})
    return hf, write_qwen3vl_pair(hf, tmp_path_factory.mktemp("qwen3vl-gguf") / "pair", SPECIAL, VOCAB, TEMPLATE,
                                  IM_END)


def test_the_files_read_as_the_checkpoint(folders: tuple[Path, Path]) -> None:
    hf, pair = folders
    checkpoint = open_checkpoint(pair)
    rope = checkpoint.spec.rope
    assert (checkpoint.spec.architecture, rope.mrope_section, rope.mrope_interleaved) == ("qwen3", (3, 3, 2), True)
    assert checkpoint.mmproj is not None and checkpoint.mmproj.path.name == PROJECTOR
    ours, theirs = check_against_checkpoint(hf, pair, PICTURES)
    assert ours.model.config == theirs.model.config


def test_embeddings_and_greedy_tokens_equal_llama_cpps(folders: tuple[Path, Path]) -> None:
    check_against_llama_cpp(folders[1], MODEL, PROJECTOR, PICTURES)


def test_a_text_model_without_its_sections_is_refused(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, pair = folders
    rewrite_gguf(pair / MODEL, tmp_path / MODEL, drop=("qwen3vl.rope.dimension_sections",))
    with pytest.raises(LocalserveError, match="metadata qwen3vl.rope.dimension_sections is missing"):
        open_checkpoint(tmp_path / MODEL)


def test_the_moe_text_model_reads_as_qwen3_moe(tmp_path: Path) -> None:
    """llama.cpp's Qwen3-VL MoE text model (arch ``qwen3vlmoe``): Qwen3-MoE's tensors and keys,
    its M-RoPE interleaved; here a tiny Qwen3-MoE file renamed so."""
    import gguf

    from .gguf_writers import tiny_moe, write_gguf

    write_gguf(tmp_path / "moe.gguf", tiny_moe("qwen3_moe"), gguf.GGMLQuantizationType.F32)
    rewrite_gguf(tmp_path / "moe.gguf", tmp_path / "vl.gguf", arch="qwen3vlmoe",
                 extra={"qwen3vlmoe.rope.dimension_sections": [6, 5, 5, 0]})
    spec = open_checkpoint(tmp_path / "vl.gguf").spec
    assert (spec.architecture, spec.num_experts, spec.rope.mrope_section, spec.rope.mrope_interleaved) == (
        "qwen3_moe", 4, (6, 5, 5), True)
