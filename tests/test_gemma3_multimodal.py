"""Gemma 3's image-text checkpoints (4B, 12B, 27B; ``model_type`` gemma3) served as text
models: the language model read from under ``text_config`` and its tensor prefix, the
vision tower's tensors left to the image side (tests/test_vision_gemma3.py). One tiny random model in two layouts (see ``folders``), one with
the released checkpoints' config: a ``text_config`` holding only what differs from
Gemma3TextConfig's defaults, its rope settings in the old ``rope_scaling`` form. The oracle
is transformers' own Gemma3ForConditionalGeneration loading each folder, run on text alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from localserve import Engine, EngineConfig
from localserve.formats import open_checkpoint
from localserve.formats.layout import check_tensors

from .conftest import hf_greedy, hf_logits, random_prompt, reinitialise, relative_error
from .test_models import TOLERANCE, all_logits, greedy_outputs

# What the tiny model states; everything else is Gemma3TextConfig's default (8 heads of 256,
# 4 K/V heads, query scale 1/16, rotary bases 1e6 and 1e4, every 6th layer global).
_TEXT = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "sliding_window": 12, "max_position_embeddings": 1024,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
_VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "image_size": 56, "patch_size": 14}


def _released_config() -> dict:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": _TEXT,
            "vision_config": _VISION, "mm_tokens_per_image": 4, "boi_token_index": 255999,
            "eoi_token_index": 256000, "image_token_index": 262144, "eos_token_id": [1, 106],
            "torch_dtype": "float32", "transformers_version": "4.50.0.dev0"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"saved": as transformers saves the model (its full config; the released names,
    ``language_model.model.*``, which transformers 5 still writes); "sparse": the released
    sparse config, tensors under transformers 5's module names (``model.language_model.*``)."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    root = tmp_path_factory.mktemp("gemma3-mm")
    sparse = root / "sparse"
    sparse.mkdir()
    (sparse / "config.json").write_text(json.dumps(_released_config()))
    model = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(sparse))
    reinitialise(model, seed=31)
    saved = root / "saved"
    model.save_pretrained(saved)
    tensors = load_file(saved / "model.safetensors")
    assert {name.split(".")[0] for name in tensors} == {"language_model", "vision_tower", "multi_modal_projector"}
    renamed = {f"model.{name.replace('language_model.model.', 'language_model.', 1)}": tensor
               for name, tensor in tensors.items()}
    save_file(renamed, sparse / "model.safetensors", metadata={"format": "pt"})
    return {"saved": saved, "sparse": sparse}


def _oracle(path: Path):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def test_released_config_reads_as_transformers_reads_it(folders) -> None:
    """The sparse text_config filled with the text config's defaults: the spec equals
    what transformers makes of the same file."""
    from transformers import AutoConfig

    spec = open_checkpoint(folders["sparse"]).spec
    text = AutoConfig.from_pretrained(folders["sparse"]).text_config
    assert spec.architecture == "gemma3"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (text.num_attention_heads,
                                                                  text.num_key_value_heads, text.head_dim) == (8, 4, 256)
    assert spec.attention_scale == text.query_pre_attn_scalar**-0.5
    full = text.rope_parameters["full_attention"]
    assert (spec.rope.kind, spec.rope.theta, spec.rope.factor) == (full["rope_type"], full["rope_theta"], full["factor"])
    assert spec.local_rope is not None and spec.local_rope.theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert spec.full_attention_layers == tuple(i for i, kind in enumerate(text.layer_types) if kind == "full_attention")
    assert spec.eos_token_ids == [1, 106] and spec.tie_word_embeddings


def test_show_counts_the_text_model_and_says_images_are_read(folders) -> None:
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    from localserve.facts.checkpoint import model_info

    info, lines = model_info(folders["saved"])
    with torch.device("meta"):
        reference = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(folders["saved"]))
    assert info["parameters"] == reference.model.language_model.num_parameters() and info["image_text"]
    assert ("images", "read (OpenAI image_url, Ollama images, Anthropic image blocks): a 1-layer SigLIP tower "
                      "at 56 px, 4 tokens per image") in lines


@pytest.mark.parametrize("layout", ["saved", "sparse"])
def test_logits_and_greedy_match_transformers(folders, layout: str) -> None:
    path = folders[layout]
    checkpoint = open_checkpoint(path)
    check_tensors(checkpoint)  # every text tensor present and placed; the vision ones are not read
    assert not any("vision" in name or "projector" in name for name, _, _ in checkpoint.headers)
    oracle = _oracle(path)
    engine = Engine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16), device="cpu",
                    dtype=torch.float32)
    prompts = [random_prompt(n, seed=n) for n in (1, 17, 60)]
    for prompt, ours in zip(prompts, all_logits(engine, prompts, chunks=[7, 16, 30, 10])):
        error = relative_error(ours, hf_logits(oracle, prompt))
        assert error <= TOLERANCE, f"{layout}: {error:.1e} for a prompt of {len(prompt)}"
    # Greedy decoding past the window of 12, three mixed prompts, prefill in chunks.
    for prompt, tokens in zip(prompts, greedy_outputs(engine, prompts, 8)):
        assert tokens == hf_greedy(oracle, prompt, 8), f"{layout}: prompt of {len(prompt)} tokens"


def test_a_text_config_of_another_family_is_refused(tmp_path) -> None:
    from localserve.errors import LocalserveError

    config = _released_config()
    config["text_config"] = {**_TEXT, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LocalserveError, match="text_config must be gemma3_text"):
        open_checkpoint(tmp_path)
