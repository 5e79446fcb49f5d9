"""Image URLs fetched by the daemon when its operator allows it (vision/image_fetch.py):
against a local HTTP server serving an image, redirects, an oversized body and a slow one;
the refusal of private and local addresses unless the host is named; and, end to end,
OpenAI's client sending an ``https?://`` image_url to a daemon started with the flag, the
answer equal to the same image sent inline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from localserve.errors import LocalserveError
from localserve.server.config import ServerConfig
from localserve.vision.image_fetch import ImageFetcher
from localserve.vision.image_input import ImageLimits, image_from_data_url

from .server_util import running_server, small_engine_config
from .vision_util import data_url, png, tiny_gemma3_vision

PICTURE = png(1)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/picture.png":
            self._send(200, PICTURE, "image/png")
        elif self.path.startswith("/hop/"):  # /hop/N redirects N times, then to the picture
            left = int(self.path.rsplit("/", 1)[1])
            self.send_response(302)
            self.send_header("Location", f"/hop/{left - 1}" if left > 1 else "/picture.png")
            self.end_headers()
        elif self.path == "/huge.png":
            self._send(200, PICTURE + b"\0" * 4096, "image/png")
        elif self.path == "/slow.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for byte in PICTURE[:50]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(404, b"no", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _fetch(fetcher: ImageFetcher, url: str) -> str:
    return asyncio.run(fetcher.data_url(url))


def test_a_named_host_is_fetched_and_redirects_are_followed(site: str) -> None:
    fetcher = ImageFetcher.allowing(["127.0.0.1"])
    for path in ("/picture.png", "/hop/3"):
        image = image_from_data_url(_fetch(fetcher, site + path))
        assert image.data == PICTURE and (image.width, image.height) == (64, 80)


def test_what_is_refused(site: str) -> None:
    named = ImageFetcher.allowing(["127.0.0.1"])
    with pytest.raises(LocalserveError, match="redirects more than 3 times"):
        _fetch(named, site + "/hop/4")
    with pytest.raises(LocalserveError, match="gave HTTP 404"):
        _fetch(named, site + "/missing.png")
    small = ImageFetcher(frozenset({"127.0.0.1"}), limits=ImageLimits(max_bytes=len(PICTURE) + 100))
    with pytest.raises(LocalserveError, match="over the limit of"):
        _fetch(small, site + "/huge.png")
    slow = ImageFetcher(frozenset({"127.0.0.1"}), timeout=1.0)
    with pytest.raises(LocalserveError, match="took longer than 1 s"):
        _fetch(slow, site + "/slow.png")
    # With no host named, only public addresses: loopback, private and link-local are refused.
    anywhere = ImageFetcher.allowing()
    for url in (site + "/picture.png", "http://10.0.0.8/x.png", "http://169.254.169.254/latest/meta-data",
                "http://[::1]/x.png"):
        with pytest.raises(LocalserveError, match="private or local address"):
            _fetch(anywhere, url)
    with pytest.raises(LocalserveError, match="not one this daemon fetches from"):
        _fetch(named, "http://example.com/x.png")
    with pytest.raises(LocalserveError, match="must be http"):
        _fetch(named, "ftp://127.0.0.1/x.png")


def test_the_daemon_fetches_image_urls_only_when_allowed(site: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tiny_gemma3_vision(tmp_path_factory.mktemp("vision"))
    url = site + "/picture.png"

    def ask(client: openai.OpenAI, image: str) -> str:
        answer = client.chat.completions.create(model="g3", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "what is this"}]}])
        return answer.choices[0].message.content or ""

    allowed = ServerConfig(models={"g3": folder}, preload=["g3"], engine=small_engine_config(), device="cpu",
                           image_fetcher=ImageFetcher.allowing(["127.0.0.1"]))
    with running_server(allowed) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert ask(client, url) == ask(client, data_url(PICTURE))
        with pytest.raises(openai.BadRequestError, match="gave HTTP 404"):
            ask(client, site + "/missing.png")
    refusing = ServerConfig(models={"g3": folder}, preload=["g3"], engine=small_engine_config(), device="cpu")
    with running_server(refusing) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="--allow-image-urls"):
            ask(client, url)
