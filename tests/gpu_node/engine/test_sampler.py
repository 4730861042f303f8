"""The sampler: draws from the logits under each request's sampling parameters, and the
log-probabilities it reports, those of the distribution each token was drawn from (checked
against the engine's own logits: real SmolLM2 weights, fp32 KV)."""

import torch

from common.node_api import GrammarSpec
from gpu_node.engine.sampler import apply_penalties, sample
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import run_capturing_logits


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert sample(logits, SamplingParams(), None) == 1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), None) == 1


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    k2 = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert k2 == {0, 1}
    # probs ~ [.64, .24, .09, .03, .01]: top_p=0.8 keeps tokens whose mass above them is < 0.8
    p8 = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g) for _ in range(300)}
    assert p8 == {0, 1}


def test_same_seed_same_draws():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    a = [sample(logits, params, torch.Generator().manual_seed(5)) for _ in range(1)]
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [sample(logits, params, g1) for _ in range(20)] == [
        sample(logits, params, g2) for _ in range(20)
    ]
    assert len(a) == 1


def test_penalties_exact_values():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = apply_penalties(
        logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2, 0]
    )
    assert freq.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is untouched


def test_a_vanishing_temperature_draws_the_argmax_of_the_unscaled_logits():
    # Over 1e-300 (0 in float32) every positive logit overflows to inf: the draw is the
    # limit of the distribution, the argmax of the logits themselves, not the first inf.
    logits = torch.tensor([0.5, 1.0, 3.0, -2.0, 2.5])
    for temperature in (1e-300, 1e-45):
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=3)
        assert sample(logits, params, torch.Generator().manual_seed(0)) == 2


def test_a_vanishing_repetition_penalty_leaves_a_finite_draw():
    # A seen token's positive logit over 1e-300 overflows; the draw is that token, with
    # no inf or nan reaching the multinomial.
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    penalized = apply_penalties(logits, SamplingParams(repetition_penalty=1e-300), [0], [])
    assert penalized[0] == float("inf") and penalized[1:].tolist() == [3.0, 2.0, -1.0]
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300)
    assert sample(penalized, params, torch.Generator().manual_seed(0)) == 0


def test_a_top_p_below_float32s_least_value_keeps_the_most_probable_token():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    for top_p in (1e-46, 5e-324, 1e-9):  # 1e-46 and 5e-324 round to 0 in float32
        draws = {sample(logits, SamplingParams(temperature=1.0, top_p=top_p), g) for _ in range(50)}
        assert draws == {0}, top_p


def test_greedy_logprobs_are_the_log_softmax_of_the_engines_logits(make_engine, chat_ids):
    engine = make_engine(kv_dtype="fp32")
    params = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=3)
    logprobs, tokens, seen = run_capturing_logits(engine, chat_ids("Name a colour."), params)
    assert [lp.token_id for lp in logprobs] == tokens and len(seen) == len(tokens)
    for lp, logits in zip(logprobs, seen, strict=True):
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert lp.token_id == int(logits.argmax())
        assert lp.logprob == float(ref[lp.token_id])
        values, ids = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == values.tolist()


def test_logprobs_under_a_grammar_are_after_its_mask(make_engine, chat_ids):
    engine = make_engine(kv_dtype="fp32")
    grammar = engine.grammars.compile(GrammarSpec(kind="choice", choices=["red", "blue"]))
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=20)
    logprobs, _, seen = run_capturing_logits(engine, chat_ids("Name a colour."), params, grammar)
    first = logprobs[0]
    ref = torch.log_softmax(seen[0].float(), dim=-1)
    assert first.logprob == float(ref[first.token_id])
    # only tokens that begin "red" or "blue" are possible, and they hold all the mass
    texts = [engine.tokenizer.decode([t]) for t, _ in first.top]
    assert all("red".startswith(t) or "blue".startswith(t) for t in texts), texts
    assert len(first.top) < 20
    assert abs(sum(torch.tensor([v for _, v in first.top]).exp().tolist()) - 1.0) < 1e-5


def test_sampled_logprobs_are_after_temperature_and_top_k(make_engine, chat_ids):
    engine = make_engine(kv_dtype="fp32")
    params = SamplingParams(
        max_tokens=8, temperature=0.7, top_k=4, seed=9, logprobs=True, top_logprobs=6
    )
    logprobs, _, seen = run_capturing_logits(engine, chat_ids("Name a colour."), params)
    for lp, logits in zip(logprobs, seen, strict=True):
        scaled = logits.float() / 0.7
        kept = torch.topk(scaled, 4)
        ref = torch.log_softmax(kept.values, dim=-1)
        assert lp.token_id in kept.indices.tolist()
        where = kept.indices.tolist().index(lp.token_id)
        assert abs(lp.logprob - float(ref[where])) < 1e-5
        assert [t for t, _ in lp.top] == kept.indices.tolist()  # the top-k alone, no -inf


def test_the_same_tokens_with_logprobs_as_without(make_engine, chat_ids):
    ids = chat_ids("Write a haiku about rain.")
    for params in (
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=4),
    ):
        engine = make_engine()
        plain = engine.generate({"plain": ids}, params)["plain"]
        asked = engine.generate(
            {"asked": ids}, SamplingParams(**{**params.__dict__, "logprobs": True})
        )["asked"]
        assert asked == plain
