"""Models that come with localserve, so that a fresh machine with no network has one to
serve: ``demo``, stories260K (a real trained tiny Llama that tells children's stories,
MIT; see localserve/demo/LICENSE) with a chat template of our own.

A new registry starts with the built-in models in its catalogue, like pulled ones (their
files copied into the blob store), so every command and the daemon see them alike;
`localserve rm demo` removes it, and naming it again (run, show, a request) brings it back. Its facts are written here rather than read
from the file, so that listing a registry never imports torch or the engine
(tests/test_registry.py checks them against the file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .names import ModelName
from .settings import ModelSettings

DEMO_FOLDER = Path(__file__).resolve().parents[1] / "demo"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: ModelName
    path: Path
    license_path: Path
    architecture: str
    quantization: str
    parameters: int
    context_length: int
    license: str
    source: str
    settings: ModelSettings


DEMO = BuiltinModel(
    name=ModelName("demo", "latest"), path=DEMO_FOLDER / "stories260K.gguf", license_path=DEMO_FOLDER / "LICENSE",
    architecture="llama", quantization="F32 100%", parameters=292_800, context_length=2048, license="MIT",
    source="built-in: stories260K, karpathy/tinyllamas",
    # A tiny story model rarely says it is done: a reply ends after a short story's length.
    settings=ModelSettings(parameters={"num_predict": 200}))

BUILTIN = {DEMO.name: DEMO}
