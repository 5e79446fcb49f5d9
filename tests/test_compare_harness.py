"""benchmarks/compare.py's pure helpers: the ratio column, the table, the single-stream
verdict and HF's left padding (the servers and models are exercised by running it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("benchmarks_compare", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_table_ratios_against_localserve(compare):
    rows = [compare.Figures("localserve", "8 prompts, 8 clients", 100.0, 300.0, 10.0, 50.0, 20.0, 8),
            compare.Figures("llama-cpp-python", "8 prompts, 8 clients", 40.0, 120.0, 25.0, 900.0, 25.0, 8),
            compare.Figures("HF static batch", "8 prompts", 0.0, 0.0, 0.0)]
    assert compare.ratio(rows[0], rows[1]) == pytest.approx(2.5)
    assert compare.ratio(rows[0], rows[2]) is None  # no division by a zero throughput
    assert compare.ratio(None, rows[1]) is None
    lines = compare.format_table(rows).splitlines()
    assert lines[0].split()[:2] == ["system", "workload"] and len(lines) == 5
    assert lines[2].split()[-1] == "1.00"
    assert lines[3].split()[-1] == "2.50"
    assert lines[4].split()[-4:] == ["-", "-", "0.0", "-"]  # no latencies for HF, no ratio to a zero


def test_single_stream_verdict(compare):
    ours = compare.Figures("localserve", "4 prompts, 1 client", 20.0, 40.0, 5.0, 30.0, 50.0, 4)
    theirs = compare.Figures("llama-cpp-python", "4 prompts, 1 client", 50.0, 100.0, 2.0, 20.0, 20.0, 4)
    line = compare.single_stream_line([ours, theirs])
    assert "ratio by output tok/s: 0.40 (misses" in line
    assert "ratio by decode (TPOT): 0.40 (misses" in line
    theirs.output_tps, theirs.mean_tpot_ms = 30.0, 30.0
    line = compare.single_stream_line([ours, theirs])
    assert "ratio by output tok/s: 0.67 (meets" in line
    assert "ratio by decode (TPOT): 0.60 (meets" in line


def test_left_padding(compare):
    ids, mask = compare.left_padded([[1, 5, 6], [1, 7]], pad_id=0)
    assert ids.tolist() == [[1, 5, 6], [0, 1, 7]]
    assert torch.equal(mask, torch.tensor([[1, 1, 1], [0, 1, 1]]))
