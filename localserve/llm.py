"""The offline Python API: load a model, generate for a list of prompts or chat."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .chat import reply as chat_reply
from .chat.messages import image_sources, render_messages
from .vision.placement import images_for, lay_out
from .chat.reply import AssistantMessage
from .text.chat_template import ChatTemplate
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.outputs import RequestOutput
from .engine.sampling_params import PoolingParams, SamplingParams
from .engine.stats import EngineStats
from .errors import LocalserveError

Prompt = str | list[int]


@dataclass(slots=True)
class ChatOutput(RequestOutput):
    """A chat reply: the request's output and ``message``, its text read as the HTTP API
    reads it (``content``, ``reasoning_content``, ``tool_calls``)."""

    message: AssistantMessage | None = None


class LLM:
    """``LLM(path).generate(prompts, params)``: batched generation, outputs in input order;
    ``LLM(path).embed(texts)`` with an embedding model.

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
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, self._params_for(params, len(prompts)))]
        return self._run(ids)

    def embed(self, inputs: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None) -> list[torch.Tensor]:
        """One embedding per input (text or token ids), in input order: float32 vectors,
        unit length unless ``pooling`` says otherwise. Needs an embedding model."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        pooling = pooling or PoolingParams()
        ids = [self.engine.add_request(text, pooling=pooling) for text in inputs]  # type: ignore[union-attr]
        return [output.embedding for output in self._run(ids)]  # type: ignore[misc]

    def _run(self, ids: list[str]) -> list[RequestOutput]:
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
        tool_choice: str | dict = "auto",
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_reasoning_tokens: int | None = None,
    ) -> list[ChatOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or
        several, rendered with the model's own chat template; each output's ``message`` is
        the reply read as the HTTP API reads it: thinking, answer and tool calls.
        ``tool_choice`` ``required`` or a named function holds the reply to schema-valid
        calls; ``chat_template_kwargs`` are further template variables (``enable_thinking``)."""
        if self._chat_template is None:
            self._chat_template = self.engine.checkpoint.chat_template()
        template = self._chat_template
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        conversations = list(conversations)  # type: ignore[arg-type]
        params = self._params_for(params, len(conversations))
        encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=False)
        placement = self.engine.image_placement
        prompts, formats, chat_params, images = [], [], [], []
        for messages, sampling in zip(conversations, params):
            images.append(images_for(placement, image_sources(list(messages)), "this model"))
            text = render_messages(list(messages), lambda plain, **how: template.render(
                plain, add_generation_prompt=True, tools=tools, **(chat_template_kwargs or {}), **how))
            reply = chat_reply.reply_format(template, text, tools, tool_choice, parallel_tool_calls)
            fields = chat_reply.sampling_fields(reply, encode, max_reasoning_tokens)
            if reply.forced_tools is not None:
                if sampling.output_format is not None:
                    raise LocalserveError("give an output_format or a required or named tool_choice, not both")
                fields["output_format"] = reply.forced_tools
            text = lay_out(placement, text, images[-1])
            # The template writes BOS itself where the model wants it.
            prompts.append(encode(text))
            formats.append(reply)
            chat_params.append(dataclasses.replace(sampling, **fields))
        ids = [self.engine.add_request(prompt, sampling, images=pictures)
               for prompt, sampling, pictures in zip(prompts, chat_params, images)]
        return [ChatOutput(**{f.name: getattr(output, f.name) for f in dataclasses.fields(output)},
                           message=chat_reply.whole(reply, output.text))
                for output, reply in zip(self._run(ids), formats)]

    @staticmethod
    def _params_for(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if len(params) != count:
            raise LocalserveError(f"{len(params)} sampling params for {count} prompts")
        return list(params)

    def stats(self) -> EngineStats:
        return self.engine.stats()
