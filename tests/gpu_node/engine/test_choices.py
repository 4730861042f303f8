"""n choices of one prompt (LLMEngine.add_request's `n`): the prompt is computed once,
each choice samples on its own (real SmolLM2 weights)."""

from __future__ import annotations

from scheduler.sequence import SamplingParams


def run(engine, rid, ids, params, n):
    engine.add_request(rid, ids, params, n=n)
    got: dict[int, list[int]] = {}
    finished: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            got.setdefault(out.index, []).extend(out.token_ids)
            if out.finished:
                finished.append(out.index)
    return got, finished


def test_three_seeded_choices_are_three_answers_from_one_prefill(make_engine, chat_ids):
    ids = chat_ids("Write a short poem about the sea.")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    engine = make_engine()
    got, finished = run(engine, "r", ids, params, n=3)
    assert sorted(finished) == [0, 1, 2]
    assert len({tuple(tokens) for tokens in got.values()}) == 3
    # The prompt ran once; every other token computed is a decode step (a choice's last
    # token is never run).
    assert engine.num_computed_tokens == len(ids) + sum(len(t) - 1 for t in got.values())
    # choice i is the request with seed + i, as if it had run alone
    alone = engine.generate({"x": ids}, SamplingParams(max_tokens=20, temperature=1.0, seed=8))
    assert got[1] == alone["x"]
    assert engine.stats().num_free_pages == engine.block_manager.num_pages


def test_a_cancel_ends_every_choice(make_engine, chat_ids):
    engine = make_engine()
    engine.add_request("r", chat_ids("Count to fifty."), SamplingParams(max_tokens=50), n=2)
    for _ in range(3):
        engine.step()
    assert "r#1" in engine._requests
    final = engine.abort("r")
    assert final is not None and final.finish_reason == "cancelled"
    assert not engine.has_unfinished()
    assert engine.stats().num_free_pages == engine.block_manager.num_pages


def test_every_choice_is_held_to_the_grammar(make_engine, chat_ids):
    from common.node_api import GrammarSpec

    engine = make_engine()
    colours = ["red", "green", "blue", "dark purple"]
    grammar = engine.grammars.compile(GrammarSpec(kind="choice", choices=colours))
    engine.add_request(
        "r",
        chat_ids("Name a colour."),
        SamplingParams(max_tokens=10, temperature=1.5, seed=1),
        grammar=grammar,
        n=4,
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.index] = texts.get(out.index, "") + out.text
            if out.finished:
                reasons[out.index] = out.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(t in colours for t in texts.values()), texts
    assert set(reasons.values()) == {"stop"}
