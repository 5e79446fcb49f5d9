"""localserve: serve quantized LLMs on one machine."""

__version__ = "0.1.0"

from .engine.config import EngineConfig
from .engine.engine import Engine, RequestOutput
from .engine.sampling_params import SamplingParams
from .errors import LocalserveError
from .llm import LLM

__all__ = ["LLM", "Engine", "EngineConfig", "LocalserveError", "RequestOutput", "SamplingParams", "__version__"]
