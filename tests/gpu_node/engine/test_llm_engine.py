"""The engine on the real SmolLM2 weights: answers, batching, preemption, cancellation, bad input."""

import pytest

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.errors import InvalidRequestError, ModelNotFoundError, RequestTooLargeError
from scheduler.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the ocean and the creatures that live in it.",
    "Count from one to five.",
    "Explain in simple words why the sky looks blue during the day, please.",
    "What is 2 + 2?",
    "Give me a short tip for learning to play the guitar as an adult beginner who practises daily.",
]


def run_alone(make_engine, ids, params=GREEDY):
    engine = make_engine()
    return engine.generate({"x": ids}, params)["x"]


def test_capital_of_france_names_paris(make_engine, chat_ids):
    engine = make_engine()
    out = engine.generate(
        {"q": chat_ids("What is the capital of France?")}, SamplingParams(max_tokens=20)
    )
    text = engine.tokenizer.decode(out["q"])
    assert "Paris" in text
    assert engine.stats().num_free_pages == engine.stats().num_pages


def test_batch_invariance_with_staggered_joins(make_engine, chat_ids):
    prompts = [chat_ids(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    alone = [run_alone(make_engine, p) for p in prompts]

    engine = make_engine(max_num_batched_tokens=64)  # long prompts prefill in chunks
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:  # a new request joins every other step
            i, ids = pending.pop(0)
            engine.add_request(str(i), ids, GREEDY)
            got[str(i)] = []
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
        step += 1
    assert [got[str(i)] for i in range(len(prompts))] == alone
    assert engine.stats().num_free_pages == engine.stats().num_pages


def test_a_short_request_behind_a_long_prompt_answers_in_the_next_step(make_engine, chat_ids):
    long_ids, short_ids = chat_ids(" ".join(PROMPTS * 3)), chat_ids("Hi")
    assert len(short_ids) == 31 and len(long_ids) > 225
    engine = make_engine(max_num_batched_tokens=128)  # long: more than 32 tokens left
    engine.add_request("long", long_ids, GREEDY)
    got: dict[str, list[int]] = {"long": [], "short": []}
    first_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        if step == 1:
            engine.add_request("short", short_ids, GREEDY)
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            first_at.setdefault(out.request_id, step)
        step += 1
    # Step 0: long 128. Step 1: long 32 + short's 31 + the 65 left to long. Then long 127
    # a step beside short's decode token.
    assert first_at == {"short": 1, "long": 1 + -(-(len(long_ids) - 225) // 127)}
    assert got == {
        "long": run_alone(make_engine, long_ids),
        "short": run_alone(make_engine, short_ids),
    }


def test_preemption_under_a_small_pool_keeps_greedy_output(make_engine, chat_ids):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = {str(i): chat_ids(p) for i, p in enumerate(PROMPTS[:4])}
    alone = {rid: run_alone(make_engine, ids, params) for rid, ids in prompts.items()}
    # each request needs 5-6 pages of 16 tokens at its end; 12 pages cannot hold four
    engine = make_engine(num_pages=12)
    got = engine.generate(prompts, params)
    assert engine.stats().num_preemptions > 0
    assert got == alone
    assert engine.stats().num_free_pages == 12


def test_cancel_frees_pages_at_once(make_engine, chat_ids):
    engine = make_engine()
    engine.add_request("a", chat_ids("Tell me a long story."), SamplingParams(max_tokens=100))
    engine.add_request("b", chat_ids("Hi"), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_pages < engine.stats().num_pages
    final = engine.abort("a")
    assert final.finished and final.finish_reason == "cancelled"
    assert final.num_completion_tokens == 3
    assert engine.abort("a") is None
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_free_pages == engine.stats().num_pages


def test_stop_conditions(make_engine, chat_ids):
    engine = make_engine()
    ids = chat_ids("What is the capital of France?")
    outs = []
    engine.add_request("len", ids, SamplingParams(max_tokens=3))
    engine.add_request("eos", ids, SamplingParams(max_tokens=50))
    engine.add_request("stop", ids, SamplingParams(max_tokens=50, stop=("France",)))
    while engine.has_unfinished():
        outs.extend(engine.step())
    final = {o.request_id: o for o in outs if o.finished}
    text = {rid: "".join(o.text for o in outs if o.request_id == rid) for rid in final}
    assert final["len"].finish_reason == "length" and final["len"].num_completion_tokens == 3
    assert final["eos"].finish_reason == "stop"
    assert text["eos"] == "The capital of France is Paris."
    assert final["eos"].token_ids[-1] in engine.tokenizer.stop_token_ids
    assert final["stop"].finish_reason == "stop" and text["stop"] == "The capital of "
    assert final["eos"].num_prompt_tokens == len(ids)


def test_seeded_sampling_is_reproducible(make_engine, chat_ids):
    ids = chat_ids("Write a haiku about the sea.")
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True
    )
    first = run_alone(make_engine, ids, params)
    engine = make_engine()
    engine.add_request(
        "other", chat_ids("Hi"), SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    )
    engine.add_request("same", ids, params)
    got = {"same": [], "other": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    assert got["same"] == first
    different = run_alone(make_engine, ids, SamplingParams(**{**params.__dict__, "seed": 43}))
    assert different != first


@pytest.mark.parametrize(
    ("prompt_len", "params", "message"),
    [
        (0, SamplingParams(), "the prompt is empty"),
        (10, SamplingParams(max_tokens=0), "max_tokens must be positive, got 0"),
        (10, SamplingParams(max_tokens=-3), "max_tokens must be positive, got -3"),
        (10, SamplingParams(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (
            10,
            SamplingParams(temperature=1.0, seed=2**64),
            f"seed must be in [-9223372036854775808, 18446744073709551615], got {2**64}",
        ),
        (
            500,
            SamplingParams(max_tokens=20),
            "prompt (500 tokens) + max_tokens (20) exceeds the context window of 512 tokens",
        ),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(
    make_engine, chat_ids, prompt_len, params, message
):
    engine = make_engine(max_model_len=512)
    ids = chat_ids("What is the capital of France?")
    engine.add_request("good", ids, SamplingParams(max_tokens=8))
    engine.step()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", [5] * prompt_len, params)
    assert message in str(err.value)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert "Paris" in "".join(o.text for o in outs)


def test_duplicate_request_id_and_out_of_vocab_tokens_are_rejected(make_engine):
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"must be in \[0, 49152\)"):
        engine.add_request("b", [1, 49152], SamplingParams(max_tokens=2))


def test_request_larger_than_the_pool_is_rejected(make_engine):
    engine = make_engine(num_pages=4)
    with pytest.raises(RequestTooLargeError) as refused:
        engine.add_request("a", [1] * 60, SamplingParams(max_tokens=20))
    assert str(refused.value) == (
        "prompt (60 tokens) + max_tokens (20) exceeds the 64 tokens this node's KV cache holds "
        "(context window 8192)"
    )


def test_unknown_model_and_bad_gguf(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'"):
        LLMEngine.from_config(EngineConfig(model="nope"))
    with pytest.raises(ModelNotFoundError, match="no GGUF file at"):
        LLMEngine.from_config(EngineConfig(model=str(tmp_path / "missing.gguf")))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelNotFoundError, match="is not a readable GGUF file"):
        LLMEngine.from_config(EngineConfig(model=str(junk)))


def test_engine_config_names_the_bad_field():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int3")


def test_final_output_carries_the_engine_events(make_engine, chat_ids):
    engine = make_engine(num_pages=8)
    ids = chat_ids("Hi")
    assert len(ids) == 31  # 2 pages of 16; with 2 output tokens in cache, 33 tokens: 3 pages
    engine.add_request("a", ids, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert all(o.events == () for o in outs[:-1])
    events = outs[-1].events
    assert [(e.name, e.num_pages) for e in events] == [
        ("queued", 0),
        ("admitted", 2),
        ("first_token", 2),
        ("finished", 3),
    ]
    assert [e.time_ns for e in events] == sorted(e.time_ns for e in events)


def test_a_stop_string_of_multibyte_characters_never_leaks_its_start(make_engine) -> None:
    """Emoji arrive over several tokens; until one is whole its bytes decode as U+FFFD, which
    must not count as text when holding back what may begin a stop string."""
    engine = make_engine()
    ids = engine.tokenizer.encode("Repeat exactly: I love 🍕 and 🍣 and 🍩 very much. I love")
    full = engine.tokenizer.decode(engine.generate({"f": ids}, SamplingParams(max_tokens=30))["f"])
    assert full.startswith(" 🍕🍩🍩")
    for stop, expected in (("🍕🍩", " "), (" 🍕", ""), ("🍩🍩", " 🍕")):
        engine.add_request(stop, ids, SamplingParams(max_tokens=30, stop=(stop,)))
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        assert "".join(o.text for o in outs) == expected, stop
        assert outs[-1].finish_reason == "stop"


def test_an_answer_cut_inside_a_character_sends_only_whole_characters(make_engine, chat_ids):
    """The 23rd and 24th tokens are the first bytes of an emoji the 25th completes: an answer
    cut there ends before it, never with U+FFFD."""
    engine, ids = make_engine(), chat_ids("Say hello in Spanish.")
    texts = {}
    for n in (22, 24, 25):
        engine.add_request(str(n), ids, SamplingParams(max_tokens=n))
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        texts[n] = "".join(o.text for o in outs)
        assert (outs[-1].finish_reason, outs[-1].num_completion_tokens) == ("length", n)
    assert texts == {22: "Hola in Spanish! 😊" + "🌍" * 5, 24: "Hola in Spanish! 😊" + "🌍" * 5,
                     25: "Hola in Spanish! 😊" + "🌍" * 6}  # fmt: skip


def test_a_request_whose_sampling_fails_fails_alone(make_engine, chat_ids, monkeypatch):
    """A fault injected into one request's sampling (none is known to happen now) ends that
    request with an error; the one beside it in every step answers as it would alone."""
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True)
    ids = chat_ids("Hi")
    alone = make_engine().generate({"ok": ids}, params)["ok"]
    real = LLMEngine._sample

    def failing(self, state, logits):
        if state.seq.request_id == "bad":
            raise RuntimeError("injected")
        return real(self, state, logits)

    monkeypatch.setattr(LLMEngine, "_sample", failing)
    engine = make_engine()
    engine.add_request("ok", ids, params)
    engine.add_request("bad", ids, params)
    outs: dict[str, list] = {"ok": [], "bad": []}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    (bad,) = outs["bad"]
    assert (bad.finish_reason, bad.error, bad.num_completion_tokens) == (
        "error",
        "sampling failed: RuntimeError",
        0,
    )
    assert [t for o in outs["ok"] for t in o.token_ids] == alone
    assert engine.stats().num_free_pages == engine.stats().num_pages
