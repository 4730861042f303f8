"""Log-probabilities the engine reports: those of the distribution each token was drawn
from (gpu_node/engine/sampler.py), checked against the engine's own logits (real SmolLM2
weights, fp32 KV)."""

from __future__ import annotations

import torch

from common.node_api import GrammarSpec
from scheduler.sequence import SamplingParams


def run_capturing_logits(engine, ids, params, grammar=None):
    """Runs one request; its outputs' logprobs, tokens and the logits row of each step
    (as the sampler saw them: after the grammar's mask)."""
    seen: list[torch.Tensor] = []
    mask = engine._mask

    def capture(chunks, logits):
        mask(chunks, logits)
        seen.append(logits[0].clone())

    engine._mask = capture
    engine.add_request("r", ids, params, grammar=grammar)
    logprobs, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            logprobs += list(out.logprobs or ())
            tokens += list(out.token_ids)
    return logprobs, tokens, seen


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


def test_a_handed_off_request_keeps_its_first_tokens_logprob(make_engine, chat_ids):
    from gpu_node.engine.handoff import KVHandoff

    ids = chat_ids("Name a colour.")
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)
    engine = make_engine()
    alone, _, _ = run_capturing_logits(engine, ids, params)
    engine.add_request("p", ids, params, prefill_only=True)
    (out,) = [o for _ in range(4) for o in engine.step()]
    assert out.logprobs == (alone[0],)
    handoff = KVHandoff.from_bytes(out.handoff.to_bytes())
    assert handoff.first_logprob == alone[0]
    engine.add_request("d", ids, params, handoff=handoff)
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got += list(o.logprobs or ())
    assert got == alone
