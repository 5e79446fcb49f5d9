"""Images over HTTP, end to end, on a tiny random Gemma 3 image-text checkpoint
(tests/vision_util.py): a text prompt's layout and greedy tokens against transformers'
Gemma3Processor and Gemma3ForConditionalGeneration; then OpenAI's image_url parts, Ollama's
``images`` (chat and generate) and Anthropic's image blocks through their official clients,
each answer against the in-process Engine given the chat template's rendering of the same
conversation (an image part where each image goes) and the same images; refusals (a model
without a vision tower, an image URL, a corrupt image); and /api/show's "vision" capability.
The server runs with its engines on a thread and in engine processes."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import torch
from PIL import Image

from localserve import Engine, EngineConfig, SamplingParams
from localserve.errors import LocalserveError
from localserve.server.config import ServerConfig
from localserve.text.chat_template import ChatTemplate
from localserve.vision.image_input import image_from_bytes

from .server_util import RunningServer, running_server, small_engine_config, stories_with_template
from .vision_util import (BOI, EOI, GEMMA3_TEMPLATE, IMAGE_SIZE, IMAGE_TOKEN, TOKENS_PER_IMAGE, data_url, png,
                          tiny_gemma3_vision)

QUESTION = "What is in this picture?"
TIMEOUT = 60  # seconds any one client call may take


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3_vision(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def engine(folder: Path) -> Engine:
    """The oracle for the HTTP tests: the same checkpoint in this process, given text."""
    return Engine(folder, EngineConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=128, block_size=4),
                  device="cpu")


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-processes"])
def server(request: pytest.FixtureRequest, folder: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    stories = stories_with_template(tmp_path_factory.mktemp("stories"))
    config = ServerConfig(models={"g3": folder, "stories": stories}, preload=["g3"], engine=small_engine_config(),
                          device="cpu", engine_processes=request.param)
    with running_server(config) as running:
        yield running


@pytest.fixture
def gpt(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT,
                         _strict_response_validation=True)


def _run(engine: Engine, prompt: str | list[int], pictures: list[bytes], **params: Any) -> list[int]:
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, **params),
                                    images=[image_from_bytes(p) for p in pictures])
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                tokens = output.token_ids
    assert tokens is not None
    return tokens


_EXPECTED: dict[str, str] = {}


def expected(engine: Engine, content: list[dict[str, Any]], pictures: list[bytes], max_tokens: int = 6) -> str:
    """What the in-process engine answers to one user turn with these content parts
    ({"type": "image"} where each picture goes), rendered by the chat template itself."""
    key = json.dumps([content, [base64.b64encode(p).decode() for p in pictures], max_tokens])
    if key not in _EXPECTED:
        template = ChatTemplate(GEMMA3_TEMPLATE.read_text(encoding="utf-8"), bos_token="<bos>", eos_token="<eos>")
        text = template.render([{"role": "user", "content": content}], add_generation_prompt=True)
        assert text.count("<start_of_image>") == len(pictures)
        assert engine.tokenizer is not None
        _EXPECTED[key] = engine.tokenizer.decode(_run(engine, text, pictures, max_tokens=max_tokens))
    return _EXPECTED[key]


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


IMAGE = {"type": "image"}


# -- the layout of a text prompt, and the model, against transformers ---------------------------------------------


def test_a_text_prompts_layout_and_greedy_tokens_match_transformers(folder: Path, engine: Engine) -> None:
    """Gemma3Processor's documented expansion of each <start_of_image> (restated here, and
    transformers' own processor), tokenized by the checkpoint's tokenizer, is the prompt the
    engine lays out; its greedy tokens are Gemma3ForConditionalGeneration's on those ids with
    the PIL image processor's pixels. The same text without markers or images too."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", extra_special_tokens={
                                            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                            "image_token": "<image_soft_token>"})
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.eval()

    text = "<bos><start_of_turn>user\nCompare<start_of_image>with<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    expansion = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"
    restated = tokenizer(text.replace("<start_of_image>", expansion), add_special_tokens=False)["input_ids"]
    assert restated.count(IMAGE_TOKEN) == 2 * TOKENS_PER_IMAGE and restated.count(BOI) == restated.count(EOI) == 2
    answers = []
    for pictures in ([png(0), png(1)], [png(1), png(0)]):
        processed = processor(text=text, images=[Image.open(io.BytesIO(p)) for p in pictures], return_tensors="pt")
        ids = processed["input_ids"]
        assert ids[0].tolist() == restated

        request_id = engine.add_request(text, SamplingParams(max_tokens=1),
                                        images=[image_from_bytes(p) for p in pictures])
        assert engine.requests[request_id].prompt_token_ids == restated
        engine.abort(request_id)

        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, pixel_values=processed["pixel_values"],
                                 token_type_ids=(ids == IMAGE_TOKEN).long())
        theirs = out[0, ids.shape[1]:].tolist()
        assert _run(engine, text, pictures, max_tokens=6, ignore_eos=True) == theirs
        answers.append(theirs)

    plain = text.replace("<start_of_image>", "")
    plain_ids = tokenizer(plain, add_special_tokens=False)["input_ids"]
    request_id = engine.add_request(plain, SamplingParams(max_tokens=1))
    assert engine.requests[request_id].prompt_token_ids == plain_ids
    engine.abort(request_id)
    plain_tensor = torch.tensor([plain_ids])
    with torch.no_grad():
        out = model.generate(input_ids=plain_tensor, attention_mask=torch.ones_like(plain_tensor), max_new_tokens=6,
                             do_sample=False)
    answers.append(out[0, len(plain_ids):].tolist())
    assert _run(engine, plain, [], max_tokens=6, ignore_eos=True) == answers[-1]
    assert len({tuple(a) for a in answers}) == 3, answers  # the images, and their order, changed the answer


# -- OpenAI ----------------------------------------------------------------------------------------------------------


def _openai_parts(content: list[dict[str, Any]], pictures: list[bytes]) -> list[dict[str, Any]]:
    """The template's parts as OpenAI's: each {"type": "image"} an image_url part with the next picture."""
    left = iter(pictures)
    return [{"type": "image_url", "image_url": {"url": data_url(next(left))}} if part == IMAGE else part
            for part in content]


# (content, picture kind): the answers of these differ from one another (checked below).
OPENAI_CASES = [
    ([text_part(QUESTION), IMAGE], 0),
    ([text_part(QUESTION), IMAGE], 2),
    ([IMAGE, text_part(QUESTION)], 0),
]


def test_openai_chat_places_each_image_where_its_part_is(gpt: openai.OpenAI, engine: Engine) -> None:
    answers = []
    for content, kind in OPENAI_CASES:
        want = expected(engine, content, [png(kind)])
        reply = gpt.chat.completions.create(model="g3", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": _openai_parts(content, [png(kind)])}])  # type: ignore[misc, list-item]
        assert reply.choices[0].message.content == want, (content, kind)
        answers.append(want)
    assert len(set(answers)) == len(answers), answers  # each image, and each place, changed the answer


def test_openai_chat_streams_the_same_answer(gpt: openai.OpenAI, engine: Engine) -> None:
    content, kind = OPENAI_CASES[1]
    stream = gpt.chat.completions.create(model="g3", max_tokens=6, temperature=0, stream=True, messages=[
        {"role": "user", "content": _openai_parts(content, [png(kind)])}])  # type: ignore[misc, list-item]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected(engine, content, [png(kind)])


def test_openai_chat_refusals(gpt: openai.OpenAI) -> None:
    def ask(model: str, url: str) -> None:
        gpt.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[{"role": "user", "content": [
            text_part(QUESTION), {"type": "image_url", "image_url": {"url": url}}]}])  # type: ignore[misc, list-item]

    with pytest.raises(openai.BadRequestError, match="does not read images"):
        ask("stories", data_url(png(0)))
    with pytest.raises(openai.BadRequestError, match="data: URL") as refused:
        ask("g3", "http://127.0.0.1:9/cat.png")
    assert refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="truncated|corrupt") as refused:
        ask("g3", data_url(png(1)[:60]))  # a truncated PNG
    assert refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="not an image"):
        ask("g3", "data:image/png;base64," + base64.b64encode(b"not a picture at all").decode())


# -- Ollama ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def llama(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=TIMEOUT)


def test_ollama_chat_and_generate_lay_out_a_messages_images_before_its_text(llama: ollama.Client,
                                                                           engine: Engine) -> None:
    options = {"temperature": 0, "num_predict": 6}
    answers = []
    for kind in (0, 1):
        want = expected(engine, [IMAGE, text_part(QUESTION)], [png(kind)])
        chat = llama.chat(model="g3", options=options, messages=[
            {"role": "user", "content": QUESTION, "images": [png(kind)]}])
        assert chat.message.content == want, kind
        generated = llama.generate(model="g3", prompt=QUESTION, images=[png(kind)], raw=False, options=options)
        assert generated.response == want, kind
        answers.append(want)
    assert answers[0] != answers[1]
    streamed = llama.chat(model="g3", options=options, stream=True, messages=[
        {"role": "user", "content": QUESTION, "images": [base64.b64encode(png(1)).decode()]}])
    assert "".join(part.message.content or "" for part in streamed) == answers[1]


def test_ollama_images_for_a_text_model_are_refused(llama: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        llama.generate(model="stories", prompt=QUESTION, images=[png(0)], raw=False, options={"num_predict": 2})
    assert refused.value.status_code == 400 and "does not read images" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        llama.chat(model="stories", messages=[{"role": "user", "content": QUESTION, "images": [png(0)]}],
                   options={"num_predict": 2})
    assert refused.value.status_code == 400 and "does not read images" in refused.value.error


def test_ollama_show_lists_vision_for_the_image_text_model_only(llama: ollama.Client) -> None:
    assert "vision" in (llama.show("g3").capabilities or [])
    stories = llama.show("stories").capabilities or []
    assert "completion" in stories and "vision" not in stories


# -- Anthropic ---------------------------------------------------------------------------------------------------------


def test_anthropic_messages_take_image_blocks_in_order(server: RunningServer, engine: Engine) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)

    def block(kind: int) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png(kind)).decode()}}

    cases = [([block(0), text_part(QUESTION)], [IMAGE, text_part(QUESTION)], 0),
             ([text_part(QUESTION), block(2)], [text_part(QUESTION), IMAGE], 2),
             ([block(4), text_part(QUESTION)], [IMAGE, text_part(QUESTION)], 4)]
    answers = []
    for blocks, content, kind in cases:
        want = expected(engine, content, [png(kind)])
        reply = claude.messages.create(model="g3", max_tokens=6, extra_body={"temperature": 0},  # not an SDK argument
                                       messages=[{"role": "user", "content": blocks}])  # type: ignore[typeddict-item]
        assert "".join(b.text for b in reply.content if b.type == "text") == want, kind
        answers.append(want)
    assert len(set(answers)) == len(answers), answers
    with pytest.raises(anthropic.BadRequestError, match="does not read images"):
        claude.messages.create(model="stories", max_tokens=2, messages=[
            {"role": "user", "content": [block(0), text_part(QUESTION)]}])  # type: ignore[typeddict-item]


def test_the_server_still_answers_text_only_chats(gpt: openai.OpenAI, server: RunningServer, engine: Engine) -> None:
    """A text-only chat to the image-text model: the same answer as the engine's, and /api/show is JSON."""
    reply = gpt.chat.completions.create(model="g3", max_tokens=6, temperature=0,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content == expected(engine, [text_part(QUESTION)], [])
    shown = httpx.post(f"{server.url}/api/show", json={"model": "g3"}, timeout=TIMEOUT)
    assert shown.status_code == 200 and "vision" in shown.json()["capabilities"]


# -- localserve run ---------------------------------------------------------------------------------------------------

def test_localserve_run_sends_images_with_the_prompt(folder: Path, engine: Engine, tmp_path: Path) -> None:
    """`localserve run MODEL PROMPT --image FILE` (in-process: no daemon serves the folder)
    answers as the engine does for the template's rendering with the image before the text."""
    from click.testing import CliRunner

    from localserve.cli.main import main

    pictures = []
    for kind in (0, 2):
        pictures.append(tmp_path / f"picture{kind}.png")
        pictures[-1].write_bytes(png(kind))
    for picture, kind in zip(pictures, (0, 2)):
        result = CliRunner().invoke(main, ["run", str(folder), QUESTION, "--image", str(picture), "--max-tokens", "6",
                                           "--device", "cpu"])
        assert result.exit_code == 0, result.output
        assert result.stdout == expected(engine, [IMAGE, text_part(QUESTION)], [png(kind)]) + "\n"
    assert expected(engine, [IMAGE, text_part(QUESTION)], [png(0)]) != \
        expected(engine, [IMAGE, text_part(QUESTION)], [png(2)])


def test_localserve_run_refuses_images_a_model_cannot_take(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    from .conftest import STORIES_HF

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(0))
    result = CliRunner().invoke(main, ["run", str(STORIES_HF), "hi", "--image", str(picture), "--device", "cpu"])
    assert result.exit_code != 0 and "no chat template to place images in" in result.output
    (tmp_path / "broken.png").write_bytes(png(0)[:100])  # the header whole, the pixels cut
    result = CliRunner().invoke(main, ["run", str(STORIES_HF), "hi", "--image", str(tmp_path / "broken.png")])
    assert result.exit_code != 0 and "truncated or corrupt" in result.output and "Traceback" not in result.output


def test_the_python_api_chats_with_images(folder: Path, engine: Engine) -> None:
    """LLM.chat takes OpenAI's image_url parts and Ollama's images as the HTTP API does."""
    from localserve import LLM

    llm = LLM(folder, device="cpu", max_num_seqs=4, max_model_len=256, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    parts = [{"role": "user", "content": [text_part(QUESTION), {"type": "image_url", "image_url": {"url": data_url(png(2))}}]}]
    ollama_style = [{"role": "user", "content": QUESTION, "images": [base64.b64encode(png(0)).decode()]}]
    first, second = llm.chat([parts, ollama_style], greedy)
    assert first.text == expected(engine, [text_part(QUESTION), IMAGE], [png(2)])
    assert second.text == expected(engine, [IMAGE, text_part(QUESTION)], [png(0)])
    with pytest.raises(LocalserveError, match="over the limit of 16 images"):
        llm.chat([{"role": "user", "content": QUESTION, "images": [base64.b64encode(png(0)).decode()] * 17}], greedy)


def test_tokenize_counts_an_images_tokens(server: RunningServer, engine: Engine) -> None:
    """vLLM's /tokenize of a chat with an image: the ids the chat request runs on, the
    image's tokens among them (the engine's layout of the template's rendering)."""
    content = [text_part(QUESTION), IMAGE]
    messages = [{"role": "user", "content": _openai_parts(content, [png(1)])}]
    answer = httpx.post(f"{server.url}/tokenize", json={"model": "g3", "messages": messages}, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    template = ChatTemplate(GEMMA3_TEMPLATE.read_text(encoding="utf-8"), bos_token="<bos>", eos_token="<eos>")
    text = template.render([{"role": "user", "content": content}], add_generation_prompt=True)
    request_id = engine.add_request(text, SamplingParams(max_tokens=1), images=[image_from_bytes(png(1))])
    expected_ids = engine.requests[request_id].prompt_token_ids
    engine.abort(request_id)
    assert answer.json()["tokens"] == expected_ids and expected_ids.count(IMAGE_TOKEN) == TOKENS_PER_IMAGE
