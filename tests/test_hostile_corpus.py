"""The hostile-input corpus of issue 46, as data: one row per case, the input and the class
of answer it must get, grouped by how the input arrives.

- ``PULLS``: checkpoints and sources given to ``pull`` (as the CLI takes them: any local
  path its user can read). Every row runs in one child process whose address space is
  capped at 3 GiB; each must end in a one-line LocalserveError (``refused``, matching a
  pattern) within seconds, or be registered (``registered``) with the files listed, never
  in a traceback.
- ``HTTP``: requests to a running daemon: a 4xx with one line that quotes nothing of a
  file, never a 500, and the daemon keeps serving.

Before this corpus (issue 46's review): an HTTP client could make the daemon read any
local file and see its first bytes in the error; a 4 MB template took a load to 2.7 GiB
and 15 s; malformed indexes, a config nested 100,000 deep, /dev/zero and FIFOs ended in
tracebacks or never ended; nine kinds of broken tokenizers and generation configs were
registered and then failed at load with a 500; NaN or negative rope bases and epsilons
loaded and wrote garbage; a template printing a lone surrogate was a 500; a grammar of
100,000 alternatives sent a 2,346-character Rust panic to the client; a folder pull stored
10,000 junk .safetensors files; local pulls ignored --sha256 and --max-size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_util import CHAT_TEMPLATE, RunningServer, running_server, small_engine_config, stories_with_template
from .test_hostile_models import VOCAB, write_gguf, write_hf

Builder = Callable[[Path], Path]

# -- checkpoints ---------------------------------------------------------------------------


def _gpt2_vocab(tokens: list[str] | None = None, merges: list[str] | None = None) -> dict[str, tuple[Any, str]]:
    """GGUF metadata of a byte-level BPE tokenizer over the corpus model's 32 tokens."""
    tokens = tokens if tokens is not None else [chr(ord("a") + i) for i in range(26)] + ["ab"] + list("01234")
    return {"tokenizer.ggml.model": ("gpt2", "STRING"), "tokenizer.ggml.tokens": (tokens, "ARRAY"),
            "tokenizer.ggml.merges": (merges or ["a b"], "ARRAY")}


def gguf(metadata: dict[str, tuple[Any, str]] | None = None, tensors: dict[str, Any] | None = None) -> Builder:
    return lambda path: write_gguf(path / "model.gguf", metadata, tensors=tensors)


def gguf_with_tokenizer(**vocab: Any) -> Builder:
    return gguf(_gpt2_vocab(**vocab))


def hf(config: dict[str, Any] | None = None, files: dict[str, bytes | str] | None = None) -> Builder:
    """The corpus's HF folder with ``config`` merged in and ``files`` written beside it."""

    def build(path: Path) -> Path:
        folder = write_hf(path / "model", config)
        shutil.copyfile(STORIES_TOKENIZER, folder / "tokenizer.json")
        for name, content in (files or {}).items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
        return folder

    return build


def _index(weight_map: Any) -> str:
    return json.dumps({"metadata": {}, "weight_map": weight_map})


def nested_config(path: Path) -> Path:
    folder = hf()(path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return folder


def junk_shards(path: Path) -> Path:
    folder = hf()(path)
    for index in range(10_000):
        (folder / f"junk-{index:05}.safetensors").write_bytes(b"x")
    return folder


def fifo(path: Path) -> Path:
    os.mkfifo(path / "pipe.gguf")
    return path / "pipe.gguf"


def device(name: str) -> Builder:
    return lambda path: Path(name)


def template_of(source: str) -> Builder:
    return gguf({"tokenizer.chat_template": (source, "STRING"), **_gpt2_vocab()})


STORIES_TOKENIZER = Path(__file__).resolve().parent / "data" / "models" / "stories260K-hf" / "tokenizer.json"
NAN, INF = float("nan"), float("inf")

# (id, builder, pull options, expected: "registered" or a pattern of the one-line refusal)
PULLS: list[tuple[str, Builder, dict[str, Any], str]] = [
    # controls: the untouched corpus models pull
    ("gguf control", gguf_with_tokenizer(), {}, "registered"),
    ("hf control", hf(), {}, "registered"),
    # sources that are no checkpoint file
    ("/dev/zero", device("/dev/zero"), {}, "not a regular file or a folder"),
    ("/dev/stdin", device("/dev/stdin"), {}, "not a regular file or a folder"),
    ("a FIFO", fifo, {}, "not a regular file or a folder"),
    ("/etc/passwd", device("/etc/passwd"), {}, r"not a GGUF file \(it does not start"),
    # templates
    ("template of 4 MB", template_of("{{ bos_token }}" * 280_000), {}, "over the limit of 262,144"),
    ("template that does not compile", template_of("{% for %}"), {}, "does not compile"),
    # tokenizers that cannot be built
    ("tokenizer: tokens that are numbers", gguf_with_tokenizer(tokens=list(range(32))), {},
     "tokenizer.ggml.tokens is missing or not a list of strings"),
    ("tokenizer: duplicate tokens", gguf_with_tokenizer(tokens=["a"] * 32), {}, "appears twice"),
    ("tokenizer: short scores", gguf({**_gpt2_vocab(), "tokenizer.ggml.model": ("llama", "STRING"),
                                      "tokenizer.ggml.scores": ([0.0] * 5, "ARRAY")}), {}, "scores, one per token"),
    ("tokenizer: unknown model", gguf({**_gpt2_vocab(), "tokenizer.ggml.model": ("wordpiece9", "STRING")}), {},
     "'wordpiece9' is not supported"),
    ("tokenizer: merge of unknown tokens", gguf_with_tokenizer(merges=["zz qq"]), {}, "names a token not in"),
    ("tokenizer: merge into a token not in the vocabulary", gguf_with_tokenizer(merges=["b c"]), {},
     "makes a token not in"),
    ("tokenizer.json not a tokenizer", hf(files={"tokenizer.json": "{}"}), {}, "cannot be read as a tokenizer"),
    ("eos_token_id a string (config.json)", hf({"eos_token_id": "</s>"}), {}, "eos_token_id"),
    ("eos_token_id a string (generation_config.json)", hf(files={"generation_config.json": '{"eos_token_id": "x"}'}),
     {}, "generation_config.json: eos_token_id x is not a token id"),
    ("eos_token_id past the vocabulary (GGUF)", gguf({**_gpt2_vocab(), "tokenizer.ggml.eos_token_id": (VOCAB, "UINT32")}),
     {}, "tokenizer.ggml.eos_token_id"),
    # nonsense numbers
    ("rope base NaN", gguf({"llama.rope.freq_base": (NAN, "FLOAT32")}), {}, "llama.rope.freq_base nan is not a finite"),
    ("rope base negative", gguf({"llama.rope.freq_base": (-1e4, "FLOAT32")}), {}, "llama.rope.freq_base -10000"),
    ("rms epsilon NaN", gguf({"llama.attention.layer_norm_rms_epsilon": (NAN, "FLOAT32")}), {},
     "layer_norm_rms_epsilon nan"),
    ("rms epsilon negative", gguf({"llama.attention.layer_norm_rms_epsilon": (-0.5, "FLOAT32")}), {},
     "layer_norm_rms_epsilon -0.5"),
    ("rope scaling factor 0", gguf({"llama.rope.scaling.type": ("linear", "STRING"),
                                    "llama.rope.scaling.factor": (0.0, "FLOAT32")}), {}, "llama.rope.scaling.factor 0.0"),
    ("rope_theta infinite (HF)", hf({"rope_theta": INF}), {}, "rope_theta inf"),
    ("rms_norm_eps 0 (HF)", hf({"rms_norm_eps": 0}), {}, "rms_norm_eps 0"),
    # malformed JSON files
    ("config nested 100,000 deep", nested_config, {}, "nested too deep"),
    ("config.json not UTF-8", hf(files={"config.json": b"\xff\xfe{}"}), {}, "config.json: not UTF-8 text"),
    ("index: weight_map a string", hf(files={"model.safetensors.index.json": _index("model.safetensors")}), {},
     "weight_map is not an object"),
    ("index: mixed types", hf(files={"model.safetensors.index.json": _index({"a": "model.safetensors", "b": 3})}), {},
     "not a file name"),
    ("index: list values", hf(files={"model.safetensors.index.json": _index({"a": ["model.safetensors"]})}), {},
     "not a file name"),
    ("index: not UTF-8", hf(files={"model.safetensors.index.json": b'{"weight_map": {"\xff": 1}}'}), {},
     "not UTF-8 text"),
    ("index: a shard outside the folder", hf(files={"model.safetensors.index.json": _index({"a": "../x.safetensors"})}),
     {}, "invalid shard file name"),
    # what a folder pull stores, and the checks local pulls share with URL pulls
    ("10,000 junk .safetensors", junk_shards, {}, "registered"),
    ("--sha256 malformed", gguf_with_tokenizer(), {"sha256": "xyz"}, "sha256"),
    ("--sha256 of other content", gguf_with_tokenizer(), {"sha256": "0" * 64}, "does not match"),
    ("--sha256 of a folder", hf(), {"sha256": "0" * 64}, "checks one file"),
    ("--max-size below the file", gguf_with_tokenizer(), {"max_bytes": 1000}, r"over the limit of 1,000 \(--max-size\)"),
]

# Runs in the child: pull every case into a registry of its own, one JSON line per case.
_PULL_CHILD = """
import json, resource, sys, time, traceback
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from localserve.errors import LocalserveError
from localserve.registry import open_registry
from localserve.registry.pull import pull
for line in sys.stdin:
    case = json.loads(line)
    start = time.monotonic()
    outcome = {"id": case["id"], "error": None, "traceback": None, "files": None}
    try:
        registry = open_registry(Path(case["home"]))
        record = pull(registry, case["source"], **case["options"])
        outcome["files"] = sorted(f.name for f in record.files)
    except LocalserveError as exc:
        outcome["error"] = str(exc)
    except BaseException:
        outcome["traceback"] = traceback.format_exc()[-3000:]
    outcome["seconds"] = time.monotonic() - start
    print(json.dumps(outcome), flush=True)
"""


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("corpus")
    cases = []
    for index, (case_id, build, options, _) in enumerate(PULLS):
        folder = root / f"case{index}"
        folder.mkdir()
        cases.append({"id": case_id, "source": str(build(folder)), "options": options, "home": str(folder / "home")})
    result = subprocess.run([sys.executable, "-c", _PULL_CHILD], input="".join(json.dumps(c) + "\n" for c in cases),
                            capture_output=True, text=True, timeout=150, stdin=None)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["id"] for o in outcomes] == [c["id"] for c in cases]
    return {o["id"]: o for o in outcomes}


@pytest.mark.parametrize("case", PULLS, ids=[case[0] for case in PULLS])
def test_a_hostile_pull_gets_its_answer(pulled: dict[str, dict[str, Any]], case: tuple[str, Builder, dict, str]) -> None:
    case_id, _, _, expected = case
    outcome = pulled[case_id]
    assert outcome["traceback"] is None, outcome["traceback"]
    assert outcome["seconds"] < 10
    if expected == "registered":
        assert outcome["error"] is None, outcome["error"]
        assert not any(name.startswith("junk-") for name in outcome["files"])  # only what the model reads
        return
    error = outcome["error"]
    assert error is not None, f"registered {outcome['files']}"
    assert "\n" not in error and len(error) < 600
    assert re.search(expected, error), error
    assert "root:" not in error  # nothing of a file's content


def test_a_local_pull_checks_the_digest_it_is_given(tmp_path: Path) -> None:
    from localserve.registry import open_registry
    from localserve.registry.pull import pull

    path = gguf_with_tokenizer()(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    record = pull(open_registry(tmp_path / "home"), str(path), sha256=digest.upper())
    assert record.files[0].digest == f"sha256-{digest}"


# -- HTTP --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    from localserve.server.config import ServerConfig

    root = tmp_path_factory.mktemp("corpus-http")
    allowed = root / "allowed"
    allowed.mkdir()
    surrogate = stories_with_template(root, '{{ "\\ud800" }}' + CHAT_TEMPLATE, name="surrogate")
    config = ServerConfig(models={"stories": stories_with_template(root), "surrogate": surrogate},
                          registry_home=root / "registry", engine=small_engine_config(), device="cpu",
                          allow_pull_from=[allowed])
    with running_server(config) as running:
        yield running, allowed


def _outside_link(allowed: Path) -> str:
    folder = allowed / "linked"
    folder.mkdir(exist_ok=True)
    link = folder / "config.json"
    if not link.is_symlink():
        link.symlink_to("/etc/passwd")
    return str(folder)


def _link_out_of_the_root(allowed: Path) -> str:
    link = allowed / "etc"
    if not link.is_symlink():
        link.symlink_to("/etc")
    return str(link / "passwd")


def _broken_folder(allowed: Path) -> str:
    folder = allowed / "broken"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{not json")
    return str(folder)


ALTERNATIVES = "root ::= " + " | ".join(f'"w{index}"' for index in range(100_000))

# (id, method and path, body (or a function of the allowed folder giving the pull source), status, pattern)
HTTP: list[tuple[str, str, Any, int, str]] = [
    ("pull /etc/passwd", "/api/pull", "/etc/passwd", 400, "not a source this server pulls from"),
    ("pull a missing path", "/api/pull", "/no/such/file.gguf", 400, "not a source this server pulls from"),
    ("pull /dev/zero", "/api/pull", "/dev/zero", 400, "not a source this server pulls from"),
    ("pull a relative path", "/api/pull", "../../etc/passwd", 400, "not a source this server pulls from"),
    ("pull through a link out of the allowed folder", "/api/pull", _link_out_of_the_root, 400,
     "not a source this server pulls from"),
    ("pull a folder whose file links outside", "/api/pull", _outside_link, 400, "outside the model's folder"),
    ("pull a malformed folder", "/api/pull", _broken_folder, 400, "config.json: not valid JSON"),
    ("create FROM /etc", "/api/create", {"model": "x", "from": "/etc", "stream": False}, 400,
     "not a source this server pulls from"),
    ("grammar of 100,000 alternatives", "/v1/completions",
     {"model": "stories", "prompt": "a", "max_tokens": 2, "structured_outputs": {"grammar": ALTERNATIVES}},
     400, "over the limit of 262,144"),
    ("a template that writes a lone surrogate", "/v1/chat/completions",
     {"model": "surrogate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, 400,
     "lone surrogate"),
]


@pytest.mark.parametrize("case", HTTP, ids=[case[0] for case in HTTP])
def test_a_hostile_request_gets_a_one_line_4xx(daemon: tuple[RunningServer, Path], case: tuple) -> None:
    server, allowed = daemon
    _, path, body, status, pattern = case
    if callable(body):
        body = body(allowed)
    if isinstance(body, str):
        body = {"model": body, "stream": False}
    answer = httpx.post(server.url + path, json=body, timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert "\n" not in message and len(message) < 600
    assert re.search(pattern, message), message
    assert "root:" not in message  # /etc/passwd's first bytes
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_allowed_folder_is_pulled_over_http(daemon: tuple[RunningServer, Path]) -> None:
    server, allowed = daemon
    folder = stories_with_template(allowed, name="tiny")
    answer = httpx.post(f"{server.url}/api/pull", json={"model": str(folder), "stream": False}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert "tiny:latest" in {m["model"] for m in httpx.get(f"{server.url}/api/tags").json()["models"]}


# -- the command line ------------------------------------------------------------------------

def _stories_with(root: Path, template: str) -> str:
    return str(stories_with_template(root, template))


# (id, arguments (a function of a scratch folder), the one-line error's pattern)
CLI: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("run with a template that does not compile",
     lambda root: ["run", _stories_with(root, "{% for %}"), "hi", "--device", "cpu"], "does not compile"),
    ("run with a template that writes a lone surrogate",
     lambda root: ["run", _stories_with(root, '{{ "\\ud800" }}'), "hi", "--max-tokens", "2", "--device", "cpu"],
     "lone surrogate"),
    ("pull /dev/zero", lambda root: ["pull", "/dev/zero"], "not a regular file or a folder"),
]


@pytest.mark.parametrize("case", CLI, ids=[case[0] for case in CLI])
def test_a_hostile_command_ends_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: tuple) -> None:
    from click.testing import CliRunner

    from localserve.cli.main import main

    _, arguments, pattern = case
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, arguments(tmp_path))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error_lines) == 1 and re.search(pattern, error_lines[0]), result.output


@pytest.mark.parametrize("column, value", [("name", "../../.."), ("digest", "../../etc"), ("role", "nonsense")])
def test_a_damaged_catalogue_row_is_refused_by_every_command_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   column: str, value: str) -> None:
    import sqlite3

    from click.testing import CliRunner

    from localserve.cli.main import main

    home = tmp_path / "home"
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    assert CliRunner().invoke(main, ["pull", str(gguf_with_tokenizer()(tmp_path)), "--name", "hurt"]).exit_code == 0
    with sqlite3.connect(home / "registry.db") as db:
        db.execute(f"UPDATE files SET {column} = ? WHERE model = 'hurt:latest' AND role = 'weights'", (value,))
    for command in (["show", "hurt"], ["rm", "hurt"], ["cp", "hurt", "other"], ["run", "hurt", "hi"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1 and "has a damaged catalogue row" in result.output, (command, result.output)
    assert "hurt" in CliRunner().invoke(main, ["list"]).output  # nothing was removed; the listing still works
