"""From sampled tokens to what callers read: detokenization, stop conditions and the
text that is safe to stream.

Every caller (the HTTP server, ``localserve run``, the Python API) reads the same
``RequestOutput``: ``text`` is what may be shown so far and ``delta`` what of it is new
since the request's previous output, so none of them keeps its own stop-string logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..text.tokenizer import IncrementalDetokenizer, Tokenizer
from .request import Request
from .outputs import RequestOutput, TokenLogprobs
from .structured_output import Constraint

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class _Text:
    """One request's text: decoded so far (a found stop string cut off) and how much of
    it earlier outputs gave out."""

    detokenizer: IncrementalDetokenizer | None
    decoded: str = ""
    shown: int = 0
    stop: str | None = None  # the stop string it was cut at


class OutputProcessor:
    """Appends each step's sampled tokens to their requests, decides which requests
    finish, and makes their outputs."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._texts: dict[str, _Text] = {}

    def add(self, request: Request) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                 request.params.skip_special_tokens)
        self._texts[request.request_id] = _Text(detokenizer)

    def remove(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def process(self, sampled: list[Request], tokens: list[list[int]], logprobs: list[list[TokenLogprobs | None]],
                now: float) -> list[RequestOutput]:
        """One output per request that produced tokens (one, or several where it verified
        draft tokens), in order; tokens after one that finishes the request are dropped.
        Sets ``finish_reason`` and ``finish_time`` on those that are done (the engine then
        releases them)."""
        outputs = []
        for request, new_tokens, new_logprobs in zip(sampled, tokens, logprobs):
            text = self._texts[request.request_id]
            for token, token_logprobs in zip(new_tokens, new_logprobs):
                request.token_ids.append(token)
                constraint = request.active_constraint  # the one this token was sampled under
                _track_thinking(request, token)
                if request.first_token_time is None:
                    request.first_token_time = now
                if token_logprobs is not None:
                    request.logprobs.append(token_logprobs)
                request.finish_reason = self._finish_reason(request, text, token, constraint)
                if request.finish_reason is not None:
                    request.finish_time = now
                    break
            outputs.append(self._output(request, text))
        return outputs

    def embedded(self, done: list[tuple[Request, torch.Tensor]], now: float) -> list[RequestOutput]:
        """The one, finished, output of each embedding request whose prompt is done."""
        outputs = []
        for request, vector in done:
            request.finish_reason, request.finish_time = "stop", now
            output = self._output(request, self._texts[request.request_id])
            output.embedding = vector
            outputs.append(output)
        return outputs

    def _finish_reason(self, request: Request, text: _Text, token: int, constraint: Constraint | None) -> str | None:
        params = request.params
        # The sampler keeps EOS and stop tokens out before min_tokens.
        stop_token = request.num_output_tokens >= params.min_tokens and (
            (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids)
        # A stop token ends the text without joining it (as vLLM does), so that where
        # special tokens are kept the text of <|im_end|> is no part of the answer.
        shown = not stop_token or params.include_stop_str_in_output
        piece = text.detokenizer.add(token) if text.detokenizer is not None and shown else ""
        text.decoded += piece
        if constraint is not None and (not constraint.accept(token) or constraint.finished):
            return "stop"  # the grammar is complete (or the token left it: an EOS it was told to ignore)
        if request.num_output_tokens < params.min_tokens:
            return None
        if piece and params.stop and self._cut_stop_string(request, text):
            return "stop"
        if stop_token:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _cut_stop_string(request: Request, text: _Text) -> bool:
        """Cut the text at the earliest stop string in what is not shown yet. Every
        stop string that began in shown text would have been held back, so looking
        there alone finds each one once."""
        found = [(i, s) for s in request.params.stop if (i := text.decoded.find(s, text.shown)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        text.stop = stop
        text.decoded = text.decoded[: index + len(stop) if request.params.include_stop_str_in_output else index]
        return True

    @staticmethod
    def _output(request: Request, text: _Text) -> RequestOutput:
        finished = request.finish_reason is not None
        # Never before ``shown``: a tail that begins a stop string now began one (or
        # was held back) at every earlier output too.
        end = len(text.decoded) if finished else len(text.decoded) - _held_back(text.decoded, request.params.stop)
        delta, text.shown = text.decoded[text.shown : end], end
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=text.decoded[:end],
            delta=delta,
            finished=finished,
            finish_reason=request.finish_reason,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=request.prompt_logprobs,  # complete by now, so shared without a copy
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            stop_string=text.stop,
        )


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that begin a stop string (the whole string
    too, which min_tokens may not have let count yet): the next tokens may complete it,
    and then it is cut off, so it must not be shown before."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop), len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _track_thinking(request: Request, token: int) -> None:
    """Follow the think block a request began in: closed by the model or, once it has
    written its budget of tokens, by the closing tokens forced one a step."""
    if request.forced_token_ids and token == request.forced_token_ids[0]:
        request.forced_token_ids.pop(0)
    params = request.params
    if not params.thinking_end or request.thinking_closed:
        return
    end = list(params.thinking_end)
    if request.output_token_ids[-len(end):] == end:
        request.thinking_closed = True
    elif params.thinking_budget is not None and request.num_output_tokens >= params.thinking_budget \
            and not request.forced_token_ids:
        request.forced_token_ids = end
