"""A model whose every layer slides keeps no KV pages past its window: a tiny Mistral with a
16-token window, in pages of 8, generates well past it through the engine and answers what
transformers does, holding at most 3 pages a sequence where it would hold 10."""

from __future__ import annotations

import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.errors import RequestTooLargeError
from gpu_node.models.hf_checkpoint import HFCheckpoint, load_hf_model
from gpu_node.models.tokenizer import ChatTokenizer
from scheduler.block_manager import FREE, RELEASED_PAGE, pages_for, sequence_tag
from scheduler.sequence import SamplingParams, Sequence
from tests.gpu_node.models.hf_tiny import hf_model, write_checkpoint, write_tokenizer
from tests.gpu_node.models.test_hf_checkpoint import PROMPT, PROMPTS

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


def make_engine(directory, num_pages=64, **settings) -> LLMEngine:
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
    engine = make_engine(directory)
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
    engine = make_engine(directory, num_pages)
    for name, ids in PROMPTS:
        engine.add_request(name, ids, SamplingParams(max_tokens=40, ignore_eos=True))
    results: dict[str, list[int]] = {name: [] for name, _ in PROMPTS}
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
    assert results == greedy(hf, PROMPTS, 40)
    assert sum(pages_for(len(ids) + 39, 8) for _, ids in PROMPTS) == 25
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
    engine = make_engine(directory)
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
    prefill, decode = make_engine(directory), make_engine(directory)
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
    engine = make_engine(directory, num_pages=3)  # 24 tokens, 3 pages: one window's
    assert engine.max_request_tokens == engine.max_model_len == 512
    engine.add_request("plain", PROMPT * 2, SamplingParams(max_tokens=100))
    with pytest.raises(RequestTooLargeError, match=r"prompt \(40 tokens\) exceeds the 23 tokens"):
        engine.add_request("pre", PROMPT * 2, SamplingParams(max_tokens=1), prefill_only=True)


def test_prefix_caching_is_off_where_pages_are_released(mistral, gemma3):
    assert make_engine(mistral[0], prefix_cache_blocks=8).prefix_cache is None
    assert make_engine(gemma3[0], prefix_cache_blocks=8).prefix_cache is not None
    assert make_engine(gemma3[0], num_pages=3).max_request_tokens == 24  # the pool's tokens
