"""FP8 KV in the engine: capacity arithmetic and answers on the real weights."""

from gpu_node.kv_cache import bytes_per_page
from scheduler.sequence import SamplingParams


def test_fp8_pool_holds_1_94x_the_tokens_of_bf16_at_one_budget(make_engine):
    budget = 64 * 1024 * 1024
    bf16 = make_engine(kv_dtype="bf16", num_pages=None, kv_memory_bytes=budget).stats()
    fp8 = make_engine(kv_dtype="fp8", num_pages=None, kv_memory_bytes=budget).stats()
    # SmolLM2: 30 layers, 3 kv heads, head dim 64, pages of 16 tokens.
    # bf16: 2 * 3 * 64 * 2 B = 768 B per token-layer -> 368,640 B a page -> 182 pages.
    # fp8:  2 * 3 * (64 + 2) B = 396 B per token-layer -> 190,080 B a page -> 353 pages.
    assert bytes_per_page("bf16", 30, 16, 3, 64) == 368_640
    assert bytes_per_page("fp8", 30, 16, 3, 64) == 190_080
    assert (bf16.num_pages, fp8.num_pages) == (182, 353)
    assert fp8.num_pages * 16 / (bf16.num_pages * 16) >= 1.9


def test_fp8_kv_still_answers_paris(make_engine, chat_ids):
    engine = make_engine(kv_dtype="fp8")
    out = engine.generate(
        {"q": chat_ids("What is the capital of France?")}, SamplingParams(max_tokens=20)
    )
    assert "Paris" in engine.tokenizer.decode(out["q"])
    assert (
        engine.kv_cache.k_cache[0].dtype.is_floating_point
        and engine.kv_cache.k_scale[0] is not None
    )
