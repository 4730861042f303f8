"""The engine on the real SmolLM2 weights: answers, batching, preemption, cancellation, bad
input, n choices of one prompt (computed once, each sampling on its own). And a model whose
every layer slides keeps no KV pages past its window: a tiny Mistral with a 16-token window,
in pages of 8, generates well past it through the engine and answers what transformers does,
holding at most 3 pages a sequence where it would hold 10."""

import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.errors import InvalidRequestError, ModelNotFoundError, RequestTooLargeError
from gpu_node.models.hf_checkpoint import HFCheckpoint, load_hf_model
from gpu_node.models.tokenizer import ChatTokenizer
from scheduler.block_manager import FREE, RELEASED_PAGE, pages_for, sequence_tag
from scheduler.sequence import SamplingParams, Sequence
from tests.gpu_node.models.hf_tiny import PROMPT, hf_model, write_checkpoint, write_tokenizer
from tests.gpu_node.models.hf_tiny import PROMPTS as ID_PROMPTS

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


def test_an_engine_refuses_a_model_not_in_the_activations_asked_for(smollm2_parts):
    model, tokenizer = smollm2_parts  # fp32
    config = EngineConfig(model="smollm2", weights="bf16", activations="bf16", num_pages=8)
    with pytest.raises(ValueError) as info:
        LLMEngine(config, model, tokenizer)
    assert str(info.value) == (
        "activations bf16 asked for, but the model computes in fp32 (build it with "
        "build_model(..., activations='bf16'))"
    )


def run_choices(engine, rid, ids, params, n):
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
    got, finished = run_choices(engine, "r", ids, params, n=3)
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


WINDOW = 16
NUM_TOKENS = 60  # generated past a 20-token prompt: positions up to 79, five windows on


def greedy(hf, prompts, num_tokens):
    with torch.no_grad():
        return {
            name: hf.generate(
                torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                do_sample=False,
            )[0, len(ids) :].tolist()
            for name, ids in prompts
        }  # fmt: skip


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral checkpoint whose every layer has a 16-token window, and its model."""
    directory = tmp_path_factory.mktemp("mistral16")
    hf = hf_model("mistral")
    hf.config.sliding_window = WINDOW
    hf.save_pretrained(directory)
    write_tokenizer(directory)
    return directory, hf


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 checkpoint: sliding, global, sliding layers (window 8)."""
    directory = tmp_path_factory.mktemp("gemma3")
    return directory, write_checkpoint("gemma3", directory)


def make_windowed_engine(directory, num_pages=64, **settings) -> LLMEngine:
    config = EngineConfig(
        model=str(directory), weights="fp32", page_size=8, num_pages=num_pages,
        max_num_batched_tokens=16, long_prefill_tokens=0, **settings,
    )  # fmt: skip
    model = load_hf_model(HFCheckpoint(directory))
    return LLMEngine(config, model, ChatTokenizer.from_directory(directory))


def run_one(engine: LLMEngine, prompt: list[int], num_tokens: int):
    """Runs one greedy request to its end: its tokens and, after each step, the pages it
    holds and its live block-table entries."""
    engine.add_request("a", prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    seq: Sequence = engine.scheduler.waiting[0]
    tokens, held, tables = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
        held.append(seq.num_held_pages)
        tables.append(seq.block_table[seq.num_released_pages :])
    return tokens, held, tables


def test_mistral_past_its_window_decodes_what_transformers_does_in_three_pages(mistral):
    directory, hf = mistral
    engine = make_windowed_engine(directory)
    assert engine.block_manager.window == WINDOW
    tokens, held, tables = run_one(engine, PROMPT, NUM_TOKENS)
    assert tokens == greedy(hf, [("a", PROMPT)], NUM_TOKENS)["a"]
    # Steps 1-2 prefill 16 + 4 tokens; then one token a step. After the step that leaves
    # c tokens computed it holds pages (c - 15) // 8 .. (c - 1) // 8 (the next query, at c,
    # sees c - 15 .. c, and the page of c is taken when it runs): 2 or 3, never the 10
    # that 79 positions fill.
    assert held == [2, 3, 3, 3, 2, 2] + ([3] * 6 + [2, 2]) * 6 + [3] * 6 + [0]
    assert max(held) == engine.block_manager.max_held_pages(1) == 3
    assert pages_for(len(PROMPT) + NUM_TOKENS - 1, 8) == 10
    # Exact pages: page 0 goes back after step 5 (c = 23), page 3 is taken at step 7 for
    # position 24, and the pool hands pages out in order, so 10 pages serve 10 columns.
    assert tables[:8] == [[0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [1, 2], [1, 2], [1, 2, 3],
                          [1, 2, 3]]  # fmt: skip
    assert tables[-2] == [7, 8, 9]  # c = 78: pages 63 // 8 .. 77 // 8
    assert engine.stats().num_free_pages == 64 and engine.num_integrity_violations == 0


@pytest.mark.parametrize(
    ("num_pages", "num_preemptions", "peak_pages", "runs_together"),
    [(12, 0, 9, True), (5, 9, 5, True), (3, 0, 3, False)],
)
def test_batched_chunked_prefill_past_the_window_matches_transformers(
    mistral, num_pages, num_preemptions, peak_pages, runs_together
):
    """Three prompts (20, 18 and 31 tokens) and 40 tokens each, prefilled in chunks of 16
    beside the others' decodes: kept whole they would fill 8 + 8 + 9 = 25 pages. In 12
    pages all three run at once (9 at the peak); in 5, preemptions recompute past released
    pages; in 3 (24 tokens), each runs alone, a window's pages at a time."""
    directory, hf = mistral
    engine = make_windowed_engine(directory, num_pages)
    for name, ids in ID_PROMPTS:
        engine.add_request(name, ids, SamplingParams(max_tokens=40, ignore_eos=True))
    results: dict[str, list[int]] = {name: [] for name, _ in ID_PROMPTS}
    used = []
    released_and_reused = 0  # steps where a released entry names a page another holds
    seqs = list(engine.scheduler.waiting)
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].extend(out.token_ids)
        used.append(num_pages - engine.block_manager.num_free_pages)
        owner = int(engine.block_manager.page_owner_host[RELEASED_PAGE])
        released_and_reused += any(
            s.num_released_pages and owner not in (FREE, sequence_tag(s)) for s in seqs
        )
    assert results == greedy(hf, ID_PROMPTS, 40)
    assert sum(pages_for(len(ids) + 39, 8) for _, ids in ID_PROMPTS) == 25
    assert engine.stats().num_preemptions == num_preemptions
    assert max(used) == peak_pages
    assert engine.stats().num_free_pages == num_pages
    # Released columns name page 0, which others held meanwhile (where more than one ran at
    # once): the ownership checks never flag them.
    assert (released_and_reused > 0) == runs_together
    assert engine.num_integrity_violations == 0


def test_a_model_with_a_global_layer_keeps_every_page(gemma3):
    """Gemma 3's global layer reads every position: its pages stay to the end (10 for the
    run where the all-sliding Mistral holds 3)."""
    directory, hf = gemma3
    engine = make_windowed_engine(directory)
    assert engine.block_manager.window is None
    tokens, held, tables = run_one(engine, PROMPT, NUM_TOKENS)
    assert tokens == greedy(hf, [("a", PROMPT)], NUM_TOKENS)["a"]
    # The prompt's pages are taken at admission; then a page each 8 tokens, up to position 78.
    assert held == [pages_for(len(PROMPT), 8)] + [pages_for(c, 8) for c in range(20, 79)] + [0]
    assert held[-2] == 10 and tables[-2] == list(range(10))


def test_a_windowed_prompt_is_handed_off_whole_and_decoded_past_its_window(mistral):
    """A prefill for a decode node keeps its prompt's pages (it exports them all); the decode
    node imports them, releases what its window has passed and answers as one node does."""
    directory, hf = mistral
    prefill, decode = make_windowed_engine(directory), make_windowed_engine(directory)
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    prompt = PROMPT + PROMPT[:11]  # 31 tokens: past the window already
    prefill.add_request("a", prompt, params, prefill_only=True)
    seq = prefill.scheduler.waiting[0]
    outputs = []
    while prefill.has_unfinished():
        outputs.extend(prefill.step())
        if seq.block_table:
            assert seq.num_released_pages == 0
    (out,) = outputs
    assert out.finish_reason == "handoff" and out.handoff is not None
    assert [e.num_pages for e in out.events if e.name == "finished"] == [4]  # 31 tokens whole
    decode.add_request("a", prompt, params, handoff=out.handoff)
    arriving = decode.scheduler.waiting[0]
    first = decode.step()  # the handed-off first token, and the next
    # Admitted with the prompt's 4 pages and the next token's; after the import the query at
    # 31 sees 16 .. 31, so pages 0 and 1 went back at once.
    assert arriving.num_released_pages == 2 and arriving.num_held_pages == 2
    assert decode.stats().num_free_pages == 62
    tokens = [t for o in first for t in o.token_ids]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.token_ids]
    assert tokens == greedy(hf, [("a", prompt)], NUM_TOKENS)["a"]


def test_a_prompt_handed_off_must_fit_the_pool_whole(mistral):
    directory, _ = mistral
    engine = make_windowed_engine(directory, num_pages=3)  # 24 tokens, 3 pages: one window's
    assert engine.max_request_tokens == engine.max_model_len == 512
    engine.add_request("plain", PROMPT * 2, SamplingParams(max_tokens=100))
    with pytest.raises(RequestTooLargeError, match=r"prompt \(40 tokens\) exceeds the 23 tokens"):
        engine.add_request("pre", PROMPT * 2, SamplingParams(max_tokens=1), prefill_only=True)


def test_prefix_caching_is_off_where_pages_are_released(mistral, gemma3):
    assert make_windowed_engine(mistral[0], prefix_cache_blocks=8).prefix_cache is None
    assert make_windowed_engine(gemma3[0], prefix_cache_blocks=8).prefix_cache is not None
    assert (
        make_windowed_engine(gemma3[0], num_pages=3).max_request_tokens == 24
    )  # the pool's tokens
