"""The real trained model in tests/data: known greedy continuation and tokenization."""

from __future__ import annotations

import pytest
import torch

from localserve import LLM, SamplingParams

from .conftest import STORIES_HF

CONTINUATION = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
    " a big, red ball. She wanted to play with it, but it was too high."
)



@pytest.fixture(scope="module")
def stories() -> LLM:
    return LLM(STORIES_HF, device="cpu", num_kv_blocks=256)


def test_tokenizes_like_llama(stories: LLM) -> None:
    assert stories.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_greedy_continuation(stories: LLM) -> None:
    [out] = stories.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=80))
    assert out.text.startswith(CONTINUATION)


def test_logprobs_equal_transformers(stories: LLM) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(STORIES_HF, dtype=torch.float32)
    [out] = stories.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, logprobs=3))
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(out.prompt_token_ids) - 1
    for i, entry in enumerate(out.logprobs):
        row = reference[start + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_chat_uses_the_checkpoint_template(tmp_path) -> None:
    import json
    import shutil

    folder = tmp_path / "stories-chat"
    shutil.copytree(STORIES_HF, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(folder, device="cpu", num_kv_blocks=64)
    [out] = llm.chat([{"role": "user", "content": "Once upon a time"}], SamplingParams(temperature=0, max_tokens=8))
    expected_prompt = llm.tokenizer.encode("<s>user: Once upon a time\nassistant:", add_special_tokens=False)
    assert out.prompt_token_ids == expected_prompt and expected_prompt[0] == 1
    [plain] = llm.generate(expected_prompt, SamplingParams(temperature=0, max_tokens=8))
    assert out.token_ids == plain.token_ids


def test_chat_without_a_template_says_so(stories: LLM) -> None:
    from localserve import LocalserveError

    with pytest.raises(LocalserveError, match="no chat template"):
        stories.chat([{"role": "user", "content": "Hi"}])
    # Generation is unaffected.
    assert stories.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=3))[0].token_ids
