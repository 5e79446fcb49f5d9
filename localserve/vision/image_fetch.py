"""Images named by an ``http(s)`` URL, fetched by the daemon only when its operator allows
it (``serve --allow-image-urls``), under the same limits as inline images and a time limit.

A daemon that fetches what clients name can be turned against the network it sits in
(server-side request forgery: its own admin API on loopback, a cloud's metadata service on
a link-local address, hosts behind the firewall). So a URL's host must resolve to public
addresses only, unless the operator names the host (``--image-url-host``, which also limits
fetching to the hosts named); every redirect is checked the same way, at most
``MAX_REDIRECTS`` of them; the body is read up to the image size limit and no further, within
``timeout`` seconds in all. A fetched image is then checked as an inline one is. The
addresses are checked when the host is resolved for the check; a host whose DNS answers
differently moments later (DNS rebinding) is not caught, so where that matters the operator
names the hosts.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import httpx

from ..errors import LocalserveError
from .image_input import ImageLimits

MAX_REDIRECTS = 3
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ImageFetcher:
    # Hosts that may be fetched whatever they resolve to; when any is named, only these.
    hosts: frozenset[str] = field(default_factory=frozenset)
    timeout: float = DEFAULT_TIMEOUT_S
    limits: ImageLimits = ImageLimits()

    @classmethod
    def allowing(cls, hosts: Iterable[str] = (), timeout: float = DEFAULT_TIMEOUT_S) -> ImageFetcher:
        return cls(frozenset(host.lower().strip("[]") for host in hosts), timeout)

    async def data_url(self, url: str) -> str:
        """The image at ``url`` as a data URL (what the rest of the image path reads)."""
        try:
            data, media_type = await asyncio.wait_for(self._fetch(url), self.timeout)
        except TimeoutError:
            raise LocalserveError(f"fetching the image at {_short(url)} took longer than {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise LocalserveError(f"fetching the image at {_short(url)} failed: {exc}") from None
        return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"

    async def _fetch(self, url: str) -> tuple[bytes, str]:
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                await self._check_host(url)
                async with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise LocalserveError(f"fetching the image at {_short(url)} gave HTTP {response.status_code}")
                    return await self._body(response, url), _media_type(response)
        raise LocalserveError(f"the image at {_short(url)} redirects more than {MAX_REDIRECTS} times")

    async def _check_host(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise LocalserveError(f"an image URL must be http(s)://host/...; {_short(url)} is not")
        host = parts.hostname.lower()
        if self.hosts:
            if host not in self.hosts:
                raise LocalserveError(f"the image host {host} is not one this daemon fetches from "
                                      f"({', '.join(sorted(self.hosts))})")
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise LocalserveError(f"the image host {host} cannot be resolved ({exc.strerror or exc})") from None
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global:
                raise LocalserveError(f"the image host {host} is at {address}, a private or local address, which "
                                      "this daemon does not fetch from (the operator may name it with "
                                      "--image-url-host)")

    async def _body(self, response: httpx.Response, url: str) -> bytes:
        limit = self.limits.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise LocalserveError(f"the image at {_short(url)} is {int(declared):,} bytes, over the limit of "
                                  f"{limit:,} bytes")
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise LocalserveError(f"the image at {_short(url)} is over the limit of {limit:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def _media_type(response: httpx.Response) -> str:
    # The bytes decide the format (image_input reads it from them); a data URL needs an image type.
    declared = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return declared if declared.startswith("image/") else "image/unknown"


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
