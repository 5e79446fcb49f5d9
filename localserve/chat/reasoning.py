"""Reasoning split from the answer, for models that think between ``<think>`` and
``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its distills): the thinking goes to
``reasoning_content``, the rest to ``content``, as vLLM and llama-server return them.

A model thinks this way when its chat template writes those tags. Some templates open the
block themselves at the end of the prompt (DeepSeek-R1's generation prompt ends in
``<think>\\n``), so the output starts inside it; others let the model write the opening tag;
and a prompt that closes an empty block (Qwen3 with ``enable_thinking: false``) leaves the
output all answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START, END = "<think>", "</think>"


def thinks(template_source: str) -> bool:
    """Whether a chat template is one of a thinking model's."""
    return END in template_source


def starts_inside(prompt: str) -> bool:
    """Whether the rendered prompt leaves the output inside an open think block."""
    tail = prompt.rstrip()
    return tail.endswith(START)


@dataclass(slots=True)
class ReasoningSplitter:
    """Splits text fed piece by piece into (reasoning, content) pieces. A piece that could
    be the beginning of a tag is held back until the next one shows whether it is."""

    inside: bool = False  # within the think block
    done: bool = False  # the block has closed: everything after is content
    held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self.held + text
        self.held = ""
        while text:
            if self.done:
                content.append(text)
                break
            tag = END if self.inside else START
            at = text.find(tag)
            if at >= 0:
                (reasoning if self.inside else content).append(text[:at])
                text = text[at + len(tag):]
                if self.inside:
                    self.done = True
                else:
                    self.inside = True
                continue
            keep = partial_marker(text, tag)
            (reasoning if self.inside else content).append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text is complete."""
        held, self.held = self.held, ""
        return (held, "") if self.inside and not self.done else ("", held)


def end_tokens(encode: Callable[[str], list[int]]) -> tuple[int, ...]:
    """The tokens of ``</think>`` as a model writes it mid-reply: a SentencePiece vocabulary
    encodes a string on its own with a leading word marker, which mid-reply it would not
    have. ``encode``: text -> ids, without special tokens added."""
    base = encode("\n")
    ids = encode("\n" + END)
    return tuple(ids[len(base):] if ids[:len(base)] == base else encode(END))


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (what a stream
    holds back until the next piece shows whether the marker is there)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
