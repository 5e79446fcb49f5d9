"""Qwen2.5-VL and Qwen3-VL end to end in the engine, against transformers'
Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration on tiny random
checkpoints saved by transformers (a tokenizer with Qwen's special tokens, a chat template
that writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an image). Qwen3-VL's text
model turns by interleaved M-RoPE and takes its tower's deepstack features after its first
layers.

The reference's inputs are made independently of localserve: pixel values and grids by
transformers' Qwen2VLImageProcessorPil, and each ``<|image_pad|>`` of the prompt repeated
once per merged patch of its image (grid frames x rows x columns / merge**2), as
Qwen2_5_VLProcessor documents it (the processor class itself wants torchvision's video
processor, which has no build for this torch). Greedy tokens for prompts with 0, 1 and 2
images of different sizes, in one batch with a text-only request, with prefill chunks that
cut through an image's tokens; the M-RoPE positions the text after an image takes; the
prefix cache; the daemon through the openai client."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image, ImageDraw

from localserve import Engine, EngineConfig, SamplingParams
from localserve.server.config import ServerConfig
from localserve.vision.image_input import image_from_bytes

from .server_util import running_server, small_engine_config
from .vision_util import build_tokenizer

VOCAB = 400
PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 0, 1, 2, 302, 303, 300, 301
SPECIAL = {PAD: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>", VISION_START: "<|vision_start|>",
           VISION_END: "<|vision_end|>", IMAGE_PAD: "<|image_pad|>", VIDEO_PAD: "<|video_pad|>"}
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
# Qwen2-VL's chat template, cut to what these tests send: turns, and an image part as the
# vision tokens around one <|image_pad|>.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _config(family: str, window: int = 56) -> dict:
    if family == "qwen3-vl":
        return {
            "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": {"model_type": "qwen3_vl_text", "vocab_size": VOCAB, "hidden_size": 64,
                            "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
                            "tie_word_embeddings": False, "bos_token_id": IM_START, "eos_token_id": IM_END,
                            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                             "mrope_interleaved": True}},
            "vision_config": {"model_type": "qwen3_vl_vision", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
                              "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "out_hidden_size": 64, "num_position_embeddings": 36,
                              "deepstack_visual_indexes": [0, 1]},
            "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, "vision_start_token_id": VISION_START,
            "vision_end_token_id": VISION_END, "eos_token_id": IM_END, "torch_dtype": "float32",
        }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "text_config": {"model_type": "qwen2_5_vl_text", "vocab_size": VOCAB, "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": False,
                        "bos_token_id": IM_START, "eos_token_id": IM_END, "rope_theta": 10000.0,
                        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "window_size": window, "fullatt_block_indexes": [1], "out_hidden_size": 64},
        "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END, "eos_token_id": IM_END, "torch_dtype": "float32",
    }


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The folder, transformers' model of it and its image processor."""
    return save_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def save_checkpoint(folder: Path, family: str, window: int = 56,  # type: ignore[no-untyped-def]
                    pixels: tuple[int, int] = (MIN_PIXELS, MAX_PIXELS), text: dict | None = None,
                    vision: dict | None = None):
    """A tiny checkpoint of ``family`` saved in ``folder`` (Qwen3-VL's processor with
    16-pixel patches and a mean and std of 0.5, as released; ``pixels`` its bounds; ``text``
    and ``vision`` changes to the configs); the folder, transformers' model of it and its
    image processor."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .conftest import reinitialise

    model_class = Qwen3VLForConditionalGeneration if family == "qwen3-vl" else Qwen2_5_VLForConditionalGeneration
    config = _config(family, window)
    config["text_config"].update(text or {})
    config["vision_config"].update(vision or {})
    (folder / "config.json").write_text(json.dumps(config))
    model = model_class(AutoConfig.from_pretrained(folder))
    reinitialise(model, seed=5)
    model.save_pretrained(folder)
    processing = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == "qwen3-vl" else {}
    Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], **processing).save_pretrained(folder)
    build_tokenizer(SPECIAL, VOCAB, unk="<|endoftext|>").save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 1024}))
    reference = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, reference, Qwen2VLImageProcessorPil.from_pretrained(folder)


def _picture(kind: int) -> bytes:
    """Pictures of different sizes, so their token counts differ: 0 a gradient (120 x 90),
    1 shapes (64 x 80), 2 text drawn on a wide strip (200 x 60)."""
    if kind == 0:
        array = np.zeros((90, 120, 3), dtype=np.uint8)
        array[..., 0] = np.linspace(0, 255, 120)[None, :]
        array[..., 2] = np.linspace(255, 0, 90)[:, None]
        image = Image.fromarray(array)
    elif kind == 1:
        image = Image.new("RGB", (64, 80), "white")
        draw = ImageDraw.Draw(image)
        draw.ellipse((5, 5, 40, 50), fill="red")
        draw.rectangle((30, 40, 60, 75), fill="blue")
    else:
        image = Image.new("RGB", (200, 60), (250, 240, 200))
        ImageDraw.Draw(image).text((10, 20), "total 42.00", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _engine(folder: Path, **overrides: object) -> Engine:
    config = dict(max_num_seqs=4, max_model_len=512, num_kv_blocks=256, block_size=4)
    config.update(overrides)
    return Engine(folder, EngineConfig(**config), device="cpu")  # type: ignore[arg-type]


def _prompt(images: int) -> str:
    parts = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in range(images))
    return f"<|im_start|>user\n{parts}what is in the picture?<|im_end|>\n<|im_start|>assistant\n"


def _reference(checkpoint, prompt: str, pictures: list[bytes], tokens: int = 8) -> list[int]:  # type: ignore[no-untyped-def]
    folder, model, processor = checkpoint
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    kwargs: dict = {}
    if pictures:
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
        processed = processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        counts = [int(grid.prod()) // 4 for grid in processed["image_grid_thw"]]
        pieces = prompt.split("<|image_pad|>")
        prompt = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    # Which tokens are an image's, as the processor marks them: transformers 5 turns the
    # rotary by M-RoPE positions only when told (else every token's three are its index).
    kwargs["mm_token_type_ids"] = (ids == IMAGE_PAD).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def _greedy(engine: Engine, requests: list[tuple[str, list[bytes]]], tokens: int = 8) -> list[list[int]]:
    ids = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                              images=[image_from_bytes(p) for p in pictures]) for prompt, pictures in requests]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
    return [done[request_id] for request_id in ids]


@pytest.mark.parametrize("images", [0, 1, 2])
def test_greedy_tokens_match_transformers(checkpoint, images: int) -> None:  # type: ignore[no-untyped-def]
    pictures = [_picture(kind) for kind in (0, 2)[:images]]
    expected = _reference(checkpoint, _prompt(images), pictures)
    assert _greedy(_engine(checkpoint[0]), [(_prompt(images), pictures)]) == [expected]


def test_a_batch_with_text_and_chunks_that_cut_through_images(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Qwen's image tokens are read causally, so a chunk may end inside an image: 7-token
    steps cut every image; the text-only request shares the steps."""
    requests = [(_prompt(2), [_picture(1), _picture(2)]), (_prompt(0), []), (_prompt(1), [_picture(0)])]
    expected = [_reference(checkpoint, prompt, pictures) for prompt, pictures in requests]
    assert _greedy(_engine(checkpoint[0], max_num_batched_tokens=7), requests) == expected


def test_positions_after_an_image_and_the_prefix_cache(checkpoint) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(checkpoint[0])
    picture = _picture(2)
    engine.add_request(_prompt(1), SamplingParams(max_tokens=1), images=[image_from_bytes(picture)])
    request = next(iter(engine.requests.values()))
    span = request.images[0]
    # The 200 x 60 strip: each side rounded to whole merged patches (28 px for Qwen2.5-VL's
    # 14 px patches, 32 for Qwen3-VL's 16): 7 x 2 or 6 x 2 of them.
    factor = 32 if "qwen3" in checkpoint[0].name else 28
    columns, rows = round(200 / factor), round(60 / factor)
    assert span.length == rows * columns
    positions = request.mrope_positions
    assert positions is not None
    assert positions[:, span.start].tolist() == [span.start] * 3
    assert positions[:, span.end - 1].tolist() == [span.start, span.start + rows - 1, span.start + columns - 1]
    # The text after the image goes on from the image's start plus its longer side, not its token count.
    assert positions[:, span.end].tolist() == [span.start + max(rows, columns)] * 3
    assert request.position_delta == max(rows, columns) - rows * columns
    while engine.has_unfinished_requests():
        engine.step()
    # The same prompt with another image must not take the first one's cached K/V; with the
    # same image it may, and the image is encoded once.
    other = _greedy(engine, [(_prompt(1), [_picture(0)])])
    again = _greedy(engine, [(_prompt(1), [picture])])
    assert other == [_reference(checkpoint, _prompt(1), [_picture(0)])]
    assert again == [_reference(checkpoint, _prompt(1), [picture])] and other != again
    assert engine.images is not None and engine.images.num_encoded == 2


def test_served_through_the_openai_client(checkpoint) -> None:  # type: ignore[no-untyped-def]
    import base64

    folder = checkpoint[0]
    picture = _picture(1)
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    config = ServerConfig(models={"qwen": folder}, preload=["qwen"], engine=small_engine_config(), device="cpu")
    with running_server(config) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="qwen", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is in the picture?"}]}])
    from tokenizers import Tokenizer

    expected = _reference(checkpoint, _prompt(1), [picture], tokens=6)
    if IM_END in expected:
        expected = expected[:expected.index(IM_END)]
    assert answer.choices[0].message.content == Tokenizer.from_file(str(folder / "tokenizer.json")).decode(expected)
