"""Qwen2.5-VL's and Qwen3-VL's image sides against transformers on tiny random
checkpoints saved by transformers: the config files read (and bad ones refused), the
processor's pixels and grids (transformers' Qwen2VLImageProcessorPil: its torchvision twin
Qwen2VLImageProcessor cannot be imported without torchvision), the vision towers' image
tokens (and Qwen3-VL's deepstack features) for one image and for images of different
sizes in one call (Qwen2.5-VL: window attention with several windows, some cut short, and
full-attention blocks), the tensor names, and the M-RoPE position ids of prompts with 0, 1
and 2 images. The images are drawn here with Pillow: a gradient, shapes, text, a large
noisy one the processor shrinks and a tiny one it grows."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from localserve.errors import LocalserveError
from localserve.vision.image_input import image_from_bytes
from localserve.vision.mrope import mrope_positions
from localserve.vision.qwen3_vl import Qwen3VisionTransformer
from localserve.vision.qwen_config import Qwen3VisionConfig, QwenVisionConfig
from localserve.vision.qwen_vl import QwenVisionTransformer, checkpoint_name

IMAGE, VIDEO, VISION_START, VISION_END = 300, 301, 302, 303
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64  # small, so one of the images is shrunk


def qwen25_config() -> dict:
    """4 blocks (1 and 3 attend across the image), windows of 2 x 2 merged patches."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "text_config": {"model_type": "qwen2_5_vl_text", "vocab_size": 400, "hidden_size": 48,
                        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "num_key_value_heads": 1, "bos_token_id": 1, "eos_token_id": 2,
                        "rope_scaling": {"type": "mrope", "mrope_section": [4, 4, 4]}},
        "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": 4, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2,
                          "window_size": 56, "fullatt_block_indexes": [1, 3], "out_hidden_size": 48},
        "image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights at std 1/sqrt(fan in) (the Conv3d's fan in is all of a patch's values);
    norms and biases random too, so a weight loaded into the wrong place shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, (param.numel() // param.shape[0]) ** -0.5, generator=generator)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5, generator=generator)
            else:
                param.uniform_(0.5, 1.5, generator=generator)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Qwen2.5-VL and its processor saved by transformers, transformers' model of
    it (the oracle) and ours, loaded from the saved tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen25-vl")
    (folder / "config.json").write_text(json.dumps(qwen25_config()))
    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(folder))
    _randomize(model, seed=11)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)

    config = QwenVisionConfig.from_hf(json.loads((folder / "config.json").read_text()),
                                      json.loads((folder / "preprocessor_config.json").read_text()))
    ours = QwenVisionTransformer(config)
    tensors = load_file(folder / "model.safetensors")
    state = {checkpoint_name(name): tensor for name, tensor in tensors.items() if checkpoint_name(name) is not None}
    ours.load_state_dict(state)  # strict: every name matches
    return folder, model.eval(), processor, ours.eval()


def _images() -> dict[str, Image.Image]:
    gradient = np.zeros((90, 120, 3), dtype=np.uint8)
    gradient[..., 0] = np.linspace(0, 255, 120)[None, :]
    gradient[..., 1] = np.linspace(255, 0, 90)[:, None]
    gradient[..., 2] = 90
    shapes = Image.new("RGB", (64, 80), "white")
    draw = ImageDraw.Draw(shapes)
    draw.ellipse((5, 5, 40, 50), fill="red")
    draw.rectangle((30, 40, 60, 75), fill="blue")
    text = Image.new("RGB", (200, 50), (250, 245, 230))
    ImageDraw.Draw(text).text((6, 16), "Qwen sees 42 pixels", fill=(20, 30, 120))
    noise = np.random.default_rng(3).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    large = Image.fromarray(noise)  # 120,000 pixels: shrunk to fit MAX_PIXELS
    ImageDraw.Draw(large).polygon([(20, 20), (380, 60), (200, 280)], fill=(0, 200, 80))
    tiny = Image.fromarray(np.random.default_rng(4).integers(0, 256, (30, 20, 3), dtype=np.uint8))  # grown
    return {"gradient": Image.fromarray(gradient), "shapes": shapes, "text": text, "large": large, "tiny": tiny}


IMAGES = _images()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# -- config ----------------------------------------------------------------------------


def test_config_is_read(checkpoint) -> None:
    _, model, _, ours = checkpoint
    config = ours.config
    assert (config.depth, config.hidden_size, config.intermediate_size, config.num_heads) == (4, 32, 64, 2)
    assert (config.patch_size, config.spatial_merge_size, config.temporal_patch_size) == (14, 2, 2)
    assert (config.window_size, config.window_merged_patches, config.fullatt_block_indexes) == (56, 2, (1, 3))
    assert (config.out_hidden_size, config.in_channels, config.rope_theta) == (48, 3, 10_000.0)
    assert (config.tokens.image_token_id, config.tokens.vision_start_token_id,
            config.tokens.vision_end_token_id) == (IMAGE, VISION_START, VISION_END)
    processing = config.processing
    assert (processing.min_pixels, processing.max_pixels) == (MIN_PIXELS, MAX_PIXELS)  # from size{} (transformers 5)
    assert processing.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert processing.std == pytest.approx((0.26862954, 0.26130258, 0.27577711))
    assert processing.rescale_factor == pytest.approx(1 / 255)
    assert config.rope_theta == model.config.vision_config.rope_parameters["rope_theta"]


def test_released_layout_of_the_config_files() -> None:
    """The released files: in_chans, min_pixels / max_pixels, no rope_parameters."""
    config = qwen25_config()
    vision = config["vision_config"]
    vision["in_chans"] = vision.pop("in_channels", 3)
    preprocessor = {"min_pixels": 3136, "max_pixels": 12_845_056, "patch_size": 14, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 1.0],
                    "size": {"shortest_edge": 1, "longest_edge": 2}}  # min/max_pixels win, as in transformers
    read = QwenVisionConfig.from_hf(config, preprocessor)
    assert (read.in_channels, read.rope_theta) == (3, 10_000.0)
    assert (read.processing.min_pixels, read.processing.max_pixels) == (3136, 12_845_056)
    assert read.processing.std == (0.25, 0.5, 1.0)
    defaults = QwenVisionConfig.from_hf(config, None).processing  # no preprocessor_config.json
    assert (defaults.min_pixels, defaults.max_pixels, defaults.patch_size) == (56 * 56, 28 * 28 * 1280, 14)


def _broken(change) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    config = qwen25_config()
    preprocessor = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    change(config, config["vision_config"], preprocessor)
    return config, preprocessor


BROKEN = {
    "no vision_config": (lambda c, v, p: c.pop("vision_config"), "vision_config is missing"),
    "no depth": (lambda c, v, p: v.pop("depth"), "vision_config.depth is missing"),
    "fractional heads": (lambda c, v, p: v.update(num_heads=2.5), "vision_config.num_heads must be"),
    "heads do not divide": (lambda c, v, p: v.update(num_heads=3), "vision_config.hidden_size 32"),
    "bool patch": (lambda c, v, p: v.update(patch_size=True), "vision_config.patch_size must be"),
    "window below a merged patch": (lambda c, v, p: v.update(window_size=20), "vision_config.window_size 20"),
    "full block out of range": (lambda c, v, p: v.update(fullatt_block_indexes=[1, 4]),
                                "vision_config.fullatt_block_indexes"),
    "activation": (lambda c, v, p: v.update(hidden_act="gelu"), "vision_config.hidden_act"),
    "no image token": (lambda c, v, p: c.pop("image_token_id"), "config.json: image_token_id is missing"),
    "bad start token": (lambda c, v, p: c.update(vision_start_token_id="x"), "vision_start_token_id must be"),
    "min over max": (lambda c, v, p: p.update(min_pixels=10**6, max_pixels=10**5), "min_pixels 1,000,000"),
    "negative max": (lambda c, v, p: p["size"].update(longest_edge=-1), "size.longest_edge must be"),
    "patch disagrees": (lambda c, v, p: p.update(patch_size=16), "patch_size 16 does not match"),
    "two means": (lambda c, v, p: p.update(image_mean=[0.5, 0.5]), "image_mean must be three numbers"),
    "zero std": (lambda c, v, p: p.update(image_std=[0.5, 0.0, 0.5]), "image_std must be positive"),
    "no resizing": (lambda c, v, p: p.update(do_resize=False), "do_resize false"),
    "size not an object": (lambda c, v, p: p.update(size=224), "size must be an object"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_bad_config_is_refused(case: str) -> None:
    change, message = BROKEN[case]
    config, preprocessor = _broken(change)
    with pytest.raises(LocalserveError, match=message.replace("(", r"\(")) as caught:
        QwenVisionConfig.from_hf(config, preprocessor)
    assert "\n" not in str(caught.value)


# -- processor -------------------------------------------------------------------------


def test_resize_rule_matches_transformers(checkpoint) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    processing = checkpoint[3].config.processing
    for height in (1, 13, 14, 41, 42, 70, 97, 300, 1000):
        for width in (1, 14, 42, 56, 99, 150, 400):
            if max(height, width) / min(height, width) > 200:
                continue
            assert processing.resized_size(height, width) == smart_resize(
                height, width, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS), (height, width)
    with pytest.raises(LocalserveError, match="more elongated than 200:1"):
        processing.resized_size(1, 201)


def test_pixels_and_grids_match_the_processor(checkpoint) -> None:
    _, _, processor, ours = checkpoint
    grids = {}
    for name, image in IMAGES.items():
        theirs = processor(images=[image], return_tensors="pt")
        got = ours.pixels(image)
        assert list(got.grid) == theirs["image_grid_thw"][0].tolist(), name
        assert got.patches.shape == theirs["pixel_values"].shape, name
        assert torch.equal(got.patches, theirs["pixel_values"].float()), name  # the same arithmetic, bit for bit
        grids[name] = got.grid
    assert grids["large"] == (1, 12, 18)  # 400 x 300 shrunk to 252 x 168 pixels
    assert grids["tiny"] == (1, 6, 4)  # 20 x 30 grown to 56 x 84
    from_bytes = ours.pixels(image_from_bytes(_png(IMAGES["text"])))
    assert torch.equal(from_bytes.patches, ours.pixels(IMAGES["text"]).patches)


# -- tower -----------------------------------------------------------------------------


def test_tensor_names_are_the_checkpoints(checkpoint) -> None:
    from safetensors import safe_open

    folder, _, _, ours = checkpoint
    with safe_open(folder / "model.safetensors", "pt") as tensors:
        vision = sorted(name for name in tensors.keys() if not name.startswith(("model.", "lm_head.")))
    assert vision and all(name.startswith("visual.") for name in vision)  # transformers 5 writes the released layout
    assert sorted("visual." + name for name in ours.state_dict()) == vision
    assert checkpoint_name("model.visual.blocks.0.norm1.weight") == "blocks.0.norm1.weight"  # transformers 4.5x
    assert checkpoint_name("model.layers.0.mlp.up_proj.weight") is None


def _theirs(model, pixels: list) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    patches = torch.cat([p.patches for p in pixels])
    grids = torch.tensor([list(p.grid) for p in pixels])
    with torch.no_grad():
        return list(model.model.get_image_features(patches, grids).pooler_output)


@pytest.mark.parametrize("names", [["large"], ["gradient"], ["text", "large", "tiny"]],
                         ids=["one-large", "one-small", "three-sizes"])
def test_image_tokens_match_transformers(checkpoint, names: list[str]) -> None:
    _, model, _, ours = checkpoint
    pixels = [ours.pixels(IMAGES[name]) for name in names]
    with torch.no_grad():
        got = ours.encode(pixels)
    expected = _theirs(model, pixels)
    assert [g.shape for g in got] == [e.shape for e in expected]
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    scale = max(float(e.abs().max()) for e in expected)
    assert worst < 1e-4, (worst, scale)
    assert scale > 0.1  # not a degenerate output


def test_images_in_one_call_do_not_see_each_other(checkpoint) -> None:
    ours = checkpoint[3]
    pixels = [ours.pixels(IMAGES[name]) for name in ("shapes", "large")]
    with torch.no_grad():
        together = ours.encode(pixels)
        alone = [ours.encode([p])[0] for p in pixels]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_windows_change_the_result(checkpoint) -> None:
    """The window blocks really attend within windows: with every block attending across
    the image the tokens differ (so the comparisons above cover the windows)."""
    ours = checkpoint[3]
    pixels = ours.pixels(IMAGES["large"])
    across = copy.deepcopy(ours)
    across.config = dataclasses.replace(ours.config, fullatt_block_indexes=(0, 1, 2, 3))
    with torch.no_grad():
        assert float((across.encode([pixels])[0] - ours.encode([pixels])[0]).abs().max()) > 1e-3


# -- M-RoPE ----------------------------------------------------------------------------


def _prompt(grids: list[tuple[int, int, int]]) -> list[int]:
    ids = [1, 5, 6]
    for number, (t, h, w) in enumerate(grids):
        ids += [VISION_START] + [IMAGE] * (t * h * w // MERGE ** 2) + [VISION_END] + [10 + number] * (2 + number)
    return ids + [7, 8]


@pytest.mark.parametrize("grids", [[], [(1, 12, 18)], [(1, 4, 14), (1, 6, 4)], [(1, 2, 2), (1, 8, 8)]],
                         ids=["no-image", "one", "two", "two-square"])
def test_mrope_positions_match_transformers(checkpoint, grids: list[tuple[int, int, int]]) -> None:
    model = checkpoint[1]
    ids = _prompt(grids)
    got, delta = mrope_positions(ids, IMAGE, grids, MERGE)
    input_ids = torch.tensor([ids])
    expected, expected_delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    assert torch.equal(got, expected[:, 0])
    assert delta == int(expected_delta)
    assert delta == sum(max(h, w) // MERGE - t * h * w // MERGE ** 2 for t, h, w in grids)


def test_mrope_refuses_tokens_that_do_not_fit_the_images() -> None:
    with pytest.raises(LocalserveError, match="needs 4 image tokens"):
        mrope_positions([1, IMAGE, IMAGE, 2], IMAGE, [(1, 4, 4)], MERGE)
    with pytest.raises(LocalserveError, match="more image tokens"):
        mrope_positions([1, IMAGE, 2], IMAGE, [], MERGE)
    with pytest.raises(LocalserveError, match="fewer than its 1 image"):
        mrope_positions([1, 2], IMAGE, [(1, 2, 2)], MERGE)


def test_grid_helpers_agree_with_the_pixels(checkpoint) -> None:
    ours = checkpoint[3]
    processing = ours.config.processing
    for image in IMAGES.values():
        pixels = ours.pixels(image)
        assert processing.grid(image.height, image.width) == pixels.grid
        assert processing.tokens(image.height, image.width) == ours.tokens_per_image(pixels.grid)
        assert pixels.num_patches == math.prod(pixels.grid)



# -- Qwen3-VL --------------------------------------------------------------------------

PATCH3 = 16
MIN_PIXELS3, MAX_PIXELS3 = 32 * 32 * 4, 32 * 32 * 64


def qwen3_config() -> dict:
    """4 blocks, blocks 0 and 2 feeding deepstack mergers, a 6 x 6 grid of learned
    positions (resized up and down to the images' grids)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 400, "hidden_size": 48, "intermediate_size": 64,
                        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24,
                        "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": {
                            "rope_type": "default", "mrope_section": [4, 4, 4], "mrope_interleaved": True}},
        "vision_config": {"model_type": "qwen3_vl_vision", "depth": 4, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "patch_size": PATCH3, "spatial_merge_size": MERGE, "temporal_patch_size": 2,
                          "out_hidden_size": 48, "num_position_embeddings": 36, "deepstack_visual_indexes": [0, 2]},
        "image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }


@pytest.fixture(scope="module")
def checkpoint3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Qwen3-VL and its processor (16-pixel patches, mean and std 0.5, as released)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3-vl")
    (folder / "config.json").write_text(json.dumps(qwen3_config()))
    model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(folder))
    _randomize(model, seed=12)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS3, max_pixels=MAX_PIXELS3, patch_size=PATCH3,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)

    config = Qwen3VisionConfig.from_hf(json.loads((folder / "config.json").read_text()),
                                       json.loads((folder / "preprocessor_config.json").read_text()))
    ours = Qwen3VisionTransformer(config)
    tensors = load_file(folder / "model.safetensors")
    state = {checkpoint_name(name): tensor for name, tensor in tensors.items() if checkpoint_name(name) is not None}
    ours.load_state_dict(state)
    return folder, model.eval(), processor, ours.eval()


def test_qwen3_config_is_read(checkpoint3) -> None:
    config = checkpoint3[3].config
    assert (config.depth, config.hidden_size, config.num_heads, config.patch_size) == (4, 32, 2, 16)
    assert (config.num_position_embeddings, config.positions_per_side) == (36, 6)
    assert config.deepstack_visual_indexes == (0, 2)
    assert (config.hidden_act, config.out_hidden_size, config.rope_theta) == ("gelu_pytorch_tanh", 48, 10_000.0)
    assert (config.processing.patch_size, config.processing.mean, config.processing.std) == (16, (0.5,) * 3, (0.5,) * 3)
    assert (config.processing.min_pixels, config.processing.max_pixels) == (MIN_PIXELS3, MAX_PIXELS3)
    assert config.tokens.image_token_id == IMAGE


BROKEN3 = {
    "no deepstack list": (lambda c, v: v.pop("deepstack_visual_indexes"), "deepstack_visual_indexes is missing"),
    "deepstack past the blocks": (lambda c, v: v.update(deepstack_visual_indexes=[0, 9]), "deepstack_visual_indexes"),
    "positions not square": (lambda c, v: v.update(num_position_embeddings=35), "num_position_embeddings 35"),
    "activation": (lambda c, v: v.update(hidden_act="relu"), "vision_config.hidden_act 'relu'"),
    "rope type": (lambda c, v: v.update(rope_parameters={"rope_type": "yarn"}), "rope_type 'yarn'"),
}


@pytest.mark.parametrize("case", BROKEN3, ids=list(BROKEN3))
def test_qwen3_bad_config_is_refused(case: str) -> None:
    change, message = BROKEN3[case]
    config = qwen3_config()
    change(config, config["vision_config"])
    with pytest.raises(LocalserveError, match=message):
        Qwen3VisionConfig.from_hf(config, None)


def test_qwen3_pixels_and_names(checkpoint3) -> None:
    from safetensors import safe_open

    folder, _, processor, ours = checkpoint3
    for name in ("large", "text", "tiny"):
        theirs = processor(images=[IMAGES[name]], return_tensors="pt")
        got = ours.pixels(IMAGES[name])
        assert list(got.grid) == theirs["image_grid_thw"][0].tolist()
        assert torch.equal(got.patches, theirs["pixel_values"].float())
    with safe_open(folder / "model.safetensors", "pt") as tensors:
        vision = sorted(name for name in tensors.keys() if name.startswith("model.visual."))
    assert sorted("model.visual." + name for name in ours.state_dict()) == vision  # the released layout


@pytest.mark.parametrize("names", [["large"], ["text", "large", "tiny"]], ids=["one", "three-sizes"])
def test_qwen3_image_tokens_and_deepstack_match_transformers(checkpoint3, names: list[str]) -> None:
    _, model, _, ours = checkpoint3
    pixels = [ours.pixels(IMAGES[name]) for name in names]
    with torch.no_grad():
        got = ours.encode(pixels)
        expected = model.model.get_image_features(torch.cat([p.patches for p in pixels]),
                                                  torch.tensor([list(p.grid) for p in pixels]))
    assert len(expected.deepstack_features) == 2
    for number, image in enumerate(got):
        assert len(image.deepstack) == 2
        pairs = [(image.tokens, expected.pooler_output[number])]
        pairs += [(mine, theirs[number]) for mine, theirs in zip(image.deepstack, expected.deepstack_features)]
        for mine, theirs in pairs:
            assert mine.shape == theirs.shape
            assert float((mine - theirs).abs().max()) < 1e-4
            assert float(theirs.abs().max()) > 0.1


def test_qwen3_mrope_positions_match_transformers(checkpoint3) -> None:
    model = checkpoint3[1]
    grids = [(1, 4, 12), (1, 6, 4)]
    ids = _prompt(grids)
    got, delta = mrope_positions(ids, IMAGE, grids, MERGE)
    input_ids = torch.tensor([ids])
    expected, expected_delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    assert torch.equal(got, expected[:, 0])
    assert delta == int(expected_delta)
