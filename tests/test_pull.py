"""Pulls from a fake Hub and from URLs on loopback (no network): file choice, naming,
resume, verification, hostile listings, tokens, offline mode; the pulled models generate."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from localserve import LLM, SamplingParams
from localserve.errors import LocalserveError
from localserve.registry import Registry, open_registry
from localserve.registry.blobs import file_digest
from localserve.registry.download import DownloadError, RemoteFile, download
from localserve.registry.pull import pull

from .conftest import DATA
from .fake_hub import FakeHub
from .gguf_writers import split_gguf, tiny_llama, write_gguf

STORIES_GGUF = DATA / "models" / "stories260K.gguf"
SHARED_GPTQ = DATA / "models" / "tiny-gptq-4bit-g32-actorder"
GGUF_REPO = "acme/Stories-260K-GGUF"
GPTQ_REPO = "acme/tiny-llama-GPTQ"
STORY = ", there was a little girl"


def empty_registry(home: Path) -> Registry:
    """A new registry without its built-in demo model: what a pull adds is all it holds."""
    registry = open_registry(home)
    registry.remove("demo")
    return registry


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A GGUF repo: F32, Q8_0 and IQ4_NL files (the last by llama.cpp's quantizer), a Q4_K_M
    split in two in a subfolder (the real stories model, split), and a vision projector that
    is never the model."""
    import gguf

    from .test_gguf_models import llama_cpp_quantize

    folder = tmp_path_factory.mktemp("gguf-repo")
    parts = split_gguf(STORIES_GGUF, folder / "stories-260K-Q4_K_M.gguf", 2)
    tiny = tiny_llama(hidden=64, ffn=128, layers=1)
    write_gguf(folder / "q8.gguf", tiny, gguf.GGMLQuantizationType.Q8_0)
    write_gguf(folder / "f32.gguf", tiny, gguf.GGMLQuantizationType.F32)
    llama_cpp_quantize(folder / "f32.gguf", folder / "iq4_nl.gguf", "IQ4_NL")
    return {
        "stories-260K-F32.gguf": STORIES_GGUF.read_bytes(),
        "stories-260K-Q8_0.gguf": (folder / "q8.gguf").read_bytes(),
        "stories-260K-IQ4_NL.gguf": (folder / "iq4_nl.gguf").read_bytes(),
        **{f"Q4_K_M/{part.name}": part.read_bytes() for part in parts},
        "README.md": b"---\nlicense: mit\n---\n# Stories\n",
    }


@pytest.fixture(scope="module")
def gptq_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The shared GPTQ checkpoint with its safetensors split in two shards and an index,
    plus pickled weights and an ONNX folder that a pull must leave alone."""
    folder = tmp_path_factory.mktemp("gptq-repo")
    tensors = load_file(SHARED_GPTQ / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    files: dict[str, bytes] = {}
    for shard, members in shards.items():
        save_file({name: tensors[name] for name in members}, folder / shard, metadata={"format": "pt"})
        files[shard] = (folder / shard).read_bytes()
    index = {"metadata": {}, "weight_map": {name: shard for shard, members in shards.items() for name in members}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    for name in ("config.json", "quantize_config.json", "tokenizer.json", "tokenizer_config.json"):
        files[name] = (SHARED_GPTQ / name).read_bytes()
    files["generation_config.json"] = json.dumps({"bos_token_id": 1, "eos_token_id": 2}).encode()
    files["LICENSE"] = b"MIT License\n"
    files["pytorch_model.bin"] = b"pickled: never fetched"
    files["onnx/model.onnx"] = b"not ours"
    return files


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gguf_files: dict[str, bytes],
        gptq_files: dict[str, bytes]) -> FakeHub:
    fake = FakeHub()
    for path, data in gguf_files.items():
        fake.add_file(GGUF_REPO, path, data)
    fake.set_card_data(GGUF_REPO, {"license": "mit"})
    for path, data in gptq_files.items():
        fake.add_file(GPTQ_REPO, path, data)
    fake.set_card_data(GPTQ_REPO, {"license": "apache-2.0"})
    fake.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    fake.stop()


def fetched(hub: FakeHub) -> set[str]:
    return {r.path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests
            if r.method == "GET" and "/resolve/" in r.path}


def greedy(path: Path, prompt: str | list[int], tokens: int = 8) -> SamplingParams:
    return LLM(path, device="cpu", num_kv_blocks=64).generate(prompt, SamplingParams(temperature=0,
                                                                                     max_tokens=tokens))[0]


def test_default_tag_is_q4_k_m_with_every_split_part(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    record = pull(registry, f"hf.co/{GGUF_REPO}")
    assert str(record.name) == "stories-260k:q4_k_m"
    assert [f.name for f in record.files] == ["stories-260K-Q4_K_M-00001-of-00002.gguf",
                                              "stories-260K-Q4_K_M-00002-of-00002.gguf"]
    assert fetched(hub) == {f"Q4_K_M/{f.name}" for f in record.files}  # nothing else was downloaded
    assert record.license == "mit" and record.source.startswith(f"hf.co/{GGUF_REPO}@")
    assert greedy(registry.path(record.name), "Once upon a time").text.startswith(STORY)


@pytest.mark.parametrize("tag, name, file", [
    ("q8_0", "stories-260k:q8_0", "stories-260K-Q8_0.gguf"),
    ("iq4_nl", "stories-260k:iq4_nl", "stories-260K-IQ4_NL.gguf"),
    ("F32", "stories-260k:f32", "stories-260K-F32.gguf"),
    ("stories-260K-F32.gguf", "stories-260k:f32", "stories-260K-F32.gguf"),
])
def test_tag_picks_quantization_or_file(hub: FakeHub, tmp_path: Path, tag: str, name: str, file: str) -> None:
    registry = empty_registry(tmp_path / "home")
    record = pull(registry, f"hf.co/{GGUF_REPO}:{tag}")
    assert str(record.name) == name and [f.name for f in record.files] == [file] and fetched(hub) == {file}
    assert file.removesuffix(".gguf").rsplit("-", 1)[1] in record.quantization
    output = greedy(registry.path(name), [1, 5, 9], 4)
    assert len(output.token_ids) == 4


def test_unknown_tag_lists_the_files_and_registers_nothing(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    with pytest.raises(LocalserveError, match="Q5_K_S.*matches no file.*stories-260K-Q8_0.gguf"):
        pull(registry, f"hf.co/{GGUF_REPO}:Q5_K_S")
    assert registry.list() == [] and fetched(hub) == set()


def test_gptq_repo_fetches_config_shards_and_tokenizer(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    record = pull(registry, f"hf.co/{GPTQ_REPO}")
    assert str(record.name) == "tiny-llama-gptq:latest" and record.format == "gptq"
    assert {f.name: f.role for f in record.files} == {
        "config.json": "config", "generation_config.json": "config", "quantize_config.json": "config",
        "model-00001-of-00002.safetensors": "weights", "model-00002-of-00002.safetensors": "weights",
        "model.safetensors.index.json": "weights", "tokenizer.json": "tokenizer",
        "tokenizer_config.json": "tokenizer", "LICENSE": "license"}
    assert fetched(hub) == {f.name for f in record.files}  # no pickles, no ONNX
    assert record.license == "apache-2.0"
    expected = json.loads((SHARED_GPTQ / "expected.json").read_text())
    llm = LLM(registry.path(record.name), device="cpu", num_kv_blocks=64)
    outputs = llm.generate(expected["prompts"], SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    assert [o.token_ids for o in outputs] == expected["greedy_16"]


def test_an_interrupted_download_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path,
                                                          gguf_files: dict[str, bytes]) -> None:
    registry = empty_registry(tmp_path / "home")
    file = "stories-260K-F32.gguf"
    size = len(gguf_files[file])
    url = f"{hub.endpoint}/{GGUF_REPO}/resolve/main/{file}"
    hub.interrupt_after(file, 300_000)
    with pytest.raises(DownloadError, match="300000 bytes are kept"):
        # A pull that gave up; what it had is kept under the file's digest.
        download(registry.blobs, RemoteFile(url, file, size, file_digest(STORIES_GGUF)), retries=0)
    assert registry.list() == []
    hub.interrupt_after(file, 500_000)  # and the next one is cut too, then resumed at once
    record = pull(registry, f"hf.co/{GGUF_REPO}:f32")
    assert hub.downloaded_bytes(file) == size  # every byte came exactly once
    ranges = [r.headers.get("range") for r in hub.requests if r.method == "GET" and r.path.endswith(file)]
    assert ranges == [None, "bytes=300000-", "bytes=800000-"]
    assert record.files[0].digest == file_digest(STORIES_GGUF)
    assert [p.name for p in registry.blobs.root.iterdir()] == [record.files[0].digest]  # no partial left


def test_a_corrupt_download_is_not_registered(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    hub.corrupt(GGUF_REPO, "stories-260K-F32.gguf")
    with pytest.raises(LocalserveError, match="does not match"):
        pull(registry, f"hf.co/{GGUF_REPO}:f32")
    assert registry.list() == [] and list(registry.blobs.root.iterdir()) == []
    hub.corrupt(GPTQ_REPO, "config.json")  # not in LFS: checked against its git blob id
    with pytest.raises(LocalserveError, match="blob id"):
        pull(registry, f"hf.co/{GPTQ_REPO}")
    assert registry.list() == []


@pytest.mark.parametrize("source", [
    "hf.co/acme/../etc", "hf.co/acme/repo/extra", "hf.co/acme/repo:../../x", "hf.co/acme/repo:/etc/passwd",
])
def test_hostile_sources_are_refused(hub: FakeHub, tmp_path: Path, source: str) -> None:
    registry = empty_registry(tmp_path / "home")
    with pytest.raises(LocalserveError):
        pull(registry, source)
    assert hub.requests == []


@pytest.mark.parametrize("path", ["../escape.gguf", "a/../../escape.gguf", "a\\..\\..\\escape.gguf"])
def test_hostile_file_names_in_a_listing_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     path: str) -> None:
    with FakeHub() as hub:
        hub.add_file("evil/repo-GGUF", path, STORIES_GGUF.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        registry = empty_registry(tmp_path / "home")
        with pytest.raises(LocalserveError, match="unacceptable path"):
            pull(registry, "hf.co/evil/repo-GGUF")
        assert not any("/resolve/" in r.path for r in hub.requests)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
    assert registry.list() == [] and list(registry.blobs.root.iterdir()) == []


def test_a_malformed_digest_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    hub._repo(GGUF_REPO).files["stories-260K-F32.gguf"].sha256 = "../../" + "a" * 58
    registry = empty_registry(tmp_path / "home")
    with pytest.raises(LocalserveError, match="malformed sha256"):
        pull(registry, f"hf.co/{GGUF_REPO}:f32")
    assert fetched(hub) == set()


def test_a_bad_name_is_refused_before_anything_is_fetched(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    with pytest.raises(LocalserveError, match="not a valid model name"):
        pull(registry, f"hf.co/{GGUF_REPO}:f32", name="../../x")
    assert fetched(hub) == set()


def test_a_private_repo_needs_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub(token="secret") as hub:
        hub.add_file("acme/private-GGUF", "m-F32.gguf", STORIES_GGUF.read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        registry = empty_registry(tmp_path / "home")
        with pytest.raises(LocalserveError, match="HF_TOKEN"):
            pull(registry, "hf.co/acme/private-GGUF:f32")
        monkeypatch.setenv("HF_TOKEN", "secret")
        assert str(pull(registry, "hf.co/acme/private-GGUF:f32").name) == "private:f32"


def test_offline_mode_imports_from_the_hugging_face_cache(hub: FakeHub, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, snapshot_download

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    snapshot_download(GGUF_REPO, cache_dir=cache, endpoint=hub.endpoint, allow_patterns=["*F32.gguf"])
    hub.stop()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    registry = empty_registry(tmp_path / "home")
    record = pull(registry, f"hf.co/{GGUF_REPO}:f32")
    assert str(record.name) == "stories-260k:f32" and record.files[0].digest == file_digest(STORIES_GGUF)
    with pytest.raises(LocalserveError, match="Q4_K_M.*matches no file"):
        pull(registry, f"hf.co/{GGUF_REPO}")  # not in the cache, and no Hub to ask
    with pytest.raises(LocalserveError, match="not in the Hugging Face cache"):
        pull(registry, f"hf.co/{GPTQ_REPO}")


def test_url_pull_verifies_and_resumes(hub: FakeHub, tmp_path: Path) -> None:
    registry = empty_registry(tmp_path / "home")
    url = hub.serve_file("models/Stories-F32.gguf", STORIES_GGUF.read_bytes())
    digest = file_digest(STORIES_GGUF)
    with pytest.raises(LocalserveError, match="does not match"):
        pull(registry, url, sha256="0" * 64)
    assert registry.list() == []
    hub.interrupt_after("Stories-F32.gguf", 100_000)
    record = pull(registry, url, sha256=digest.removeprefix("sha256-"))
    assert str(record.name) == "stories-f32:latest" and record.files[0].digest == digest
    assert record.source == url
    assert greedy(registry.path(record.name), "Once upon a time").text.startswith(STORY)
    with pytest.raises(LocalserveError, match="one .gguf file"):
        pull(registry, hub.serve_file("x/config.json", b"{}"))
    with pytest.raises(LocalserveError, match="HTTP 404"):
        pull(registry, f"{hub.endpoint}/files/missing.gguf")


def test_nothing_is_written_outside_the_home(hub: FakeHub, tmp_path: Path) -> None:
    home = tmp_path / "home"
    registry = empty_registry(home)
    pull(registry, f"hf.co/{GGUF_REPO}:f32")
    written = {p.relative_to(home).parts[0] for p in home.rglob("*")}
    assert written <= {"blobs", "models", "registry.db", "registry.db-wal", "registry.db-shm"}
    assert sorted(os.listdir(tmp_path)) == ["home"]


def test_cli_pull_shows_progress_and_prints_json(hub: FakeHub, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    runner = CliRunner(env={"LOCALSERVE_HOME": str(tmp_path / "home")})
    result = runner.invoke(main, ["pull", f"hf.co/{GGUF_REPO}:f32", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["name"] == "stories-260k:f32" and record["license"] == "mit"
    assert "stories-260K-F32.gguf" in result.stderr  # the progress bar's line
    listing = runner.invoke(main, ["list"]).output
    assert ["stories-260k:f32", "gguf"] in [line.split()[:2] for line in listing.splitlines()[1:]]
    failed = runner.invoke(main, ["pull", f"hf.co/{GGUF_REPO}:nope"])
    assert failed.exit_code == 1 and failed.output.startswith("Error: 'nope' matches no file")


@pytest.mark.parametrize("text, repo, tag", [
    ("hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", None),
    ("huggingface.co/acme/m:Q4_K_M", "acme/m", "Q4_K_M"),
    ("https://huggingface.co/acme/m:q8_0", "acme/m", "q8_0"),
    ("hf.co/acme/m:sub/m-Q4_K_M.gguf", "acme/m", "sub/m-Q4_K_M.gguf"),
])
def test_hub_sources(text: str, repo: str, tag: str | None) -> None:
    from localserve.registry.hub import HubSource, parse_hub_source

    assert parse_hub_source(text) == HubSource(repo, tag)


def test_a_hub_file_url_is_a_url() -> None:
    from localserve.registry.hub import parse_hub_source

    assert parse_hub_source("https://huggingface.co/acme/m/resolve/main/m-Q4_K_M.gguf") is None
    assert parse_hub_source("./models/x.gguf") is None


def _endless_server() -> tuple[str, Callable[[], None]]:
    """An HTTP server whose .gguf never ends (chunked, no Content-Length), and whose
    huge.gguf announces 10 TB."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            self.send_response(200)
            if self.path.endswith("huge.gguf"):
                self.send_header("Content-Length", str(10 ** 13))
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}", stop


def test_url_pulls_stop_at_the_size_limit(tmp_path: Path) -> None:
    """Before: an endless body was downloaded to 1.2 GB before failing."""
    registry = empty_registry(tmp_path / "home")
    url, stop = _endless_server()
    try:
        with pytest.raises(LocalserveError, match="sent more than the limit of 4,194,304 bytes"):
            pull(registry, f"{url}/endless.gguf", max_bytes=4 << 20)
        with pytest.raises(LocalserveError, match="offers 10,000,000,000,000 bytes, more than the limit"):
            pull(registry, f"{url}/huge.gguf")
    finally:
        stop()
    assert registry.list() == []
    leftovers = [p for p in (tmp_path / "home" / "blobs").iterdir() if p.stat().st_size > 0]
    assert leftovers == []  # what arrived was deleted


def test_killed_imports_leave_no_temporary_files(tmp_path: Path) -> None:
    """A copy killed mid-way leaves blobs/tmp-*; the next registry opening removes it,
    but not a copy another process is writing now (it holds a lock)."""
    import fcntl

    registry = empty_registry(tmp_path / "home")
    blobs = tmp_path / "home" / "blobs"
    (blobs / "tmp-orphan").write_bytes(b"x" * 1000)
    (blobs / "partial-url-abc").write_bytes(b"y" * 1000)  # a resumable download stays
    with open(blobs / "tmp-busy", "wb") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)
        empty_registry(tmp_path / "home")
        assert sorted(p.name for p in blobs.iterdir() if p.name.startswith(("tmp-", "partial-"))) == [
            "partial-url-abc", "tmp-busy"]
    del registry
