from __future__ import annotations

import pytest
from click.testing import CliRunner

from localserve import __version__
from localserve.cli import main

from .conftest import STORIES_HF


def test_version_and_help() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0 and "run" in result.output


@pytest.mark.skipif(not STORIES_HF.is_dir(), reason="../shared/models/stories260K-hf not present")
def test_run_streams_greedy_text() -> None:
    result = CliRunner().invoke(main, ["run", str(STORIES_HF), "Once upon a time", "--max-tokens", "12", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(", there was a little girl named Lily")


def test_run_reports_bad_model_cleanly(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt-neox"}')
    result = CliRunner().invoke(main, ["run", str(tmp_path), "hi"])
    assert result.exit_code != 0 and "not supported" in result.output and "Traceback" not in result.output
