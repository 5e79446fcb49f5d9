"""localserve: serve quantized LLMs on one machine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .omp_wait import share_cores

__version__ = "0.1.0"

share_cores()  # before torch loads its OpenMP runtime (omp_wait.py says why)

# The Python API, imported on first use: `localserve list` or `ps` should not wait
# for torch to load.
_EXPORTS = {
    "LLM": ".llm", "Engine": ".engine.engine", "EngineConfig": ".engine.config", "RequestOutput": ".engine.outputs",
    "SamplingParams": ".engine.sampling_params", "LocalserveError": ".errors",
    "OutputFormat": ".engine.output_format", "ChatOutput": ".llm", "PoolingParams": ".engine.sampling_params",
    "SpeculativeConfig": ".engine.speculative.config",
}

if TYPE_CHECKING:
    from .engine.config import EngineConfig
    from .engine.engine import Engine
    from .engine.outputs import RequestOutput
    from .engine.sampling_params import PoolingParams, SamplingParams
    from .engine.speculative.config import SpeculativeConfig
    from .engine.output_format import OutputFormat
    from .errors import LocalserveError
    from .llm import LLM, ChatOutput


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'localserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


__all__ = ["LLM", "Engine", "EngineConfig", "LocalserveError", "OutputFormat", "PoolingParams", "RequestOutput",
           "SamplingParams", "SpeculativeConfig", "__version__"]
