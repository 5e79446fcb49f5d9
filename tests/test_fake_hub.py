"""The fake Hub is only useful if huggingface_hub's own client cannot tell it from the real one:
these tests drive it with HfApi / hf_hub_download / snapshot_download, and with plain httpx for
the HTTP details (Range, cut connections) that the download code depends on."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile, RepoFolder

from .fake_hub import FakeHub, git_blob_sha1

REPO = "acme/tiny-model"
WEIGHTS = bytes(range(256)) * 64  # 16 KiB, distinct bytes so an off-by-one shows
GGUF = b"GGUF" + bytes(1000)
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads these into constants at import, so patch both the environment and the constants:
    # nothing may read a real token or write under the real home.
    home = tmp_path / "hf-home"
    for name in ("HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.setenv(name, str(home if name == "HF_HOME" else home / "hub"))
    for name in ("HF_TOKEN", "HF_OIDC_RESOURCE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", str(home / "assets"))
    monkeypatch.setattr(constants, "HF_XET_CACHE", str(home / "xet"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as hub:
        hub.add_file(REPO, "config.json", CONFIG)
        hub.add_file(REPO, "weights/model.safetensors", WEIGHTS)
        hub.add_file(REPO, "gguf/q4/model-Q4_0.gguf", GGUF)
        hub.set_card_data(REPO, {"license": "apache-2.0"})
        yield hub


def resolve_url(hub: FakeHub, path: str, revision: str = "main") -> str:
    return f"{hub.endpoint}/{REPO}/resolve/{revision}/{path}"


def test_model_info_with_files_metadata(hub: FakeHub) -> None:
    info = HfApi(endpoint=hub.endpoint).model_info(REPO, files_metadata=True, token=False)
    assert info.id == REPO and info.sha == hub.sha(REPO)
    assert info.card_data is not None and info.card_data.license == "apache-2.0"
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert set(siblings) == {"config.json", "weights/model.safetensors", "gguf/q4/model-Q4_0.gguf"}
    config, weights = siblings["config.json"], siblings["weights/model.safetensors"]
    assert (config.size, config.blob_id, config.lfs) == (len(CONFIG), git_blob_sha1(CONFIG), None)
    assert weights.size == len(WEIGHTS) and weights.lfs is not None
    assert weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() and weights.lfs.size == len(WEIGHTS)
    # The query model_info sends for files_metadata=True.
    assert hub.requests[-1].path == f"/api/models/{REPO}" and hub.requests[-1].method == "GET"

    # Without blobs=true the Hub lists names only; a pinned commit works like "main".
    plain = HfApi(endpoint=hub.endpoint).model_info(REPO, revision=hub.sha(REPO), token=False)
    assert plain.siblings is not None and all(s.size is None and s.lfs is None for s in plain.siblings)
    assert hub.requests[-1].path == f"/api/models/{REPO}/revision/{hub.sha(REPO)}"


def test_model_info_errors(hub: FakeHub) -> None:
    api = HfApi(endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/missing", token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="v9", token=False)


def test_list_files_and_tree(hub: FakeHub) -> None:
    api = HfApi(endpoint=hub.endpoint)
    assert sorted(api.list_repo_files(REPO, token=False)) == [
        "config.json", "gguf/q4/model-Q4_0.gguf", "weights/model.safetensors",
    ]
    tree = list(api.list_repo_tree(REPO, recursive=True, token=False))
    assert {e.path for e in tree if isinstance(e, RepoFolder)} == {"gguf", "gguf/q4", "weights"}
    files = {e.path: e for e in tree if isinstance(e, RepoFile)}
    assert files["gguf/q4/model-Q4_0.gguf"].lfs is not None
    assert files["gguf/q4/model-Q4_0.gguf"].lfs.sha256 == hashlib.sha256(GGUF).hexdigest()
    assert files["config.json"].blob_id == git_blob_sha1(CONFIG) and files["config.json"].lfs is None

    top = list(api.list_repo_tree(REPO, token=False))
    assert sorted((type(e).__name__, e.path) for e in top) == [
        ("RepoFile", "config.json"), ("RepoFolder", "gguf"), ("RepoFolder", "weights"),
    ]
    # A subfolder goes over the wire as one %2F-encoded segment.
    sub = list(api.list_repo_tree(REPO, path_in_repo="gguf/q4", expand=True, token=False))
    assert [e.path for e in sub] == ["gguf/q4/model-Q4_0.gguf"] and sub[0].last_commit is not None


@pytest.mark.parametrize("filename, data", [("weights/model.safetensors", WEIGHTS), ("config.json", CONFIG)])
def test_hf_hub_download(hub: FakeHub, tmp_path: Path, filename: str, data: bytes) -> None:
    cached = hf_hub_download(REPO, filename, endpoint=hub.endpoint, cache_dir=tmp_path / "cache", token=False)
    assert Path(cached).read_bytes() == data
    assert f"snapshots/{hub.sha(REPO)}/{filename}" in cached

    local = hf_hub_download(REPO, filename, endpoint=hub.endpoint, local_dir=tmp_path / "local", token=False)
    assert Path(local) == tmp_path / "local" / filename and Path(local).read_bytes() == data
    assert not any(h.startswith("x-xet") for r in hub.requests for h in r.headers)


def test_hf_hub_download_errors(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "config.json", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.json", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)


def test_snapshot_download_allow_patterns(hub: FakeHub, tmp_path: Path) -> None:
    folder = snapshot_download(
        REPO, allow_patterns=["*.gguf", "*.json"], endpoint=hub.endpoint, cache_dir=tmp_path, token=False
    )
    got = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    assert got == ["config.json", "gguf/q4/model-Q4_0.gguf"]
    assert (Path(folder) / "gguf/q4/model-Q4_0.gguf").read_bytes() == GGUF
    assert not any(r.path.endswith(".safetensors") for r in hub.requests)


def test_token_required(tmp_path: Path) -> None:
    with FakeHub(token="secret") as hub:
        hub.add_file(REPO, "config.json", CONFIG)
        api = HfApi(endpoint=hub.endpoint)
        for token in (False, "wrong"):
            with pytest.raises(HfHubHTTPError) as err:
                api.model_info(REPO, token=token)
            assert err.value.response.status_code == 401
        assert api.model_info(REPO, token="secret").sha == hub.sha(REPO)
        assert hub.requests[-1].headers["authorization"] == "Bearer secret"
        path = hf_hub_download(REPO, "config.json", endpoint=hub.endpoint, cache_dir=tmp_path, token="secret")
        assert Path(path).read_bytes() == CONFIG


def test_head_headers(hub: FakeHub) -> None:
    lfs = httpx.head(resolve_url(hub, "weights/model.safetensors"))
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert lfs.status_code == 200 and lfs.content == b""
    assert lfs.headers["etag"] == lfs.headers["x-linked-etag"] == f'"{sha256}"'
    assert lfs.headers["x-linked-size"] == lfs.headers["content-length"] == str(len(WEIGHTS))
    assert lfs.headers["x-repo-commit"] == hub.sha(REPO) and lfs.headers["accept-ranges"] == "bytes"
    small = httpx.head(resolve_url(hub, "config.json"))
    assert small.headers["etag"] == f'"{git_blob_sha1(CONFIG)}"' and "x-linked-etag" not in small.headers
    missing = httpx.head(resolve_url(hub, "nope.json"))
    assert (missing.status_code, missing.headers["x-error-code"]) == (404, "EntryNotFound")
    assert httpx.get(f"{hub.endpoint}/api/whoami-v2").status_code == 404


def test_range_requests(hub: FakeHub) -> None:
    url = resolve_url(hub, "weights/model.safetensors")
    tail = httpx.get(url, headers={"Range": "bytes=10-"})
    assert tail.status_code == 206 and tail.content == WEIGHTS[10:]
    assert tail.headers["content-range"] == f"bytes 10-{len(WEIGHTS) - 1}/{len(WEIGHTS)}"
    middle = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert middle.status_code == 206 and middle.content == WEIGHTS[100:200]
    past = httpx.get(url, headers={"Range": f"bytes={len(WEIGHTS)}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(WEIGHTS)}"

    file_url = hub.serve_file("mirror/model.gguf", GGUF)
    assert file_url == f"{hub.endpoint}/files/mirror/model.gguf"
    whole = httpx.get(file_url)
    assert whole.status_code == 200 and whole.content == GGUF and whole.headers["accept-ranges"] == "bytes"
    assert httpx.head(file_url).headers["etag"] == f'"{hashlib.sha256(GGUF).hexdigest()}"'
    part = httpx.get(file_url, headers={"Range": "bytes=1000-"})
    assert part.status_code == 206 and part.content == GGUF[1000:]
    assert httpx.get(file_url, headers={"Range": "bytes=5000-"}).status_code == 416


def test_interrupt_after(hub: FakeHub) -> None:
    url = resolve_url(hub, "weights/model.safetensors")
    hub.interrupt_after("model.safetensors", 1000)
    received = bytearray()
    with httpx.Client() as client, client.stream("GET", url) as response:
        assert response.headers["content-length"] == str(len(WEIGHTS))
        with pytest.raises(httpx.TransportError):
            for chunk in response.iter_bytes():
                received += chunk
    assert bytes(received) == WEIGHTS[:1000]
    assert httpx.get(url).content == WEIGHTS  # only once
    assert hub.downloaded_bytes("model.safetensors") == 1000 + len(WEIGHTS)


def test_hf_hub_download_resumes_after_interrupt(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub retries a cut download (after a 1 s pause) with "Range: bytes=<kept>-", where <kept> counts
    # the whole chunks it wrote; shrink its 10 MiB chunk so a small file gets a partial one.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.interrupt_after("model.safetensors", 8192)
    path = hf_hub_download(REPO, "weights/model.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    assert Path(path).read_bytes() == WEIGHTS
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("model.safetensors")]
    assert len(gets) == 2 and "range" not in gets[0].headers
    kept = int(gets[1].headers["range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < kept <= 8192
    assert hub.downloaded_bytes("model.safetensors") == 8192 + len(WEIGHTS) - kept


def test_corrupt(hub: FakeHub, tmp_path: Path) -> None:
    hub.corrupt(REPO, "weights/model.safetensors")
    path = hf_hub_download(REPO, "weights/model.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path, token=False)
    got = Path(path).read_bytes()
    assert len(got) == len(WEIGHTS) and sum(a != b for a, b in zip(got, WEIGHTS)) == 1
    info = HfApi(endpoint=hub.endpoint).model_info(REPO, files_metadata=True, token=False)
    lfs = next(s.lfs for s in info.siblings or [] if s.rfilename == "weights/model.safetensors")
    assert lfs is not None and lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() != hashlib.sha256(got).hexdigest()
    assert httpx.head(resolve_url(hub, "weights/model.safetensors")).headers["x-linked-etag"] == f'"{lfs.sha256}"'


def test_stop_closes_pooled_connections() -> None:
    # A stopped hub must look down even to a client holding a keep-alive connection (offline-fallback tests).
    hub = FakeHub().start()
    hub.add_file(REPO, "config.json", CONFIG)
    with httpx.Client() as client:
        assert client.get(resolve_url(hub, "config.json")).content == CONFIG
        hub.stop()
        with pytest.raises(httpx.TransportError):
            client.get(resolve_url(hub, "config.json"))
