from __future__ import annotations

import pytest
from click.testing import CliRunner

from localserve import __version__
from localserve.cli.main import main

from .conftest import STORIES_HF


def test_version_and_help() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0 and "run" in result.output


def test_run_streams_greedy_text() -> None:
    result = CliRunner().invoke(main, ["run", str(STORIES_HF), "Once upon a time", "--max-tokens", "12", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(", there was a little girl named Lily")


def test_run_reports_bad_model_cleanly(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt-neox"}')
    result = CliRunner().invoke(main, ["run", str(tmp_path), "hi"])
    assert result.exit_code != 0 and "not supported" in result.output and "Traceback" not in result.output


def test_run_takes_engine_options() -> None:
    args = ["run", str(STORIES_HF), "Once upon a time", "--max-tokens", "12", "--device", "cpu",
            "--kv-cache-dtype", "int8", "--kv-cache-memory", "8MiB", "--cpu-offload-gb", "0.01",
            "--no-enable-prefix-caching", "--max-num-seqs", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(", there was a little girl named Lily")


@pytest.mark.parametrize(("text", "size"), [("1073741824", 1 << 30), ("4GiB", 4 << 30), ("512MiB", 512 << 20),
                                             ("2GB", 2 * 10**9), ("1.5g", 3 << 29), ("64 kib", 64 << 10)])
def test_sizes_parse(text: str, size: int) -> None:
    from localserve.cli.main import ByteSize

    assert ByteSize().convert(text, None, None) == size


@pytest.mark.parametrize("bad", ["12XB", "GiB", "-1GiB", "0"])
def test_bad_sizes_are_refused(bad: str) -> None:
    result = CliRunner().invoke(main, ["run", "nowhere", "hi", "--kv-cache-memory", bad])
    assert result.exit_code == 2 and "--kv-cache-memory" in result.output
