"""The registry: names, the blob store, the catalogue, local imports and the CLI verbs
that use them (pull from a path, list, cp, rm, and registry names in run/show)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from localserve.cli.main import main
from localserve.errors import LocalserveError
from localserve.registry import ModelName, open_registry, parse_name
from localserve.registry.blobs import file_digest
from localserve.registry.local import import_local
from localserve.registry.registry import ModelFile, check_file_name

from .conftest import DATA, STORIES_HF

STORIES_GGUF = DATA / "models" / "stories260K.gguf"


@pytest.mark.parametrize("text, name, tag", [
    ("qwen2.5-0.5b-instruct:q4_k_m", "qwen2.5-0.5b-instruct", "q4_k_m"),
    ("Llama3", "llama3", "latest"),
    ("team/model:V1", "team/model", "v1"),
])
def test_names(text: str, name: str, tag: str) -> None:
    assert parse_name(text) == ModelName(name, tag)


@pytest.mark.parametrize("text", ["../etc:x", "a/../b", "/abs", "a/b/c", "a:..", "a:b/c", "", ":tag", "a:",
                                  "name\x00", "a b", ".hidden", "a:-x", "x" * 200, "x\n", "\tx", "x:y\r",
                                  "x\x1b[31m"])
def test_bad_names_are_refused(text: str) -> None:
    with pytest.raises(LocalserveError):
        parse_name(text)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "a\\b", "x\0", " x"])
def test_bad_file_names_are_refused(name: str) -> None:
    with pytest.raises(LocalserveError):
        check_file_name(name)


def test_blobs_are_content_addressed_and_verified(tmp_path: Path) -> None:
    registry = open_registry(tmp_path / "home")
    builtin = sorted(p.name for p in registry.blobs.root.iterdir())  # the demo model's
    source = tmp_path / "data.bin"
    source.write_bytes(b"hello" * 1000)
    digest = registry.blobs.add_file(source)
    assert digest == file_digest(source) and registry.blobs.path(digest).read_bytes() == source.read_bytes()
    assert registry.blobs.verify(digest)
    with pytest.raises(LocalserveError, match="does not match"):
        registry.blobs.add_file(source, expected="sha256-" + "0" * 64)
    assert sorted(p.name for p in registry.blobs.root.iterdir()) == sorted([*builtin, digest])  # nothing half-written
    registry.blobs.path(digest).write_bytes(b"tampered")
    assert not registry.blobs.verify(digest)
    for bad in ["sha256-../../x", "md5-abc", "sha256-" + "g" * 64]:
        with pytest.raises(LocalserveError):
            registry.blobs.path(bad)


def test_import_gguf_and_hf_then_generate(tmp_path: Path) -> None:
    from localserve import LLM, SamplingParams

    registry = open_registry(tmp_path / "home")
    gguf = import_local(registry, STORIES_GGUF, "stories:f32")
    hf = import_local(registry, STORIES_HF)
    assert str(gguf.name) == "stories:f32" and gguf.format == "gguf" and gguf.architecture == "llama"
    assert str(hf.name) == "stories260k-hf:latest" and hf.format == "safetensors"
    assert {f.name: f.role for f in hf.files} == {
        "config.json": "config", "generation_config.json": "config", "model.safetensors": "weights",
        "tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer"}
    assert hf.parameters == gguf.parameters > 0 and hf.context_length == 512
    assert [str(r.name) for r in registry.list()] == ["demo:latest", "stories:f32", "stories260k-hf:latest"]
    for name in ("stories:f32", "stories260k-hf"):
        text = LLM(registry.path(name)).generate("Once upon a time",
                                                 SamplingParams(temperature=0, max_tokens=8))[0].text
        assert text.startswith(", there was a little girl")


def test_rm_keeps_shared_blobs(tmp_path: Path) -> None:
    registry = open_registry(tmp_path / "home")
    import_local(registry, STORIES_HF, "a")
    import_local(registry, STORIES_GGUF, "g")
    registry.copy("a", "b")
    before = set(os.listdir(registry.blobs.root))
    assert registry.remove("a") == []  # b uses every blob of a
    assert set(os.listdir(registry.blobs.root)) == before
    assert registry.path("b").is_dir()
    freed = registry.remove("b")
    assert len(freed) == 5 and set(os.listdir(registry.blobs.root)) == before - set(freed)
    assert [str(r.name) for r in registry.list()] == ["demo:latest", "g:latest"]
    with pytest.raises(LocalserveError, match="not in the registry"):
        registry.remove("b")


def test_a_broken_checkpoint_registers_nothing(tmp_path: Path) -> None:
    registry = open_registry(tmp_path / "home")
    models, blobs = registry.list(), sorted(registry.blobs.root.iterdir())  # the built-in demo
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(LocalserveError):
        import_local(registry, broken)
    assert registry.list() == models and sorted(registry.blobs.root.iterdir()) == blobs


def test_add_refuses_hostile_file_entries(tmp_path: Path) -> None:
    registry = open_registry(tmp_path / "home")
    record = import_local(registry, STORIES_GGUF, "g")
    digest = record.files[0].digest
    for bad in (ModelFile("../escape.gguf", digest, 1, "weights"), ModelFile("x", "sha256-../../etc", 1),
                ModelFile("x", "sha256-" + "a" * 64, 1)):  # not in the store
        record.files = [bad]
        with pytest.raises(LocalserveError):
            registry.add(record)
    assert not (tmp_path / "home" / "escape.gguf").exists()
    assert [str(r.name) for r in registry.list()] == ["demo:latest", "g:latest"]  # unchanged


def test_cli_verbs(tmp_path: Path) -> None:
    runner = CliRunner(env={"LOCALSERVE_HOME": str(tmp_path / "home")})

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        result = runner.invoke(main, list(args))
        return result

    result = invoke("pull", str(STORIES_GGUF), "--name", "stories")
    assert result.exit_code == 0, result.output
    assert "stories:latest" in result.output and "gguf" in result.output
    assert invoke("cp", "stories", "tale:v1").exit_code == 0
    listing = invoke("list")
    assert listing.exit_code == 0
    assert [line.split()[0] for line in listing.output.splitlines()] == ["NAME", "demo:latest", "stories:latest",
                                                                         "tale:v1"]
    rows = json.loads(invoke("list", "--json").output)
    assert {row["name"] for row in rows} == {"demo:latest", "stories:latest", "tale:v1"}
    shown = json.loads(invoke("show", "tale:v1", "--json").output)
    assert shown["architecture"] == "llama" and shown["layers"] == 5
    run = invoke("run", "stories", "Once upon a time", "--max-tokens", "12", "--kv-cache-memory", "64MiB")
    assert run.exit_code == 0, run.output
    assert run.output.startswith(", there was a little girl named Lily")
    assert invoke("rm", "stories").exit_code == 0
    missing = invoke("run", "stories", "hi")
    assert missing.exit_code != 0 and "not in the registry" in missing.output
    bad = invoke("pull", str(STORIES_GGUF), "--name", "../evil")
    assert bad.exit_code != 0 and "not a valid model name" in bad.output
    assert invoke("rm", "tale:v1").exit_code == 0
    assert invoke("rm", "demo").exit_code == 0
    assert invoke("list").output.splitlines() == ["NAME  FORMAT  ARCH  PARAMS  QUANTIZATION  SIZE"]


def test_a_new_registry_has_the_built_in_demo_model(tmp_path: Path) -> None:
    """stories260K ships in the package (no test data, no network): a new registry lists
    it as `demo`, `rm` removes it, and naming it brings it back."""
    from localserve.facts.checkpoint import model_info
    from localserve.registry.builtin import DEMO

    runner = CliRunner(env={"LOCALSERVE_HOME": str(tmp_path / "home")})
    listing = runner.invoke(main, ["list", "--json"])
    assert listing.exit_code == 0, listing.output
    [row] = json.loads(listing.output)
    assert row["name"] == "demo:latest" and row["source"].startswith("built-in")
    # The facts written in builtin.py are the file's.
    info, _ = model_info(DEMO.path)
    assert (row["format"], row["architecture"], row["quantization"], row["parameters"], row["context_length"],
            row["license"]) == (info["format"], info["architecture"], info["quantization"], info["parameters"],
                                info["context_length"], info["license"])
    run = runner.invoke(main, ["run", "demo", "Once upon a time", "--max-tokens", "12", "--device", "cpu"])
    assert run.exit_code == 0, run.output  # through its own chat template
    assert run.output.startswith(", there was a little girl named Lily")
    shown = runner.invoke(main, ["show", "demo", "--license"])
    assert "MIT License" in shown.output and "karpathy/tinyllamas" in shown.output
    assert runner.invoke(main, ["rm", "demo"]).exit_code == 0
    assert json.loads(runner.invoke(main, ["list", "--json"]).output) == []
    assert runner.invoke(main, ["show", "demo"]).exit_code == 0
    assert [row["name"] for row in json.loads(runner.invoke(main, ["list", "--json"]).output)] == ["demo:latest"]


def test_the_demo_model_is_stories260k_with_a_chat_template() -> None:
    """scripts/make_demo_model.py kept every tensor and key, and added a template."""
    import gguf
    import numpy as np

    from localserve.registry.builtin import DEMO

    source, demo = gguf.GGUFReader(STORIES_GGUF), gguf.GGUFReader(DEMO.path)
    assert [t.name for t in source.tensors] == [t.name for t in demo.tensors]
    for ours, theirs in zip(demo.tensors, source.tensors):
        assert ours.tensor_type == theirs.tensor_type and np.array_equal(ours.data, theirs.data), ours.name
    for key, field in source.fields.items():
        if not key.startswith("GGUF.") and key != "general.name":
            assert str(demo.fields[key].contents()) == str(field.contents()), key
    assert "messages" in demo.fields["tokenizer.chat_template"].contents()


@pytest.mark.parametrize("verb", [["list"], ["list", "--json"], ["rm", "nothing"], ["cp", "demo", "copy"], ["ps"]])
def test_registry_verbs_do_not_import_torch(tmp_path: Path, verb: list[str]) -> None:
    """The registry and the CLI verbs that only read or change it start in a fraction of a
    second: nothing they import reaches torch or the engine (a fresh interpreter each)."""
    import subprocess
    import sys

    code = ("import sys\nfrom localserve.cli.main import main\n"
            f"try:\n    main({verb!r}, standalone_mode=False)\nexcept Exception:\n    pass\n"
            "print('torch' in sys.modules)")
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path / "home"), "LOCALSERVE_URL": "http://127.0.0.1:9"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout


@pytest.mark.parametrize("verbs", [
    [["pull", str(STORIES_GGUF), "--name", "g"], ["show", "g"], ["show", "g", "--json"]],
    [["pull", str(STORIES_HF), "--name", "h"], ["show", "h"], ["show", str(STORIES_HF)]],
    [["show", "demo"], ["show", "demo", "--template"]],
])
def test_pull_of_a_file_and_show_do_not_import_torch(tmp_path: Path, verbs: list[list[str]]) -> None:
    """Reading a checkpoint's metadata (spec, tokenizer, chat template, sizes) needs no
    torch: the weights are what the engine reads (formats/weights.py)."""
    import subprocess
    import sys

    code = ("import sys\nfrom localserve.cli.main import main\n"
            f"for verb in {verbs!r}:\n    main(verb, standalone_mode=False)\n"
            "print('torch' in sys.modules)")
    env = {**os.environ, "LOCALSERVE_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "architecture" in result.stdout or "{%" in result.stdout  # the verbs did their work
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout


def _copy_folder(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize(("name", "outside"), [("LICENSE", "/etc/passwd"), ("merges.txt", "/proc/self/environ"),
                                               ("config.json", "../elsewhere.json")])
def test_a_folder_import_refuses_links_that_leave_it(tmp_path: Path, name: str, outside: str) -> None:
    """Before: LICENSE -> /etc/passwd was copied into the store and shown by show --license,
    merges.txt -> /proc/self/environ stored the environment (HF_TOKEN included)."""
    (tmp_path / "elsewhere.json").write_text("{}")
    folder = _copy_folder(STORIES_HF, tmp_path / "model")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    registry = open_registry(tmp_path / "home")
    stored = sorted((tmp_path / "home").rglob("*"))
    with pytest.raises(LocalserveError, match="outside the model's folder"):
        import_local(registry, folder, "bad")
    assert sorted((tmp_path / "home").rglob("*")) == stored  # nothing read into the store
    assert "bad:latest" not in [str(r.name) for r in registry.list()]
    result = CliRunner().invoke(main, ["show", str(folder), "--license"])
    assert result.exit_code != 0 and "outside the model's folder" in result.output


def test_a_folder_import_takes_links_within_it_and_the_hub_cache_layout(tmp_path: Path) -> None:
    """Hugging Face's cache keeps snapshots as links into the repository's blobs; links
    inside the folder are fine too."""
    repo = tmp_path / "models--x--stories"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for index, source in enumerate(sorted(p for p in STORIES_HF.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"blob{index}"
        blob.write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(Path("../../blobs") / blob.name)
    registry = open_registry(tmp_path / "home")
    record = import_local(registry, snapshot, "cached")
    assert {f.name for f in record.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
