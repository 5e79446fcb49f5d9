"""The compiled CPU kernels are built with the package, never at run time: a build with no
C++ compiler still makes a package, and a host whose package has no usable library runs
on the torch references after one warning line."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from localserve import LLM, SamplingParams
from localserve.kernels import cpu_library

from .gguf_writers import STORIES_GGUF

ROOT = Path(__file__).resolve().parents[1]


def test_a_host_without_the_libraries_runs_on_the_references(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    if not STORIES_GGUF.is_file():
        pytest.skip("stories260K.gguf not present")
    from .test_stories import CONTINUATION

    monkeypatch.setattr(cpu_library, "library_path", lambda variant: tmp_path / f"_cpu_{variant}.so")
    cpu_library.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
            assert not cpu_library.available()
            llm = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
            [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
        warnings = [r for r in caplog.records if r.name == cpu_library.__name__]
        assert len(warnings) == 1 and "torch references" in warnings[0].getMessage()
        assert out.text.startswith(CONTINUATION[:60])
    finally:
        cpu_library.library.cache_clear()  # the real libraries for the tests after this one


def test_a_build_without_a_compiler_still_makes_a_wheel(tmp_path: Path) -> None:
    """setup.py leaves the libraries out with a warning when the compiler fails."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.so",
                                                                "__pycache__", "*.egg-info", ".pytest_cache"))
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"}
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(tmp_path / "wheel"), str(source)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = (tmp_path / "wheel").glob("localserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "localserve/kernels/cpu_library.py" in names
    assert not [name for name in names if name.endswith(".so")]
    assert "CPU kernels" in result.stdout + result.stderr  # the warning reaches the installer's log


def test_threads_default_to_the_physical_cores_this_process_may_use() -> None:
    import psutil

    from localserve import EngineConfig
    from localserve.errors import LocalserveError

    usable = len(os.sched_getaffinity(0))
    assert EngineConfig().cpu_threads() == min(psutil.cpu_count(logical=False) or usable, usable)
    assert EngineConfig(threads=1).cpu_threads() == 1
    assert EngineConfig(threads=usable + 1).cpu_threads() == usable  # no more threads than CPUs to run them
    with pytest.raises(LocalserveError, match="threads"):
        EngineConfig(threads=0)


def test_each_engine_runs_the_kernels_it_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """disable_cpu_kernels is an engine option (its default from the environment, read
    when the config is made, not at each call): two engines in one process keep their own
    choice, and the one on the references gives the same text."""
    if not STORIES_GGUF.is_file() or not cpu_library.available():
        pytest.skip("stories260K.gguf or the CPU kernels are not here")
    from localserve.engine.config import EngineConfig
    from localserve.kernels import attention_cpu, decoder_cpu, quant_linear_cpu

    calls = {"attention": 0, "matmul": 0, "stack": 0}
    attention, matmul = attention_cpu.paged_attention, quant_linear_cpu.dense_linear

    def counting(name, function):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention_cpu, "paged_attention", counting("attention", attention))
    monkeypatch.setattr(quant_linear_cpu, "dense_linear", counting("matmul", matmul))
    monkeypatch.setattr(decoder_cpu.DecoderStack, "run", counting("stack", decoder_cpu.DecoderStack.run))
    monkeypatch.setenv("LOCALSERVE_DISABLE_CPU_KERNELS", "1")
    from_environment = EngineConfig()
    monkeypatch.delenv("LOCALSERVE_DISABLE_CPU_KERNELS")
    assert from_environment.disable_cpu_kernels and not EngineConfig().disable_cpu_kernels
    params = SamplingParams(temperature=0, max_tokens=20)
    on_references = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64, disable_cpu_kernels=True)
    on_kernels = LLM(STORIES_GGUF, device="cpu", num_kv_blocks=64)
    [by_references] = on_references.generate("Once upon a time", params)
    assert calls == {"attention": 0, "matmul": 0, "stack": 0}
    [by_kernels] = on_kernels.generate("Once upon a time", params)
    # The layers run as one C++ stack (attention inside it); the LM head is a dense matmul.
    assert calls["stack"] > 0 and calls["matmul"] > 0
    assert by_kernels.text == by_references.text
