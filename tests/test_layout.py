"""The layout of a spec (formats/layout.py), the one statement of which tensors make a
model: against what transformers saves for every kind (an independent reference: its own
names and shapes), against the slots the engine's model fills, and against GGUF files."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from localserve.formats import open_checkpoint
from localserve.formats.gpt_oss import canonical_headers
from localserve.formats.layout import IGNORED_SUFFIXES, check_tensors, layout
from localserve.models.llama import LlamaForCausalLM

from .conftest import MODEL_KINDS, TinyModels
from .gguf_writers import tiny_llama, tiny_moe, write_gguf


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_layout_is_what_transformers_saves(tiny_models: TinyModels, kind: str) -> None:
    path, _ = tiny_models.get(kind)
    checkpoint = open_checkpoint(path)
    saved: dict[str, tuple[int, ...]] = {}
    for file in checkpoint.files:
        with safe_open(file, framework="numpy") as handle:
            saved |= {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    if kind == "gpt_oss":  # its packed experts and router, under the names the layout gives them
        saved = {name: shape for name, shape, _ in canonical_headers((n, s, "F32") for n, s in saved.items())}
    saved = {n: s for n, s in saved.items() if not n.endswith(IGNORED_SUFFIXES)}
    if checkpoint.spec.tie_word_embeddings:
        saved.pop("lm_head.weight", None)
    expected = layout(checkpoint.spec)
    assert {n: expected.shapes.get(n) for n in saved} == saved  # every saved tensor, with its shape
    assert expected.missing(set(saved)) == []  # and nothing more is needed
    check_tensors(checkpoint)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_layout_names_the_slots_the_model_fills(tiny_models: TinyModels, kind: str) -> None:
    spec = open_checkpoint(tiny_models.get(kind)[0]).spec
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, 16, torch.device("meta"))
    assert set(layout(spec).shapes) == set(model.checkpoint_slots())


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_gguf_files_meet_the_layout(tmp_path, kind: str) -> None:
    import gguf

    model = tiny_llama() if kind == "llama" else tiny_moe(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.Q8_0)  # gguf-py quantizes Q8_0 itself
    check_tensors(open_checkpoint(path))
