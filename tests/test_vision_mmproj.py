"""Gemma 3 from llama.cpp's two files, a GGUF model and its vision projector (mmproj),
written with gguf-py as llama.cpp's converter writes them (tests/mmproj_util.py) from the
tiny image-text checkpoint of tests/vision_util.py.

The independent reference is llama.cpp itself (llama-cpp-python's libmtmd, what
llama-server runs with ``--mmproj``): each image's embeddings and the greedy tokens of
prompts with one and two images. The projector's encoder is also held against the HF
checkpoint it was written from, with its tower in F32, F16 and Q8_0 (which runs on the int8
kernel, as llama.cpp's does: against llama.cpp too). Then: how a folder's
files are told apart, the refusals, ``show`` and the daemon serving the pair."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import ollama
import pytest
import torch
from PIL import Image

from localserve import Engine, EngineConfig, SamplingParams
from localserve.errors import LocalserveError
from localserve.kernels.quant_linear_cpu import TiledWeight
from localserve.formats import open_checkpoint
from localserve.formats.mmproj import pair_folder
from localserve.registry.pull import pull
from localserve.server.config import ServerConfig
from localserve.vision import load_image_encoder
from localserve.vision.config import read_image_config
from localserve.vision.image_input import image_from_bytes
from localserve.vision import quantized
from localserve.vision.quantized import QuantizedLinear

from .fake_hub import FakeHub
from .test_pull import empty_registry
from .mmproj_util import gguf_pair, llama_cpp_generate, write_mmproj
from .server_util import running_server, small_engine_config
from .vision_util import BOI, EOI, IMAGE_SIZE, IMAGE_TOKEN, TOKENS_PER_IMAGE, png, tiny_gemma3_vision

# A window past every prompt here: llama.cpp fixes Gemma 3's pattern of sliding and full
# layers (every 6th full), which the tiny checkpoint's 3 layers do not follow.
WINDOW = 512


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3_vision(tmp_path_factory.mktemp("hf"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def pair(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_pair(hf_folder, tmp_path_factory.mktemp("gguf") / "pair")


@pytest.fixture(scope="module")
def engine(pair: Path) -> Engine:
    return Engine(pair, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=96, block_size=4), device="cpu")


def _at_size(kind: int) -> bytes:
    """Picture ``kind`` already at the tower's size: both sides then see the same pixels
    (llama.cpp resizes with a bilinear filter of its own, not Pillow's)."""
    image = Image.open(io.BytesIO(png(kind))).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _greedy(engine: Engine, prompt: str, pictures: list[bytes], max_tokens: int, ignore_eos: bool = False,
            ) -> list[int]:
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=ignore_eos),
                                    images=[image_from_bytes(p) for p in pictures])
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                tokens = output.token_ids
    assert tokens is not None
    return tokens


def _files(pair: Path) -> tuple[Path, Path]:
    return pair / "tiny-gemma3.gguf", pair / "mmproj-tiny-gemma3-f32.gguf"


def test_a_folder_of_a_model_and_its_projector_opens_as_one_model(pair: Path, hf_folder: Path) -> None:
    model, projector = _files(pair)
    checkpoint = open_checkpoint(pair)
    assert checkpoint.path == model and checkpoint.mmproj is not None and checkpoint.mmproj.path == projector
    assert checkpoint.reads_images and not open_checkpoint(model).reads_images  # the file alone: text only
    config, expected = read_image_config(checkpoint), read_image_config(open_checkpoint(hf_folder))
    assert config is not None and expected is not None
    # The image tokens found by their text in the GGUF vocabulary, the sizes from clip.vision.*.
    assert (config.boi_token_id, config.eoi_token_id, config.image_token_id) == (BOI, EOI, IMAGE_TOKEN)
    assert config.tokens_per_image == TOKENS_PER_IMAGE == expected.tokens_per_image
    assert (config.vision.image_size, config.vision.hidden_size, config.vision.num_layers) == (
        expected.vision.image_size, expected.vision.hidden_size, expected.vision.num_layers)
    assert config.mean == expected.mean and config.std == expected.std


def test_what_is_refused(pair: Path, tmp_path: Path) -> None:
    model, projector = _files(pair)
    with pytest.raises(LocalserveError, match="is a vision projector"):
        open_checkpoint(projector)
    two_models = tmp_path / "two"
    two_models.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(model, two_models / name)
    with pytest.raises(LocalserveError, match="one model and at most one vision projector"):
        open_checkpoint(two_models)
    with pytest.raises(LocalserveError, match="not a vision projector"):
        pair_folder(model, model, tmp_path / "links")  # a model named as the projector


def test_a_projector_for_another_model_or_family_is_refused(hf_folder: Path, pair: Path, tmp_path: Path) -> None:
    import gguf

    model, _ = _files(pair)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(model, wrong / model.name)
    # A projector whose tokens are another width than the text model's.
    source = gguf.GGUFReader(pair / "mmproj-tiny-gemma3-f32.gguf")
    writer = gguf.GGUFWriter(str(wrong / "mmproj.gguf"), "clip")
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "clip.vision.projection_dim":
            value = 128
        main = field.types[0]
        writer.add_key_value(name, value, main, sub_type=field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LocalserveError, match="belongs to another model"):
        read_image_config(open_checkpoint(wrong))


@pytest.mark.parametrize("matrices, tolerance", [("F32", 3e-3), ("F16", 1e-2), ("Q8_0", 6e-2)])
def test_the_projector_encodes_as_the_checkpoint_it_was_written_from(hf_folder: Path, tmp_path: Path,
                                                                     matrices: str, tolerance: float) -> None:
    folder = gguf_pair(hf_folder, tmp_path / "pair", matrices) if matrices == "F32" else None
    if folder is None:
        folder = tmp_path / "pair"
        folder.mkdir()
        from .mmproj_util import write_text_gguf

        write_text_gguf(hf_folder, folder / "tiny-gemma3.gguf")
        write_mmproj(hf_folder, folder / "mmproj.gguf", matrices)
    cpu = torch.device("cpu")
    ours, reference = (load_image_encoder(c, c.tokenizer(), cpu, torch.float32)
                       for c in (open_checkpoint(folder), open_checkpoint(hf_folder)))
    assert ours is not None and reference is not None
    pixels = torch.stack([ours.model.pixels(image_from_bytes(png(kind))) for kind in (0, 1, 2)])
    with torch.inference_mode():
        got, expected = ours.model(pixels), reference.model(pixels)
    # The input projection is F16 in every projector file (llama.cpp's converter forces it).
    assert (got - expected).abs().max().item() < tolerance * expected.abs().max().item()


def test_image_embeddings_equal_llama_cpps(engine: Engine, pair: Path) -> None:
    model, projector = _files(pair)
    pictures = [_at_size(1), _at_size(2)]
    _, expected = llama_cpp_generate(model, projector, "Describe <__media__> and <__media__>", pictures, 1)
    assert engine.images is not None
    pixels = torch.stack([engine.images.model.pixels(image_from_bytes(p)) for p in pictures])
    with torch.inference_mode():
        got = engine.images.model(pixels).numpy()
    for ours, theirs in zip(got, expected, strict=True):
        # llama.cpp's GELU and its F16 input projection against ours in float32.
        np.testing.assert_allclose(ours, theirs, atol=5e-3 * np.abs(theirs).max(), rtol=0)


def test_a_q8_0_projector_runs_on_the_int8_kernel_as_llama_cpp_runs_it(hf_folder: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized projector's matrices stay quantized where the int8 kernel has VNNI (made
    so here): on the CPU, the text model's int8 kernel (activations rounded to int8 per 32,
    as llama.cpp's Q8_0 matmul rounds them). Without VNNI they are widened at load."""
    folder = gguf_pair(hf_folder, tmp_path / "pair", "Q8_0")
    checkpoint = open_checkpoint(folder)
    monkeypatch.setattr(quantized, "runs_quantized", lambda device: False)
    widened = load_image_encoder(checkpoint, checkpoint.tokenizer(), torch.device("cpu"), torch.float32)
    assert widened is not None and not any(isinstance(m, QuantizedLinear) for m in widened.model.modules())
    monkeypatch.setattr(quantized, "runs_quantized", lambda device: True)
    encoder = load_image_encoder(checkpoint, checkpoint.tokenizer(), torch.device("cpu"), torch.float32)
    assert encoder is not None
    kept = [m for m in encoder.model.modules() if isinstance(m, QuantizedLinear)]
    assert kept and all(isinstance(m.weight, TiledWeight) for m in kept)
    assert not any(isinstance(m, torch.nn.Linear) for m in encoder.model.modules())
    pictures = [_at_size(1), _at_size(2)]
    _, expected = llama_cpp_generate(folder / "tiny-gemma3.gguf", folder / "mmproj-tiny-gemma3-q8_0.gguf",
                                     "Describe <__media__> and <__media__>", pictures, 1)
    pixels = torch.stack([encoder.model.pixels(image_from_bytes(p)) for p in pictures])
    with torch.inference_mode():
        got = encoder.model(pixels).numpy()
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=5e-3 * np.abs(theirs).max(), rtol=0)


@pytest.mark.parametrize("images", [1, 2])
def test_greedy_tokens_equal_llama_cpps(engine: Engine, pair: Path, images: int) -> None:
    model, projector = _files(pair)
    pictures = [_at_size(kind) for kind in (1, 3)[:images]]
    question = "<start_of_turn>user\nwhat is in the picture? {}{}<end_of_turn>\n<start_of_turn>model\n"
    # llama.cpp puts <start_of_image> and <end_of_image> around an image; transformers'
    # processor (and localserve) "\n\n" outside them too: written out for llama.cpp.
    theirs_text = question.format(*(["\n\n<__media__>\n\n"] * images + [""] * (2 - images)))
    ours_text = question.format(*(["<start_of_image>"] * images + [""] * (2 - images)))
    expected, _ = llama_cpp_generate(model, projector, theirs_text, pictures, 8)
    assert _greedy(engine, ours_text, pictures, 8, ignore_eos=True) == expected


def test_show_and_the_daemon_serve_the_pair(pair: Path, engine: Engine, tmp_path: Path) -> None:
    from localserve.facts.checkpoint import model_info

    from localserve.formats.weights import weight_sizes

    info, lines = model_info(pair)
    assert info["image_text"] is True
    assert "mmproj-tiny-gemma3-f32.gguf" in dict(lines)["images"]
    model, projector = _files(pair)
    assert info["file_bytes"] == model.stat().st_size + projector.stat().st_size
    # fit counts the projector's weights too (loaded dense).
    with_projector, alone = (weight_sizes(open_checkpoint(path), torch.float32) for path in (pair, model))
    vision_parameters = sum(info.n_elements for info in open_checkpoint(pair).mmproj.tensors.values())
    assert with_projector.parameters == alone.parameters + vision_parameters
    picture = png(1)
    config = ServerConfig(models={"g3": pair}, preload=["g3"], engine=small_engine_config(), device="cpu")
    with running_server(config) as server:
        client = ollama.Client(host=server.url, timeout=60)
        assert "vision" in client.show("g3").capabilities
        answer = client.generate("g3", "what is this", images=[picture],
                                 options={"temperature": 0, "num_predict": 6})
        rendered = open_checkpoint(pair).chat_template().render(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
            add_generation_prompt=True)
    assert engine.tokenizer is not None
    expected = _greedy(engine, rendered, [picture], 6)
    assert answer.response == engine.tokenizer.decode(expected)


# -- the registry: a Hub repo's pair, a local pair, --mmproj -------------------------------------------------------

GEMMA_REPO = "ggml-org/tiny-gemma3-GGUF"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pair: Path, hf_folder: Path) -> Iterator[FakeHub]:
    """A repo as ggml-org publishes Gemma 3: the model, and projectors in two types."""
    fake = FakeHub()
    model, projector = _files(pair)
    fake.add_file(GEMMA_REPO, "tiny-gemma3-F32.gguf", model.read_bytes())
    fake.add_file(GEMMA_REPO, "mmproj-tiny-gemma3-f32.gguf", projector.read_bytes())
    write_mmproj(hf_folder, tmp_path / "mmproj-f16.gguf", "F16")
    fake.add_file(GEMMA_REPO, "mmproj-tiny-gemma3-f16.gguf", (tmp_path / "mmproj-f16.gguf").read_bytes())
    fake.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    fake.stop()


def _reads_images(path: Path) -> bool:
    checkpoint = open_checkpoint(path)
    return checkpoint.reads_images and read_image_config(checkpoint) is not None


def test_a_hub_pull_takes_the_projector_of_the_models_type(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    record = pull(registry, f"hf.co/{GEMMA_REPO}:f32")
    assert {f.name: f.role for f in record.files} == {"tiny-gemma3-F32.gguf": "weights",
                                                      "mmproj-tiny-gemma3-f32.gguf": "projector"}
    path = registry.path(record.name)
    assert path.is_dir() and _reads_images(path)  # the pair's folder: what the engine opens


def test_local_pulls_of_a_pair_folder_and_of_mmproj(pair: Path, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    model, projector = _files(pair)
    from_folder = pull(registry, str(pair), name="from-folder")
    with_flag = pull(registry, str(model), name="with-flag", mmproj=str(projector))
    for record in (from_folder, with_flag):
        assert sorted(f.role for f in record.files) == ["projector", "weights"]
        assert _reads_images(registry.path(record.name))
    alone = pull(registry, str(model), name="text-only")
    assert [f.role for f in alone.files] == ["weights"] and not _reads_images(registry.path(alone.name))
    with pytest.raises(LocalserveError, match="not a vision projector"):
        pull(registry, str(model), name="wrong", mmproj=str(model))
    assert {str(r.name) for r in registry.list()} == {"from-folder:latest", "with-flag:latest", "text-only:latest"}


# -- the command line: run --mmproj, serve --mmproj ----------------------------------------------------------------


def test_localserve_run_with_mmproj(pair: Path, engine: Engine, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))  # where the pair's links go
    model, projector = _files(pair)
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(3))
    result = CliRunner().invoke(main, ["run", str(model), "what is this", "--image", str(picture), "--mmproj",
                                       str(projector), "--max-tokens", "6", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    rendered = engine.checkpoint.chat_template().render(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
        add_generation_prompt=True)
    assert engine.tokenizer is not None
    assert result.stdout == engine.tokenizer.decode(_greedy(engine, rendered, [png(3)], 6)) + "\n"
    # Without the projector the file is a text model, which cannot place the image.
    result = CliRunner().invoke(main, ["run", str(model), "what is this", "--image", str(picture), "--device", "cpu"])
    assert result.exit_code != 0 and "does not read images" in result.output


def test_serve_pairs_each_projector_with_its_model(pair: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import click

    from localserve.cli.main import served_models

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    model, projector = _files(pair)
    one = served_models([f"g3={model}"], [str(projector)])
    assert one["g3"].is_dir() and _reads_images(one["g3"])
    two = served_models([f"g3={model}", f"text={model}"], [f"g3={projector}"])
    assert _reads_images(two["g3"]) and two["text"] == model
    with pytest.raises(click.BadParameter, match="say which model"):
        served_models([f"g3={model}", f"text={model}"], [str(projector)])
    with pytest.raises(click.BadParameter, match="no --model named 'other'"):
        served_models([f"g3={model}"], [f"other={projector}"])
