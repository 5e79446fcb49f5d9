"""Embedding models: Qwen3-Embedding-shaped HF folders (a bare Qwen3Model saved the
sentence-transformers way) and GGUF files that name a pooling type, checked against
transformers' pooled hidden states and llama.cpp's embeddings; the engine's batching,
chunked prefill and prefix cache under pooling; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from localserve import LLM, LocalserveError
from localserve.engine.pooling import finish, fold_chunk
from localserve.engine.sampling_params import PoolingParams
from localserve.formats import open_checkpoint

from .conftest import STORIES_HF, reinitialise
from .gguf_writers import write_gguf


TEXTS = ["Once upon a time", "a little girl named Lily who loved to play outside in the park with her friends",
         "x", "Once upon a time there was a dog"]
# sentence-transformers' Pooling config key for each pooling
POOLING_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def sentence_transformers_files(folder: Path, pooling_config: dict, modules: list[str] | None = None) -> None:
    """modules.json and the Pooling module's config, as sentence-transformers saves them."""
    kinds = modules or ["Transformer", "Pooling", "Normalize"]
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": paths[kind], "type": f"sentence_transformers.models.{kind}"}
         for i, kind in enumerate(kinds)]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))


def qwen3_embedder(root: Path, pooling: str, seed: int = 11):
    """A tiny Qwen3-Embedding: the bare Qwen3Model's tensors (no ``model.`` prefix, no LM
    head, untied as the 4B's config says), the stories tokenizer, ``pooling``."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    model = Qwen3Model(config)
    reinitialise(model, seed)
    folder = root / f"qwen3-embedding-{pooling}"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(STORIES_HF / name, folder / name)
    sentence_transformers_files(folder, {"word_embedding_dimension": 64, POOLING_KEYS[pooling]: True})
    return folder, model.eval()


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """sentence-transformers' pooling of one unpadded input's last hidden states."""
    return {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]


def reference(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = pooled(hidden, pooling)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def embedders(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("embedders")
    return {pooling: qwen3_embedder(root, pooling) for pooling in POOLING_KEYS}


@pytest.mark.parametrize("pooling", list(POOLING_KEYS))
def test_embeddings_equal_transformers_pooled_hidden_states(embedders, pooling: str) -> None:
    folder, model = embedders[pooling]
    assert open_checkpoint(folder).spec.pooling == pooling
    # An 8-token step budget: the long input is prefilled in chunks, beside the others.
    llm = LLM(folder, kv_cache_memory=16 << 20, max_num_batched_tokens=8)
    vectors = llm.embed(TEXTS)
    for text, vector in zip(TEXTS, vectors):
        expected = reference(model, llm.tokenizer.encode(text), pooling)
        assert vector.dtype == torch.float32 and vector.shape == (64,)
        assert torch.allclose(vector, expected, atol=2e-6), (text, (vector - expected).abs().max())
        assert abs(vector.norm().item() - 1) < 1e-5
    # Token ids in, and again: the prefix cache now holds these prompts' blocks, which
    # last-token pooling may reuse and mean or CLS pooling must not (they pool every position).
    ids = llm.tokenizer.encode(TEXTS[1])
    again = llm.embed(ids)[0]
    assert torch.allclose(again, vectors[1], atol=2e-6)
    hits = llm.engine.kv.stats.prefix_cache_hits
    assert (hits > 0) == (pooling == "last")
    assert llm.engine.kv.device.num_used == 0  # no KV is kept


def test_dimensions_and_unnormalized(embedders) -> None:
    folder, model = embedders["mean"]
    llm = LLM(folder, kv_cache_memory=16 << 20)
    ids = llm.tokenizer.encode(TEXTS[0])
    raw = reference(model, ids, "mean", normalize=False)
    [unnormalized] = llm.embed(TEXTS[0], PoolingParams(normalize=False))
    assert torch.allclose(unnormalized, raw, atol=2e-6) and abs(unnormalized.norm().item() - 1) > 1e-2
    # Matryoshka: the first values, normalized again (as OpenAI's `dimensions` and Qwen3-Embedding's MRL).
    [short] = llm.embed(TEXTS[0], PoolingParams(dimensions=16))
    assert torch.allclose(short, torch.nn.functional.normalize(raw[:16], dim=0), atol=2e-6)
    with pytest.raises(LocalserveError, match="dimensions must be in"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=65))


def test_an_embedding_model_makes_no_text_and_a_text_model_no_embeddings(embedders) -> None:
    llm = LLM(embedders["last"][0], kv_cache_memory=16 << 20)
    with pytest.raises(LocalserveError, match="embedding model"):
        llm.generate("Once upon a time")
    stories = LLM(STORIES_HF, kv_cache_memory=16 << 20)
    with pytest.raises(LocalserveError, match="makes text, not embeddings"):
        stories.embed("Once upon a time")


def test_pooling_folds_chunks_and_starts_over_from_position_0() -> None:
    """Chunked prefill folds chunk by chunk; a chunk from position 0 (a request recomputed
    after preemption) starts over rather than adding to what was pooled before."""
    hidden = torch.randn(10, 8)
    for method in ("mean", "cls", "last"):
        state = None
        for start, end in ((0, 4), (4, 7), (0, 3), (3, 10)):  # preempted after 7 tokens, recomputed
            state = fold_chunk(method, state, hidden[start:end], start, end == 10)
        assert state is not None
        vector = finish(method, state, 10, PoolingParams(normalize=False))
        assert torch.allclose(vector, pooled(hidden, method), atol=1e-6), method


@pytest.mark.parametrize("config, modules, message", [
    ({"pooling_mode_max_tokens": True}, None, "this one: max"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, None, "mean, lasttoken"),
    ({"pooling_mode": "weightedmean"}, None, "this one: weightedmean"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, None, "prompt excluded"),
    ({"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling", "Dense", "Normalize"], "'Dense' is not supported"),
])
def test_pipelines_we_cannot_reproduce_are_refused(embedders, tmp_path: Path, config, modules, message: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(embedders["last"][0], folder)
    sentence_transformers_files(folder, config, modules)
    with pytest.raises(LocalserveError, match=message):
        open_checkpoint(folder)


def test_a_pooling_path_outside_the_folder_is_refused(embedders, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(embedders["last"][0], folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["path"] = "../../elsewhere"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LocalserveError, match="leaves the model folder"):
        open_checkpoint(folder)


# -- GGUF -------------------------------------------------------------------------------------

def gguf_qwen3(seed: int = 13):
    """A Qwen3 decoder at widths every GGUF type holds, tied (no output.weight), as
    tests/gguf_writers.py initialises its models."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config)
    reinitialise(model, seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(256**0.5)
    return model.eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_gguf_embeddings_equal_llama_cpp_and_transformers(tmp_path: Path, pooling: str) -> None:
    import gguf
    import llama_cpp

    model = gguf_qwen3()
    path = tmp_path / f"qwen3-embedding-{pooling}.gguf"
    kind = {"last": gguf.PoolingType.LAST, "mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}[pooling]
    # Qwen3-Embedding's GGUF files append EOS to every input: its hidden state is the one pooled.
    write_gguf(path, model, gguf.GGMLQuantizationType.F32, pooling=kind, add_eos=True)
    assert open_checkpoint(path).spec.pooling == pooling
    llm = LLM(path, kv_cache_memory=16 << 20, max_num_batched_tokens=8)
    ours = llm.embed(TEXTS, PoolingParams(normalize=False))
    oracle = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=256, n_batch=256, n_ubatch=256,
                             verbose=False, n_threads=2)
    for text, vector in zip(TEXTS, ours):
        ids = llm.tokenizer.encode(text)
        assert ids[-1] == 2 and ids == oracle.tokenize(text.encode(), add_bos=True, special=False)
        theirs = torch.tensor(oracle.embed(text, normalize=False))
        assert ((vector - theirs).norm() / theirs.norm()).item() < 2e-3, text
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        expected = pooled(hidden, pooling)
        assert ((vector - expected).norm() / expected.norm()).item() < 1e-5, text
    oracle.close()


def test_gguf_pooling_types_we_do_not_serve_are_refused(tmp_path: Path) -> None:
    import gguf

    model = gguf_qwen3()
    path = tmp_path / "reranker.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.F32, pooling=gguf.PoolingType.RANK)
    with pytest.raises(LocalserveError, match="reranker"):
        open_checkpoint(path)


def test_gguf_bidirectional_attention_is_refused(tmp_path: Path) -> None:
    import gguf

    from localserve.formats.gguf_file import read_gguf
    from localserve.formats.gguf import spec_from_gguf

    path = tmp_path / "bidirectional.gguf"
    write_gguf(path, gguf_qwen3(), gguf.GGMLQuantizationType.F32, pooling=gguf.PoolingType.MEAN)
    opened = read_gguf(path)
    opened.metadata["qwen3.attention.causal"] = False
    with pytest.raises(LocalserveError, match="bidirectional attention"):
        spec_from_gguf(opened)


def test_show_names_an_embedding_model(embedders) -> None:
    from localserve.facts.checkpoint import model_info

    info, lines = model_info(open_checkpoint(embedders["last"][0]))
    assert info["pooling"] == "last"
    assert any(label == "embeddings" and "last token" in text for label, text in lines)


def test_base64_is_little_endian_float32() -> None:
    from localserve.server.embeddings import as_base64

    vector = torch.tensor([1.0, -2.5, 3.25e-3])
    import base64

    assert np.array_equal(np.frombuffer(base64.b64decode(as_base64(vector)), dtype="<f4"), vector.numpy())


# -- the daemon: OpenAI's /v1/embeddings, Ollama's /api/embed and /api/embeddings -------------

@pytest.fixture(scope="module", params=[False, True], ids=["engine thread", "engine process"])
def server(request, embedders, tmp_path_factory: pytest.TempPathFactory):
    from localserve.server.config import ServerConfig

    from .server_util import running_server, small_engine_config

    root = tmp_path_factory.mktemp("embedding-server")
    config = ServerConfig(models={"embedder": embedders["last"][0], "stories": STORIES_HF},
                          registry_home=root / "registry", engine=small_engine_config(max_num_seqs=8), device="cpu",
                          engine_processes=request.param)
    with running_server(config) as running:
        yield running


def test_openai_sdk_embeddings(server, embedders) -> None:
    import openai

    folder, model = embedders["last"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    from localserve.formats import read_tokenizer

    tokenizer = read_tokenizer(folder)
    expected = [reference(model, tokenizer.encode(text), "last") for text in TEXTS]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    answer = client.embeddings.create(model="embedder", input=TEXTS)
    assert [d.index for d in answer.data] == list(range(len(TEXTS))) and answer.model == "embedder"
    for data, vector in zip(answer.data, expected):
        assert np.allclose(data.embedding, vector.numpy(), atol=2e-6)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    floats = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, expected[0].numpy(), atol=2e-6)
    short = client.embeddings.create(model="embedder", input=[tokenizer.encode(TEXTS[1])], dimensions=8)
    assert len(short.data[0].embedding) == 8
    with pytest.raises(openai.BadRequestError, match="makes text, not embeddings"):
        client.embeddings.create(model="stories", input="hello")
    with pytest.raises(openai.BadRequestError, match="dimensions must be in"):
        client.embeddings.create(model="embedder", input="hello", dimensions=1000)
    with pytest.raises(openai.BadRequestError, match="more than embedder's context"):
        client.embeddings.create(model="embedder", input=[[5] * 5000])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "hi"}])


def test_many_inputs_in_one_request(server, embedders) -> None:
    """More inputs than the engine queues at once (8 sequences + 256 queued): fed in a window."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    inputs = [[3 + i % 500, 7, 9 + i % 300] for i in range(600)]
    answer = client.embeddings.create(model="embedder", input=inputs, encoding_format="float")
    assert len(answer.data) == 600 and answer.usage.prompt_tokens == 1800
    _, model = embedders["last"]
    for index in (0, 299, 599):
        assert np.allclose(answer.data[index].embedding, reference(model, inputs[index], "last").numpy(), atol=2e-6)


def test_ollama_client_embed(server, embedders) -> None:
    import ollama

    from localserve.formats import read_tokenizer

    folder, model = embedders["last"]
    tokenizer = read_tokenizer(folder)
    client = ollama.Client(host=server.url, timeout=60)
    answer = client.embed(model="embedder", input=TEXTS)
    assert answer.model == "embedder" and len(answer.embeddings) == len(TEXTS)
    assert answer.prompt_eval_count == sum(len(tokenizer.encode(t)) for t in TEXTS) and answer.total_duration > 0
    for vector, text in zip(answer.embeddings, TEXTS):
        assert np.allclose(vector, reference(model, tokenizer.encode(text), "last").numpy(), atol=2e-6)
    assert len(client.embed(model="embedder", input=TEXTS[0], dimensions=16).embeddings[0]) == 16
    # The older route: one prompt, its vector as pooled (Ollama does not normalize it).
    legacy = client.embeddings(model="embedder", prompt=TEXTS[1])
    raw = reference(model, tokenizer.encode(TEXTS[1]), "last", normalize=False)
    assert np.allclose(legacy.embedding, raw.numpy(), atol=1e-5)
    # Truncation (Ollama's default): an input past the 1,024-token context keeps its start.
    long_text = " ".join(["Once upon a time"] * 400)
    ids = tokenizer.encode(long_text)
    assert len(ids) > 1024
    [truncated] = client.embed(model="embedder", input=long_text).embeddings
    assert np.allclose(truncated, reference(model, ids[:1024], "last").numpy(), atol=1e-5)
    with pytest.raises(ollama.ResponseError, match="more than embedder's context") as refused:
        client.embed(model="embedder", input=long_text, truncate=False)
    assert refused.value.status_code == 400
    assert client.show("embedder").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError, match="embedding model"):
        client.chat(model="embedder", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ollama.ResponseError, match="makes text, not embeddings"):
        client.embed(model="stories", input="hi")


def test_the_pooling_key_sentence_transformers_6_writes_is_read(embedders, tmp_path: Path) -> None:
    """sentence-transformers 6 saves ``"pooling_mode": "lasttoken"`` instead of the flags."""
    folder = tmp_path / "model"
    shutil.copytree(embedders["last"][0], folder)
    sentence_transformers_files(folder, {"pooling_mode": "lasttoken"})
    assert open_checkpoint(folder).spec.pooling == "last"
