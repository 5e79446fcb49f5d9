"""Behaviour of the batched Sampler: greedy, seeding, filters, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from localserve.engine.sampler import Sampler, SamplingRow
from localserve.engine.sampling_params import SamplingParams
from localserve.kernels import cpu_library, sampling_cpu
from localserve.kernels.dispatch import KernelChoice, using


@pytest.fixture(autouse=True, params=["cpu_kernels", "torch"])
def sampler_path(request: pytest.FixtureRequest) -> object:
    """Every test twice: the argmax and draws through the compiled CPU kernels
    (kernels/sampling_cpu.py), and through the torch code (the GPU's)."""
    if request.param == "cpu_kernels" and not cpu_library.available():
        pytest.skip("the CPU kernels are not built")
    with using(KernelChoice(cpu_kernels=request.param == "cpu_kernels")):
        yield request.param


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    eos: frozenset[int] = frozenset(),
    **params: object,
) -> SamplingRow:
    p = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(p, list(prompt or []), list(output or []), gen, eos)


# Hand-made distribution over 6 tokens: used by the filter tests.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
N_DRAWS = 6000


def draw_many(**params: object) -> torch.Tensor:
    """Sample N_DRAWS times from PROBS in one batch; deterministic via a forked global RNG."""
    rows = [make_row(**params) for _ in range(N_DRAWS)]
    logits = PROBS.log().expand(N_DRAWS, -1).clone()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        ids = Sampler()(logits, rows).token_ids
    return torch.bincount(torch.tensor(ids), minlength=len(PROBS))


def assert_follows(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    allowed = expected_probs > 0
    assert counts[~allowed].sum() == 0, f"sampled a filtered token: {counts.tolist()}"
    expected = expected_probs[allowed] * counts.sum()
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    # df <= 5; chi2 > 25 has p < 1e-4, so this only fails for a wrong distribution.
    assert chi2 < 25, f"chi2={chi2:.1f} counts={counts.tolist()} expected={expected.tolist()}"


def test_greedy_is_argmax_for_any_dtype() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    rows = [make_row(temperature=0) for _ in range(5)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cast = logits.to(dtype)
        out = Sampler()(cast, rows)
        assert out.token_ids == cast.float().argmax(-1).tolist()
        assert out.logprobs == [None] * 5


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 50)
    before = logits.clone()
    rows = [make_row(output=[1, 2], repetition_penalty=1.5, presence_penalty=1.0, temperature=0.7, top_p=0.5)
            for _ in range(2)]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy_even_at_high_temperature() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    greedy = Sampler()(logits, [make_row(temperature=0) for _ in range(8)]).token_ids
    top1_rows = [make_row(temperature=5.0, top_k=1, seed=(i if i % 2 else None)) for i in range(8)]
    assert Sampler()(logits, top1_rows).token_ids == greedy
    assert len(set(greedy)) > 1  # the rows really differ, so this compares something


def test_top_k_one_equals_greedy_with_tied_best_logits() -> None:
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0]]).expand(50, -1)
    rows = [make_row(temperature=1.0, top_k=1, seed=s) for s in range(50)]
    assert Sampler()(logits, rows).token_ids == [1] * 50  # argmax takes the first of a tie


def run_steps(seed: int, step_logits: list[torch.Tensor], others: int) -> list[int]:
    """Decode len(step_logits) steps for one seeded row at index 1 of a batch with `others` rows."""
    sampler = Sampler()
    target = make_row(prompt=[3, 4], seed=seed, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    # Companions with top_p of their own redraw in the same steps as the target may.
    companions = [make_row(seed=(None if j % 2 else 100 + j), temperature=1.3, top_p=0.5 if j % 3 else 1.0)
                  for j in range(others)]
    tokens = []
    for logits in step_logits:
        rows = companions[:1] + [target] + companions[1:]
        noise = torch.randn(len(companions), logits.shape[0])
        batch = torch.cat([noise[:1], logits[None], noise[1:]]) if companions else logits[None]
        token = sampler(batch, rows).token_ids[1 if companions else 0]
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_row_is_reproducible_alone_or_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    # Flat-ish logits so the sample genuinely depends on the random draws.
    step_logits = [torch.randn(1000, generator=gen) * 0.5 for _ in range(6)]
    alone = run_steps(42, step_logits, others=0)
    assert run_steps(42, step_logits, others=0) == alone
    assert run_steps(42, step_logits, others=3) == alone
    assert run_steps(42, step_logits, others=6) == alone
    assert run_steps(43, step_logits, others=0) != alone


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, [0, 1, 2]),
        # mass before token 1 = 0.40 < 0.6 (kept), before token 2 = 0.65 >= 0.6 (dropped)
        ({"top_p": 0.6}, [0, 1]),
        # floor = 0.2 * 0.40 = 0.08: token 3 (0.10) stays, token 4 (0.06) goes
        ({"min_p": 0.2}, [0, 1, 2, 3]),
        ({}, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_filters_only_sample_allowed_tokens_in_proportion(params: dict[str, object], allowed: list[int]) -> None:
    expected = torch.zeros_like(PROBS)
    expected[allowed] = PROBS[allowed] / PROBS[allowed].sum()
    assert_follows(draw_many(**params), expected)


def test_temperature_sharpens_distribution() -> None:
    expected = PROBS**2 / (PROBS**2).sum()  # temperature 0.5 squares the probabilities
    assert_follows(draw_many(temperature=0.5), expected)


def test_filters_combine_after_temperature() -> None:
    # temperature 2 -> p ∝ sqrt(PROBS); top_k=4 keeps 0..3; top_p=0.8 on the renormalised
    # sqrt distribution [.632,.5,.387,.316]/1.835 = [.345,.272,.211,.172]: mass before token 3
    # is 0.828 >= 0.8, so it is dropped.
    sqrt = PROBS.sqrt()
    expected = torch.zeros_like(PROBS)
    expected[:3] = sqrt[:3] / sqrt[:3].sum()
    assert_follows(draw_many(temperature=2.0, top_k=4, top_p=0.8), expected)


LOGITS = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 1.0])


def test_repetition_penalty_formula() -> None:
    row = make_row(prompt=[0, 0, 3], output=[1, 2], repetition_penalty=2.0)
    got = Sampler().penalized_logits(LOGITS[None], [row])[0]
    # seen tokens {0,1,2,3}: positive / 2, negative * 2 (counted once, however often seen)
    assert got.tolist() == [1.0, -2.0, 0.25, -1.0, 3.0, 1.0]


def test_presence_and_frequency_penalties_formula() -> None:
    row = make_row(prompt=[0, 5], output=[1, 1, 2, 4, 1], frequency_penalty=0.5, presence_penalty=0.25)
    got = Sampler().penalized_logits(LOGITS[None], [row])[0]
    # output counts: 1 -> 3, 2 -> 1, 4 -> 1; prompt tokens are not penalised
    expected = [2.0, -1.0 - 1.5 - 0.25, 0.5 - 0.5 - 0.25, -0.5, 3.0 - 0.5 - 0.25, 1.0]
    assert got.tolist() == pytest.approx(expected)


def test_penalties_apply_in_order_and_per_row() -> None:
    both = make_row(prompt=[0], output=[4, 4], repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    plain = make_row(prompt=[0], output=[4, 4])
    neg = make_row(output=[4], presence_penalty=-1.0)
    got = Sampler().penalized_logits(LOGITS.expand(3, -1), [both, plain, neg])
    # token 4: repetition first (3 / 2 = 1.5), then - 1.0 * 2 - 0.5 = -1.0; token 0: 2 / 2
    assert got[0].tolist() == pytest.approx([1.0, -1.0, 0.5, -0.5, -1.0, 1.0])
    assert torch.equal(got[1], LOGITS)
    assert got[2].tolist() == pytest.approx([2.0, -1.0, 0.5, -0.5, 4.0, 1.0])


def test_penalties_change_the_greedy_choice() -> None:
    # Without penalties token 4 wins; presence penalty 2 after emitting it makes token 0 win.
    assert Sampler()(LOGITS[None], [make_row(output=[4], temperature=0)]).token_ids == [4]
    row = make_row(output=[4], temperature=0, presence_penalty=2.0)
    assert Sampler()(LOGITS[None], [row]).token_ids == [0]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 3.0]])  # 3 then 4 are by far the best
    eos = frozenset({3})
    early = make_row(output=[0], eos=eos, min_tokens=2, stop_token_ids=[4], temperature=0)
    assert Sampler()(logits, [early]).token_ids == [5]
    done = make_row(output=[0, 1], eos=eos, min_tokens=2, stop_token_ids=[4], temperature=0)
    assert Sampler()(logits, [done]).token_ids == [3]
    # Sampled rows never pick a banned token either, even though they hold ~99.9% of the mass.
    sampled = [make_row(output=[], eos=eos, min_tokens=1, stop_token_ids=[4], seed=s) for s in range(300)]
    ids = Sampler()(logits.expand(300, -1), sampled).token_ids
    assert not {3, 4} & set(ids)
    assert Sampler().penalized_logits(logits, sampled[:1])[0, 3:5].tolist() == [-math.inf, -math.inf]


def test_logprobs_are_raw_log_softmax_with_sorted_top_lists() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 100)
    rows = [
        make_row(logprobs=5, temperature=0.7, top_k=10, repetition_penalty=1.3, output=[1, 2], seed=1),
        make_row(logprobs=0, temperature=0),
        make_row(temperature=0),
        make_row(logprobs=20, temperature=1.5, presence_penalty=2.0, output=[7]),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        expected_ids = raw[i].topk(n).indices.tolist() if n else []
        assert [t for t, _ in lp.top] == expected_ids
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)


def test_logprobs_for_sampled_token_outside_top() -> None:
    # A low-probability token is forced by min_tokens banning the others' favourites;
    # its logprob is still reported even though it is not in the top-1 list.
    logits = torch.tensor([[5.0, 4.0, -3.0]])
    row = make_row(eos=frozenset({0, 1}), min_tokens=1, logprobs=1, temperature=0)
    lp = Sampler()(logits, [row]).logprobs[0]
    assert lp is not None and lp.token_id == 2
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == [0]


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []


def kept_by_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition by a full sort: a token stays while the mass before it is below top_p."""
    values, order = probs.sort(descending=True)
    return order[(values.cumsum(0) - values) < top_p]


def test_top_p_at_a_real_vocabulary_follows_the_kept_tokens() -> None:
    """Five tokens hold half the mass and 152k others the rest; top_p 0.4 keeps three of
    the five, drawn in proportion, whatever the tail."""
    vocab, draws = 151_936, 400
    head = torch.tensor([0.2, 0.12, 0.09, 0.05, 0.04])
    probs = torch.full((vocab,), 0.5 / (vocab - 5))
    favoured = torch.tensor([7, 150_000, 3, 90_000, 12])
    probs[favoured] = head
    kept = kept_by_top_p(probs, 0.4)
    assert sorted(kept.tolist()) == sorted(favoured[:3].tolist())
    with torch.random.fork_rng():
        torch.manual_seed(5)
        rows = [make_row(top_p=0.4) for _ in range(draws)]
        ids = torch.tensor(Sampler()(probs.log().expand(draws, -1).clone(), rows).token_ids)
    counts = torch.stack([(ids == f).sum() for f in favoured])
    assert int(counts.sum()) == draws
    assert_follows(counts, torch.cat([head[:3] / head[:3].sum(), torch.zeros(2)]))


@pytest.mark.parametrize("spread", [8.0, 0.01])  # peaked, and flat: the kept set is most of the vocabulary
def test_top_p_draws_only_kept_tokens(spread: float) -> None:
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(3)) * spread
    for top_p in (0.5, 0.99):
        kept = set(kept_by_top_p(logits.softmax(0), top_p).tolist())
        rows = [make_row(top_p=top_p, seed=s) for s in range(64)]
        ids = Sampler()(logits.expand(64, -1).clone(), rows).token_ids
        assert set(ids) <= kept


def test_a_draw_at_the_top_of_the_range_takes_the_last_token_with_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The uniform draw times the total mass may round up to the total itself: the token
    picked is then the last one with mass, never a filtered one after it."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -math.inf, -math.inf]] * 2)
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, float(largest_below_one)))
    assert Sampler()(logits, [make_row(), make_row(seed=3)]).token_ids == [2, 2]
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.zeros(shape))
    assert Sampler()(logits, [make_row(), make_row(seed=3)]).token_ids == [0, 0]


def test_sampling_at_a_real_vocabulary_follows_the_distribution() -> None:
    """152k tokens, the mass on a few: those are drawn in proportion, the rest never."""
    vocab, draws = 151_936, 400
    logits = torch.full((draws, vocab), -30.0)
    favoured = torch.tensor([5, 70_000, 151_935])
    logits[:, favoured] = PROBS[:3].log()
    with torch.random.fork_rng():
        torch.manual_seed(99)
        ids = torch.tensor(Sampler()(logits, [make_row() for _ in range(draws)]).token_ids)
    assert set(ids.tolist()) <= set(favoured.tolist())
    counts = torch.stack([(ids == f).sum() for f in favoured])
    assert_follows(counts, PROBS[:3] / PROBS[:3].sum())


def test_logits_an_extreme_penalty_overflowed_still_give_a_token() -> None:
    logits = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 1.0, float("inf")]])
    for params in ({}, {"top_p": 0.5}, {"min_p": 0.1}):
        ids = Sampler()(logits, [make_row(**params), make_row(seed=1, **params)]).token_ids
        assert all(0 <= i < 3 for i in ids)


def test_a_top_p_too_small_for_float32_keeps_the_best_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    assert Sampler()(logits, [make_row(top_p=5e-324, seed=s) for s in range(4)]).token_ids == [1] * 4


def test_the_kernels_argmax_is_torchs_with_ties_infinities_and_nan(sampler_path: str) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 128_256, generator=gen)
    logits[1, [5, 90_000]] = 9.0  # a tie: the first wins
    logits[2, 70_000] = math.inf
    logits[3] = -math.inf
    logits[4, [100, 127_000]] = math.nan  # a NaN counts as the largest, the first of them
    logits[5, -1] = 50.0  # the answer in a last, partial block
    assert sampling_cpu.argmax(logits).tolist() == logits.argmax(-1).tolist()
    assert sampling_cpu.takes(logits) == (sampler_path == "cpu_kernels")


@pytest.mark.parametrize("params", [{"temperature": 0.8, "top_k": 40, "top_p": 0.9}, {"temperature": 1.0},
                                    {"temperature": 0.7, "min_p": 0.05}, {"temperature": 1.2, "top_p": 0.5}])
def test_the_kernels_draw_the_torch_samplers_tokens_from_the_same_uniforms(params: dict[str, object]) -> None:
    """Seeded rows take the same uniforms on both paths: the tokens agree but where sums in
    another order put a draw on the other side of a boundary. That happens with top_p over a
    flat distribution (the mass above a drawn token, 128k terms, against top_p: 4 rows in
    256 measured), not with top_k, min_p or a plain draw (none in 256)."""
    logits = torch.randn(64, 128_256, generator=torch.Generator().manual_seed(5)) * 2.5
    tokens = {}
    for kernels in (True, False):
        rows = [make_row(seed=s, **params) for s in range(64)]
        with using(KernelChoice(cpu_kernels=kernels)):
            tokens[kernels] = Sampler()(logits, rows).token_ids
    agree = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    assert agree >= (58 if "top_k" not in params and "top_p" in params else 64), (agree, tokens)
    assert len(set(tokens[True])) > 1


def test_every_built_kernel_library_samples_alike() -> None:
    """Each library built here (the generic one too, where built) takes the same argmax as
    torch and draws the same tokens as the library in use, from the same uniforms."""
    flags = cpu_library.cpu_flags()
    runnable = [name for name, needs in cpu_library.VARIANTS.items()
                if cpu_library.library_path(name).is_file() and set(needs) <= flags]
    if not runnable:
        pytest.skip("the CPU kernels are not built")
    logits = torch.randn(8, 50_000, generator=torch.Generator().manual_seed(2)) * 3
    uniforms = torch.rand(8, 4, generator=torch.Generator().manual_seed(3))
    settings = (torch.full((8,), 0.8), torch.tensor([40, 0, 40, 0, 5, 0, 1, 0]), torch.tensor([0.9, 1.0] * 4),
                torch.tensor([0.0, 0.0, 0.0, 0.05] * 2))
    found = {}
    for name in runnable:
        lib = cpu_library.load(name)
        argmax = torch.empty(8, dtype=torch.int64)
        lib.ls_argmax_rows(logits.data_ptr(), 8, logits.shape[1], argmax.data_ptr())
        assert argmax.tolist() == logits.argmax(-1).tolist(), name
        tokens = torch.empty(8, dtype=torch.int64)
        lib.ls_sample_rows(logits.data_ptr(), 8, logits.shape[1], *(t.data_ptr() for t in settings),
                           uniforms.data_ptr(), 4, tokens.data_ptr())
        found[name] = tokens.tolist()
    assert all(0 <= t < logits.shape[1] for t in found[runnable[0]])
    assert all(tokens == found[cpu_library.variant()] for tokens in found.values()), found
