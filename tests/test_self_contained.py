"""A clone is the whole project: the tests read nothing outside the repository, and the
third-party files they read (tests/data) are listed with their source and licence, small
enough to keep in git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MAX_FILE_BYTES = 5 << 20
MAX_DATA_BYTES = 30 << 20
# A path that climbs out of the repository: "../shared" and the like, or parents[2] and above
# of a file one folder deep (tests/, benchmarks/, scripts/), which is the repository's parent.
OUTSIDE = re.compile(r"\.\./shared|parents\[[2-9]\]")


def tracked(*patterns: str) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, timeout=30,
                                check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed]


def test_no_code_reads_outside_the_repository() -> None:
    sources = tracked("*.py", "*.sh", ".ci/*")
    assert sources
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sources if path.is_file()
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                 if OUTSIDE.search(line) and path.resolve() != Path(__file__).resolve()]
    assert not offenders, "\n".join(offenders)


def test_the_data_is_listed_with_its_source_and_small() -> None:
    readme = (DATA / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)`", readme, flags=re.MULTILINE))
    files = [path for path in DATA.rglob("*") if path.is_file()]
    for path in files:
        relative = path.relative_to(DATA).as_posix()
        if relative == "README.md" or relative.startswith("licenses/"):
            continue
        # A row names the file, its folder, or a glob over its folder (``ggml-vocab-*.gguf``).
        assert any(relative == entry or relative.startswith(entry.rstrip("/") + "/") or Path(relative).match(entry)
                   for entry in listed), f"tests/data/{relative} has no row in tests/data/README.md"
    for entry in listed:
        assert list(DATA.glob(entry.rstrip("/"))), f"tests/data/README.md lists {entry}, which is not there"
    for licence in re.findall(r"`(licenses/[^`]+)`", readme):
        assert (DATA / licence).is_file(), f"{licence} is named but missing"
    assert max(path.stat().st_size for path in files) <= MAX_FILE_BYTES
    assert sum(path.stat().st_size for path in files) <= MAX_DATA_BYTES
