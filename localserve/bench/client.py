"""One streamed request against an OpenAI-compatible server, timed as vLLM times it.

TTFT is the time to the first chunk that carries generated text (a chat stream's opening
role-only chunk does not count: some servers send it before any token exists); ITL are
the gaps between successive text chunks; E2EL runs to the last chunk with a choice. A
failure of any kind (refused connection, HTTP error, an error event, a broken stream)
comes back as a failed record with its message, never as an exception.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from .config import BenchConfig
from .datasets import SampleRequest

if TYPE_CHECKING:
    from .tokenizer import BenchTokenizer

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds from the benchmark's start."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # sent (after waiting for its arrival time and a concurrency slot)
    end: float = 0.0  # the response closed (success or not)
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_from: str = ""  # "usage" (the server said) or "tokenizer" (counted here; "" until then)
    chunks: int = 0  # chunks that carried text
    generated_text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_len": self.prompt_len, "expected_output_len": self.expected_output_len,
                "success": self.success, "error": self.error, "start_s": self.start, "end_s": self.end,
                "ttft_s": self.ttft, "e2el_s": self.e2el, "itl_s": self.itl, "output_tokens": self.output_tokens,
                "output_tokens_from": self.output_tokens_from, "chunks": self.chunks,
                "generated_text": self.generated_text}


def request_body(config: BenchConfig, model: str, sample: SampleRequest, eos_token_id: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": sample.expected_output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len  # newer OpenAI name; max_tokens for the rest
    else:
        body["prompt"] = sample.prompt
    if config.effective_ignore_eos:
        body["ignore_eos"] = True  # vLLM's (and localserve's) extension
        if eos_token_id is not None:
            # The portable way for servers without ignore_eos (llama.cpp's, OpenAI's own).
            body["logit_bias"] = {str(eos_token_id): -100}
    return body


async def send_request(http: httpx.AsyncClient, url: str, body: dict[str, Any], sample: SampleRequest,
                       tokenizer: BenchTokenizer | None, t0: float) -> RequestRecord:
    """POST ``body`` to ``url`` and read its SSE stream; ``t0`` is the benchmark's
    ``time.perf_counter()`` origin. Without usage from the server the output tokens are
    counted with ``tokenizer``; with None they are left for ``count_output_tokens``
    after the run (a server's tokenizer is not called while the load is measured)."""
    record = RequestRecord(sample.prompt_len, sample.expected_output_len)
    start = time.perf_counter()
    record.start = start - t0
    stream = _Stream()
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = http_error(response)
            else:
                async for line in response.aiter_lines():
                    if stream.feed(line):
                        break
                record.error = stream.error or ""
                if not record.error and not stream.saw_choice:
                    record.error = "the stream ended without any completion chunk"
    except httpx.ConnectError as exc:
        record.error = f"cannot connect to {url} ({str(exc) or type(exc).__name__})"
    except httpx.TimeoutException as exc:
        record.error = f"timed out ({type(exc).__name__}) waiting for {url}"
    except Exception as exc:  # a broken stream, bad JSON: this request failed, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    record.end = end - t0
    record.error = " ".join(record.error.split())  # one line, whatever the server sent
    record.success = not record.error
    record.generated_text = stream.text
    record.chunks = stream.chunks
    if record.success:
        # A stream that carried no text at all (the model ended at once) still has a first
        # choice chunk: it stands in for the first token, as vLLM's client counts it.
        first = stream.first_text or stream.first_choice
        last = stream.last_choice
        record.ttft = first - start
        record.e2el = last - start
        record.itl = stream.gaps
        if stream.completion_tokens is not None:
            record.output_tokens, record.output_tokens_from = stream.completion_tokens, "usage"
        elif tokenizer is not None:
            count_output_tokens([record], tokenizer)
        if stream.prompt_tokens is not None:
            record.prompt_len = stream.prompt_tokens  # what the server counted (a chat template adds some)
    return record


def count_output_tokens(records: list[RequestRecord], tokenizer: BenchTokenizer) -> None:
    """Count with ``tokenizer`` the output of each successful record the server gave no
    usage for (one encode of the whole text per record)."""
    for record in records:
        if record.success and not record.output_tokens_from:
            text = record.generated_text
            record.output_tokens = len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
            record.output_tokens_from = "tokenizer"


class _Stream:
    """Reads SSE lines and timestamps the chunks."""

    def __init__(self) -> None:
        self.text = ""
        self.chunks = 0
        self.gaps: list[float] = []
        self.first_text: float = 0.0
        self.first_choice: float = 0.0
        self.last_choice: float = 0.0
        self.last_text: float = 0.0
        self.saw_choice = False
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.error: str | None = None

    def feed(self, line: str) -> bool:
        """Takes one line; True when the stream is over."""
        if not line.startswith("data:"):
            return False  # blank separators, comments (":" pings), event names
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return True
        now = time.perf_counter()
        data = json.loads(payload)
        if not isinstance(data, dict):
            return False
        if "error" in data:
            error = data["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return True
        if choices := data.get("choices"):
            choice = choices[0]
            text = choice.get("text") if "delta" not in choice else (choice.get("delta") or {}).get("content")
            if not self.saw_choice:
                self.saw_choice, self.first_choice = True, now
            self.last_choice = now
            if text:
                if self.chunks:
                    self.gaps.append(now - self.last_text)
                else:
                    self.first_text = now
                self.last_text = now
                self.chunks += 1
                self.text += text
        if isinstance(usage := data.get("usage"), dict):
            if isinstance(tokens := usage.get("completion_tokens"), int):
                self.completion_tokens = tokens
            if isinstance(tokens := usage.get("prompt_tokens"), int):
                self.prompt_tokens = tokens
        return False


def http_error(response: httpx.Response) -> str:
    try:
        error = response.json()
        # OpenAI's shape ({"error": {"message"}}), llama.cpp's and FastAPI's ({"detail"}) alike
        message = error.get("error") or error.get("detail")
        if isinstance(message, dict):
            message = message.get("message", message)
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {response.status_code}: {message or response.text[:300] or response.reason_phrase}"
