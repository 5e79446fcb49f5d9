"""Gemma 3 reads images: the processor's pixels, the vision tower and projector, and the
whole model's greedy tokens with 0, 1 and 2 images, alone and beside text-only requests,
with prefill chunks that would split an image, against transformers' own
Gemma3ForConditionalGeneration (and its PIL image processor) on tiny random models. The
images are drawn here with Pillow (a gradient, shapes, a photo-like noise field)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from localserve import Engine, EngineConfig, SamplingParams
from localserve.errors import LocalserveError
from localserve.vision.image_input import image_from_bytes

from .conftest import reinitialise
from .vision_util import BOI, EOI, IMAGE_SIZE, TOKENS_PER_IMAGE, gemma3_config

TOKENS = TOKENS_PER_IMAGE


@pytest.fixture(scope="module", params=[302, 262_144], ids=["image-token-in-vocabulary", "image-token-past-it"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny Gemma 3 saved by transformers, and transformers' model of it (the oracle).
    Released Gemma 3 has its image token inside the vocabulary; configs whose token lies
    past it are read as transformers reads them (the token looks up row 0)."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    folder = tmp_path_factory.mktemp("gemma3-vision")
    (folder / "config.json").write_text(json.dumps(gemma3_config(request.param)))
    model = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(folder))
    reinitialise(model, seed=7)
    model.save_pretrained(folder)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return folder, model.eval()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _images() -> list[bytes]:
    gradient = np.zeros((90, 120, 3), dtype=np.uint8)
    gradient[..., 0] = np.linspace(0, 255, 120)[None, :]
    gradient[..., 1] = np.linspace(255, 0, 90)[:, None]
    shapes = Image.new("RGB", (64, 80), "white")
    draw = ImageDraw.Draw(shapes)
    draw.ellipse((5, 5, 40, 50), fill="red")
    draw.rectangle((30, 40, 60, 75), fill="blue")
    noise = np.random.default_rng(3).integers(0, 256, (70, 70, 3), dtype=np.uint8)
    return [_png(Image.fromarray(gradient)), _png(shapes), _png(Image.fromarray(noise))]


def _expanded(prompt: list[int], image_token: int) -> list[int]:
    """The processor's expansion of each <start_of_image>, restated: the image's tokens and <end_of_image>."""
    out: list[int] = []
    for token in prompt:
        out.append(token)
        if token == BOI:
            out += [image_token] * TOKENS + [EOI]
    return out


def _hf_pixels(pictures: list[bytes]) -> torch.Tensor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return processor(images=[Image.open(io.BytesIO(p)) for p in pictures], return_tensors="pt")["pixel_values"]


def _hf_greedy(model, prompt: list[int], pictures: list[bytes], tokens: int) -> list[int]:
    image_token = model.config.image_token_id
    ids = torch.tensor([_expanded(prompt, image_token)])
    extra = {"pixel_values": _hf_pixels(pictures), "token_type_ids": (ids == image_token).long()} if pictures else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             do_sample=False, **extra)
    return out[0, ids.shape[1]:].tolist()


def _engine(path: Path, **options) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(path, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64, block_size=4, **options),
                  device="cpu")


def _run(engine: Engine, requests: list[tuple[list[int], list[bytes]]], tokens: int) -> list[list[int]]:
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0),
                              images=[image_from_bytes(p) for p in pictures])
           for prompt, pictures in requests]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
    return [done[i] for i in ids]


PROMPTS = {
    0: ([2, 17, 40, 41, 90], []),
    1: ([2, 17, BOI, 40, 41, 90], [0]),
    2: ([2, BOI, 33, 34, BOI, 12, 13, 14, 15], [1, 2]),
}


def test_pixels_and_image_tokens_match_transformers(checkpoint) -> None:
    path, model = checkpoint
    pictures = _images()
    encoder = _engine(path).images
    assert encoder is not None
    ours = torch.stack([encoder.model.pixels(image_from_bytes(p)) for p in pictures])
    theirs = _hf_pixels(pictures)
    assert ours.shape == theirs.shape == (3, 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    with torch.no_grad():
        expected = model.get_image_features(theirs).pooler_output
        got = encoder.model(ours)
    assert got.shape == expected.shape == (3, TOKENS, 64)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("images", [0, 1, 2])
def test_greedy_tokens_match_transformers(checkpoint, images: int) -> None:
    path, model = checkpoint
    pictures = _images()
    prompt, which = PROMPTS[images]
    chosen = [pictures[i] for i in which]
    expected = _hf_greedy(model, prompt, chosen, 8)
    assert _run(_engine(path), [(prompt, chosen)], 8) == [expected]


def test_images_in_a_batch_with_text_and_chunks_that_would_split_them(checkpoint) -> None:
    """Four requests at once (no image, one, two, the first again with another image), in
    prefill chunks of 3 tokens: an image's 4 tokens see each other, so no chunk may end
    inside one (a chunk that would is cut before the image, or takes the image whole)."""
    path, model = checkpoint
    pictures = _images()
    requests = [(PROMPTS[0][0], []), (PROMPTS[1][0], [pictures[0]]), (PROMPTS[2][0], [pictures[1], pictures[2]]),
                (PROMPTS[1][0], [pictures[2]])]
    expected = [_hf_greedy(model, prompt, chosen, 6) for prompt, chosen in requests]
    engine = _engine(path, max_num_batched_tokens=3)
    assert _run(engine, requests, 6) == expected
    assert engine.kv.device.num_free == engine.kv.device.num_blocks  # every block back


def test_the_prefix_cache_tells_images_apart_and_the_encoder_cache_reuses_them(checkpoint) -> None:
    """The same prompt with another image must not take the first one's cached K/V (the
    placeholder tokens are equal, the images are not); the same image again is encoded once."""
    path, model = checkpoint
    pictures = _images()
    prompt = [2, 17, 18, 19, 20, 21, 22, 23, BOI, 40, 41, 42]
    engine = _engine(path)
    first = _run(engine, [(prompt, [pictures[0]])], 5)
    second = _run(engine, [(prompt, [pictures[1]])], 5)
    again = _run(engine, [(prompt, [pictures[0]])], 5)
    assert first == again == [_hf_greedy(model, prompt, [pictures[0]], 5)]
    assert second == [_hf_greedy(model, prompt, [pictures[1]], 5)]
    assert first != second
    assert engine.images is not None and engine.images.num_encoded == 2


def test_image_places_must_match_the_images(checkpoint) -> None:
    path, _ = checkpoint
    engine = _engine(path)
    image = image_from_bytes(_images()[0])
    with pytest.raises(LocalserveError, match="1 image markers .* for 2 images"):
        engine.add_request([2, BOI, 5], SamplingParams(max_tokens=2), images=[image, image])
    with pytest.raises(LocalserveError, match="0 image markers"):
        engine.add_request([2, 5], SamplingParams(max_tokens=2), images=[image])


def test_a_step_encodes_its_images_in_batches_of_bounded_patches(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The images one step reaches are encoded in batches of at most ``batch_patches``
    patches (here one image's: three batches for three images), with the same greedy
    tokens; ``fit`` counts such a batch's activations."""
    from localserve.facts.fit import plan
    from localserve.vision.footprint import BATCH_PATCHES

    path, model = checkpoint
    pictures = _images()
    requests = [(PROMPTS[1][0], [pictures[0]]), (PROMPTS[2][0], [pictures[1], pictures[2]])]
    expected = [_hf_greedy(model, prompt, chosen, 4) for prompt, chosen in requests]
    engine = _engine(path)
    assert engine.images is not None
    config = engine.images.model.config
    engine.images.batch_patches = config.max_patches
    batch_sizes: list[int] = []
    encode = engine.images.model.encode_images
    monkeypatch.setattr(engine.images.model, "encode_images",
                        lambda images: batch_sizes.append(len(images)) or encode(images))
    assert _run(engine, requests, 4) == expected
    assert batch_sizes == [1, 1, 1]  # all three reached by the first step
    planned = plan(path)
    assert planned.image_activation_bytes == max(BATCH_PATCHES, config.max_patches) * config.floats_per_patch * 4
    assert planned.activation_bytes >= planned.image_activation_bytes
