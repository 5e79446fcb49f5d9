"""The offline Python API: load a model, generate for a list of prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .text.chat_template import ChatTemplate
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.output_processor import RequestOutput
from .engine.sampling_params import SamplingParams
from .engine.stats import EngineStats
from .errors import LocalserveError

Prompt = str | list[int]


class LLM:
    """``LLM(path).generate(prompts, params)``: batched generation, outputs in input order.

    Engine options (``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``num_kv_blocks``, ``kv_cache_memory``, ``cpu_offload_gb``,
    ``enable_prefix_caching``, ...) pass through as keywords.
    """

    def __init__(
        self,
        model: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        **engine_options: int | None,
    ) -> None:
        try:
            config = EngineConfig(**engine_options)  # type: ignore[arg-type]
        except TypeError as exc:
            raise LocalserveError(f"unknown engine option: {exc}") from exc
        self.engine = Engine(model, config, device=device, dtype=dtype)
        self._chat_template: ChatTemplate | None = None  # loaded by the first chat()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise LocalserveError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
        return [done[i] for i in ids]

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or
        several, rendered with the model's own chat template."""
        if self._chat_template is None:
            self._chat_template = self.engine.checkpoint.chat_template()
        template = self._chat_template
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self._render(template, messages, tools) for messages in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def _render(self, template: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = template.render(messages, add_generation_prompt=True, tools=tools)
        # The template writes BOS itself where the model wants it.
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def stats(self) -> EngineStats:
        return self.engine.stats()
