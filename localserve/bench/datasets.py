"""The requests a benchmark sends: synthetic ones of exact token lengths, or ShareGPT's.

Lengths are in the benchmark tokenizer's tokens. ``prompt_len`` is always measured by
encoding the final prompt text the way a server does (special tokens included), so the
figure reported is what the server sees, not what was aimed at.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import BenchConfig, BenchError
from .tokenizer import ServerTokenizer, is_plain_text

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer
    from .tokenizer import BenchTokenizer

# vLLM's ShareGPT filter: prompts and answers under 4 tokens say nothing, prompts over
# 1024 or conversations over 2048 tokens do not fit the models it was written for.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "assistant", "chatgpt", "bing", "bard", "model")
# Decode -> re-encode rarely lands on the exact length at once (merges across the new
# boundaries); a few rounds of truncating or topping up settle it.
_FIT_ROUNDS = 16


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens the server sees for this text (special tokens included)
    expected_output_len: int  # max_tokens sent
    group: int | None = None  # the shared prefix's index (prefix-repetition)


def sample_requests(config: BenchConfig, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    """``config.num_prompts`` requests from ``config.dataset_name``, reproducible by seed."""
    rng = np.random.default_rng([config.seed, 0])  # its own stream: arrivals draw from another
    if config.dataset_name == "random":
        return random_requests(tokenizer, config.num_prompts, config.random_input_len, config.random_output_len,
                               config.random_range_ratio, rng)
    if config.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer, config.num_prompts, config.prefix_repetition_prefix_len, config.prefix_repetition_suffix_len,
            config.prefix_repetition_num_prefixes, config.prefix_repetition_output_len, rng)
    assert config.dataset_path is not None  # BenchConfig checks it
    return sharegpt_requests(tokenizer, Path(config.dataset_path), config.num_prompts, config.sharegpt_output_len,
                             config.seed)


# -- synthetic ------------------------------------------------------------------------------

def random_requests(tokenizer: BenchTokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator) -> list[SampleRequest]:
    """Prompts of random tokens with lengths uniform in [floor(L(1-r)), ceil(L(1+r))]
    (vLLM's random dataset). The length counts the special tokens the server adds (BOS),
    so the server's prompt_tokens equals the length drawn."""
    specials = num_special_tokens(tokenizer)
    input_lens = rng.integers(*_bounds(input_len, range_ratio, low=specials + 1), size=num, endpoint=True)
    output_lens = rng.integers(*_bounds(output_len, range_ratio, low=1), size=num, endpoint=True)
    allowed = allowed_token_ids(tokenizer)
    requests = []
    for length, out in zip(input_lens.tolist(), output_lens.tolist()):
        text, _ = fit_to_length(tokenizer, [], length - specials, allowed, rng)
        requests.append(SampleRequest(text, len(tokenizer.encode(text)), out))
    return requests


def prefix_repetition_requests(tokenizer: BenchTokenizer, num: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int,
                               rng: np.random.Generator) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes of ``prefix_len`` tokens; each prompt is one of
    them followed by its own random ``suffix_len`` tokens (vLLM's prefix-repetition
    dataset), so a prefix cache can serve every prompt of a group after its first."""
    allowed = allowed_token_ids(tokenizer)
    prefixes = [fit_to_length(tokenizer, [], prefix_len, allowed, rng)[1] for _ in range(num_prefixes)]
    requests = []
    for index in range(num):
        group = index % num_prefixes
        text, _ = fit_to_length(tokenizer, prefixes[group], suffix_len, allowed, rng)
        requests.append(SampleRequest(text, len(tokenizer.encode(text)), output_len, group))
    order = rng.permutation(num)  # groups interleave, as real traffic would
    return [requests[i] for i in order]


def _bounds(length: int, ratio: float, low: int) -> tuple[int, int]:
    return max(math.floor(length * (1 - ratio)), low), max(math.ceil(length * (1 + ratio)), low)


def num_special_tokens(tokenizer: BenchTokenizer) -> int:
    """Tokens the tokenizer adds to any text (BOS, ...), as a server's encode does."""
    sample = "hello"
    return len(tokenizer.encode(sample)) - len(tokenizer.encode(sample, add_special_tokens=False))


def allowed_token_ids(tokenizer: BenchTokenizer) -> np.ndarray:
    """The ids random prompts are drawn from: whole printable text on their own."""
    if isinstance(tokenizer, ServerTokenizer):
        return tokenizer.plain_text_token_ids()  # read from the server a few thousand at a time
    return _allowed_token_ids(tokenizer)


@cache
def _allowed_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    # Special and control tokens are left out (a prompt full of EOS or <unk> measures
    # nothing real), and so are tokens that are not whole printable text on their own
    # (lone UTF-8 continuation bytes decode to U+FFFD and re-encode to several tokens).
    backend = tokenizer.backend
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    special |= {t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None}
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    allowed = [i for i, text in zip(ids, texts) if is_plain_text(text)]
    if not allowed:
        raise BenchError("the tokenizer has no plain-text tokens to build random prompts from")
    return np.asarray(allowed, dtype=np.int64)


def fit_to_length(tokenizer: BenchTokenizer, head: list[int], tail_len: int, allowed: np.ndarray,
                  rng: np.random.Generator) -> tuple[str, list[int]]:
    """A text whose tokens (without special tokens) are ``head`` followed by ``tail_len``
    random ones: draw, decode, re-encode, then trim or top up until the re-encoding has
    exactly that length and still starts with ``head``. ``head`` must itself be a
    re-encoding (as returned here). Returns the text and its tokens; after the rounds run
    out, the closest text (its measured length is what gets reported)."""
    tail = rng.choice(allowed, size=tail_len).tolist()
    text, ids = tokenizer.decode(head + tail), head + tail
    for _ in range(_FIT_ROUNDS):
        text = tokenizer.decode(head + tail)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids[: len(head)] != head:
            # The tail's first token merged with the head's last: a fresh draw usually does not.
            tail = rng.choice(allowed, size=tail_len).tolist()
            continue
        tail = ids[len(head):]
        if len(tail) == tail_len:
            return text, ids
        if len(tail) > tail_len:
            tail = tail[:tail_len]
        else:
            tail += rng.choice(allowed, size=tail_len - len(tail)).tolist()
    return text, ids


# -- ShareGPT -------------------------------------------------------------------------------

def sharegpt_requests(tokenizer: BenchTokenizer, path: Path, num: int, output_len: int | None,
                      seed: int) -> list[SampleRequest]:
    """Conversations from a ShareGPT JSON file (a list of ``{"conversations": [{"from":
    "human"|"gpt", "value": ...}, ...]}``): the first human turn is the prompt and the
    answer after it sets the output length (unless ``output_len``). Shuffled by seed,
    filtered like vLLM (too short or too long skipped), and repeated when fewer than
    ``num`` remain."""
    pairs = [pair for entry in _read_sharegpt(path) if (pair := _first_exchange(entry)) is not None]
    random.Random(seed).shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, answer in pairs:
        if len(requests) >= num:
            break
        prompt_len = len(tokenizer.encode(prompt))
        wanted = output_len if output_len is not None else len(tokenizer.encode(answer, add_special_tokens=False))
        if not is_valid_sharegpt(prompt_len, wanted, check_output=output_len is None):
            continue
        requests.append(SampleRequest(prompt, prompt_len, wanted))
    if not requests:
        raise BenchError(f"{path}: no conversation passes the length filter (prompt {SHAREGPT_MIN_LEN}-"
                         f"{SHAREGPT_MAX_PROMPT_LEN} tokens, prompt + answer at most {SHAREGPT_MAX_TOTAL_LEN})")
    # Too few: repeat some at random (vLLM oversamples the same way), so num_prompts holds.
    extra = random.Random(seed + 1)
    requests += [extra.choice(requests) for _ in range(num - len(requests))]
    return requests


def is_valid_sharegpt(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def _read_sharegpt(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, list):
        raise BenchError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} entries")
    return data


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the assistant's answer right after it, if any."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        answer = turns[i + 1]
        if (isinstance(turn, dict) and isinstance(answer, dict) and turn.get("from") in _HUMAN
                and answer.get("from") in _ASSISTANT
                and isinstance(turn.get("value"), str) and isinstance(answer.get("value"), str)):
            return turn["value"], answer["value"]
    return None
