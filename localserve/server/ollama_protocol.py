"""Request bodies of Ollama's API, as Ollama's clients send them, bounded like the
OpenAI ones (protocol.py). A model may be named ``model`` or, as older clients do, ``name``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from .protocol import ModelField


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ModelRequest(_Body):
    model: ModelField

    @model_validator(mode="before")
    @classmethod
    def _name_is_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            return {**data, "model": data["name"]}
        return data


class PullRequest(ModelRequest):
    insecure: bool = False  # accepted: there is no registry of Ollama's to be insecure with
    stream: bool = True


class CopyRequest(_Body):
    source: ModelField
    destination: ModelField
