"""logit_bias (OpenAI semantics): added to the logits that are sampled or argmaxed,
never to the reported logprobs; per row, validated on the way in."""

from __future__ import annotations

import pytest
import torch

from localserve import Engine, EngineConfig, LocalserveError, SamplingParams
from localserve.engine.sampler import Sampler

from .conftest import VOCAB, hf_logits, random_prompt
from .test_sampler import LOGITS, make_row


def test_bias_is_added_after_the_penalties() -> None:
    row = make_row(output=[4], presence_penalty=1.0, logit_bias={4: 0.5, 1: -2.0})
    got = Sampler().penalized_logits(LOGITS[None], [row])[0]
    assert got.tolist() == pytest.approx([2.0, -3.0, 0.5, -0.5, 3.0 - 1.0 + 0.5, 1.0])


def test_plus_100_forces_a_token_and_minus_100_takes_the_second_best() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    best2 = logits.topk(2, dim=-1).indices
    forced = [make_row(temperature=0, logit_bias={17: 100}), make_row(temperature=0.8, seed=3, logit_bias={17: 100})]
    assert Sampler()(logits[:2], forced).token_ids == [17, 17]
    banned = [make_row(temperature=0, logit_bias={int(best2[i, 0]): -100}) for i in range(6)]
    assert Sampler()(logits, banned).token_ids == best2[:, 1].tolist()


def test_rows_keep_their_own_bias_and_logprobs_stay_raw() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    best2 = logits.topk(2, dim=-1).indices.tolist()
    rows = [
        make_row(temperature=0, logit_bias={3: 100}, logprobs=2),
        make_row(temperature=0),
        make_row(temperature=0, logit_bias={9: 100, 3: -100}),
        make_row(temperature=0, logit_bias={best2[3][0]: -100}),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == [3, best2[1][0], 9, best2[3][1]]
    lp = out.logprobs[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == logits[0].topk(2).indices.tolist()


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 100.5}, "values must be in"),
        ({5: -101}, "values must be in"),
        ({5: float("nan")}, "values must be in"),
        ({5: "1"}, "values must be in"),
        ({-1: 1.0}, "keys must be token ids"),
        ({"5": 1.0}, "keys must be token ids"),
    ],
)
def test_bad_bias_is_refused(bias: dict, message: str) -> None:
    with pytest.raises(LocalserveError, match=message):
        SamplingParams(logit_bias=bias)


def test_edges_are_accepted() -> None:
    assert SamplingParams(logit_bias={0: -100, 7: 100.0, 9: 0}).logit_bias == {0: -100, 7: 100.0, 9: 0}
    assert SamplingParams().logit_bias == {}


def test_engine_applies_bias_per_request(llama) -> None:
    path, hf = llama
    engine = Engine(path, EngineConfig(num_kv_blocks=64), device="cpu")
    prompt = random_prompt(20, seed=5)
    best, second = hf_logits(hf, prompt)[-1].topk(2).indices.tolist()
    forced = 77 if best != 77 else 78

    def greedy(bias: dict[int, float], max_tokens: int = 1) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logit_bias=bias)

    ids = [engine.add_request(prompt, p) for p in (greedy({forced: 100}, 8), greedy({best: -100}), greedy({}))]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert outputs[ids[0]] == [forced] * 8
    assert outputs[ids[1]] == [second]
    assert outputs[ids[2]] == [best]
    with pytest.raises(LocalserveError, match="logit_bias token ids"):
        engine.add_request(prompt, greedy({VOCAB: 1.0}))
