"""FP8 KV quantization arithmetic and capacity accounting (pure torch, exact values), and
the accuracy fp8 KV keeps on the real SmolLM2 (fp32 compute, the engine's paged attention)."""

import math
from pydoc_data.topics import topics

import pytest
import torch

from gpu_node.cache.kv_cache import KVCache
from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    bytes_per_token,
    dequantize_rotated,
    dequantize_rows,
    hadamard,
    kv_torch_dtype,
    pages_for_budget,
    quantize_rows,
    rotate,
    scale_shape,
    tokens_for_budget,
    validate_kv_layer,
)
from gpu_node.engine.attention import PagedAttention, StepMetadata

# SmolLM2-135M: 30 layers, 3 kv heads of dim 64.
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


def test_bytes_per_token_counts_scales():
    assert bytes_per_token("fp8", 3, 64, 16) == 2 * 3 * (64 + 2)  # 396: one bf16 scale a row
    assert bytes_per_token("bf16", 3, 64, 16) == 2 * 3 * 64 * 2  # 768
    assert bytes_per_token("fp16", 3, 64, 32) == 768
    assert bytes_per_token("fp32", 3, 64, 16) == 1536
    # The per-token layout has no per-page bytes: page size does not change the figure.
    assert bytes_per_token("fp8", 3, 64, 64) == 396


def test_fp8_admits_at_least_1_9x_the_tokens_of_bf16_at_one_budget():
    budget = 1 << 30  # 1 GiB of KV
    bf16 = tokens_for_budget(budget, "bf16", page_size=16, **SMOLLM2)
    fp8 = tokens_for_budget(budget, "fp8", page_size=16, **SMOLLM2)
    # bf16: 2**30 // (16 * 768 * 30) = 2912 pages; fp8: 2**30 // (16 * 396 * 30) = 5648 pages.
    assert bf16 == 2912 * 16 == 46592
    assert fp8 == 5648 * 16 == 90368
    assert pages_for_budget(budget, "fp8", page_size=16, **SMOLLM2) == 5648
    assert fp8 / bf16 >= 1.9  # 1.9396


def test_budget_smaller_than_one_page_gives_zero_tokens():
    assert tokens_for_budget(16 * 396 * 30 - 1, "fp8", page_size=16, **SMOLLM2) == 0
    assert tokens_for_budget(16 * 396 * 30, "fp8", page_size=16, **SMOLLM2) == 16


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kv_torch_dtype("int8"), "kv_dtype must be one of"),
        (lambda: bytes_per_token("fp8", 0, 64, 16), "num_kv_heads must be positive"),
        (lambda: tokens_for_budget(-1, "fp8", 30, 3, 64, 16), "budget_bytes must be >= 0"),
        (lambda: tokens_for_budget(10, "fp8", 0, 3, 64, 16), "num_layers must be positive"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_validate_kv_layer_names_the_problem():
    cache = torch.zeros(4, 16, 3, 64, dtype=FP8_DTYPE)
    scale = torch.zeros(scale_shape(4, 16, 3), dtype=torch.bfloat16)
    assert validate_kv_layer(cache, cache.clone(), scale, scale.clone()) == (4, 16, 3, 64)
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale"):
        validate_kv_layer(cache, cache.clone(), None, scale)
    with pytest.raises(ValueError, match=r"v_scale must be torch\.bfloat16"):
        validate_kv_layer(cache, cache.clone(), scale, scale.float())
    bf16 = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scales are for fp8 caches only"):
        validate_kv_layer(bf16, bf16.clone(), scale, scale)
    with pytest.raises(ValueError, match="must match"):
        validate_kv_layer(bf16, cache, None, None)


def test_hadamard_is_sylvesters_matrix_and_its_own_inverse_up_to_d():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h8 = torch.kron(torch.kron(h2, h2), h2)
    assert torch.equal(hadamard(torch.eye(8)), h8)  # symmetric: rows = columns
    x = torch.randn(5, 64)
    torch.testing.assert_close(hadamard(hadamard(x)) / 64, x)


def test_quantize_rows_round_trips_representable_rows_exactly():
    # Rows whose rotation is int8 codes (each row reaching 127) times a power-of-two scale.
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (6, 2, 64)).float()
    codes[..., 0] = 127.0
    scales = torch.tensor([2.0**-7, 1.0, 8.0]).repeat(4)[:12].view(6, 2)
    rows = hadamard(codes * scales[..., None]) / 64  # exact: small integers, powers of two
    stored, scale = quantize_rows(rows)
    assert stored.dtype == FP8_DTYPE and scale.dtype == torch.bfloat16
    assert torch.equal(stored.view(torch.int8).float(), codes)
    assert torch.equal(scale.float(), scales)
    assert torch.equal(dequantize_rows(stored, scale, torch.float32), rows)


def test_quantize_rows_error_is_within_half_a_code_step():
    torch.manual_seed(3)
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 3, 64).view(64, 1, 1)  # rows of every size
    x[0] = 0.0  # an all-zero row: the floor scale, codes 0
    stored, scale = quantize_rows(x)
    assert stored.shape == (64, 3, 64) and scale.shape == (64, 3)
    assert torch.equal(stored[0].view(torch.int8), torch.zeros(3, 64, dtype=torch.int8))
    assert torch.equal(scale[0].float(), torch.full((3,), 2.0**-126))
    y = hadamard(x)
    codes = stored.view(torch.int8).float()
    s = scale.float().unsqueeze(-1)
    # Rotated: each value within half a step of its code, or saturated at +-127 where the
    # bf16 scale rounded below amax / 127 (by at most 2**-8 of it).
    err = (codes * s - y).abs()
    assert bool((err <= s / 2 + y.abs() * 2.0**-8).all())
    assert int(codes.abs().amax(-1).min()) == 0 and int(codes.abs().amax(-1)[1:].min()) >= 126
    # Back in the row's basis the error spreads over all D dims: its norm is that of the
    # rotated error over sqrt(D).
    restored = dequantize_rows(stored, scale, torch.float32)
    torch.testing.assert_close(
        (restored - x).norm(dim=-1), err.norm(dim=-1) / 8, rtol=1e-4, atol=1e-30
    )


def test_rotated_queries_score_stored_keys_as_the_keys():
    torch.manual_seed(1)
    keys, q = torch.randn(7, 3, 64) * 5, torch.randn(7, 3, 64)
    stored, scale = quantize_rows(keys)
    direct = (q * dequantize_rows(stored, scale, torch.float32)).sum(-1)
    rotated = (rotate(q) * dequantize_rotated(stored, scale, torch.float32)).sum(-1)
    torch.testing.assert_close(rotated, direct, atol=1e-4, rtol=1e-5)


def test_sums_of_stored_values_rotate_back_to_the_sums_of_the_values():
    """sum_i p_i v_i = H_D (sum_i p_i H_D v_i) / D: the decode kernels sum V rows as stored
    and the merge rotates the output once."""
    torch.manual_seed(4)
    values, p = torch.randn(40, 2, 128) * 3, torch.rand(40, 2).softmax(0)
    stored, scale = quantize_rows(values)
    direct = (p[..., None] * dequantize_rows(stored, scale, torch.float32)).sum(0)
    summed = (p[..., None] * dequantize_rotated(stored, scale, torch.float32)).sum(0)
    torch.testing.assert_close(rotate(summed), direct, atol=1e-5, rtol=1e-5)


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x through e4m3 with a bf16 scale per row (max onto 448) and back."""
    scale = (x.abs().amax(-1, keepdim=True) / 448.0).to(torch.bfloat16).float()
    return (x / scale).clamp(-448.0, 448.0).to(FP8_DTYPE).float() * scale


def test_rotated_int8_rows_beat_e4m3_on_keys_and_values():
    """Keys with a few loud channels (SmolLM2's have |mean| up to 7x the spread) and plain
    Gaussian values: the rotated int8 codes' error is a fraction of e4m3's, same bytes."""
    torch.manual_seed(2)
    keys = torch.randn(512, 3, 64)
    keys[..., 46] = keys[..., 46] * 2 - 13.5
    keys[..., 39] += 4.7
    values = torch.randn(512, 3, 64)
    for rows, factor in ((keys, 3), (values, 2)):
        int8 = dequantize_rows(*quantize_rows(rows), torch.float32)
        e4m3_error = float((e4m3_rows(rows) - rows).norm() / rows.norm())
        int8_error = float((int8 - rows).norm() / rows.norm())
        assert int8_error < e4m3_error / factor, (int8_error, e4m3_error)


def test_fp8_pools_refuse_head_dims_that_are_not_powers_of_two():
    cache = torch.zeros(4, 16, 3, 48, dtype=FP8_DTYPE)
    scale = torch.zeros(scale_shape(4, 16, 3), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        validate_kv_layer(cache, cache.clone(), scale, scale.clone())


# --- accuracy on the real SmolLM2 --------------------------------------------------------
# Bounds from issue 43: fp8 KV within 0.3% perplexity of fp32 KV, and its greedy answers
# at least 90% as close to fp32 KV's as bf16 KV's are; and a KL bound that V rows in e4m3
# (6.3e-4 here) would break. Full figures: benchmarks/kv_accuracy.py (docs/benchmarks.md,
# "FP8 KV accuracy"); the greedy test takes six of its prompts, 16 tokens each.
PAGE_SIZE = 16


def new_pool(model, kv_dtype: str, num_tokens: int) -> KVCache:
    config = model.config
    num_pages = math.ceil(num_tokens / PAGE_SIZE)
    return KVCache(
        config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim, kv_dtype
    )


def feed(model, kv: KVCache, ids: list[int], start: int) -> torch.Tensor:
    """Positions start .. start + len(ids) - 1 of one sequence that owns the whole pool,
    through its pages (every position attends to K/V as the pool stores them): their
    next-token logits [T, V] in fp64."""
    count, end = len(ids), start + len(ids)
    metadata = StepMetadata(
        query_lens=[count],
        context_lens=[end],
        block_tables=torch.arange(kv.num_pages, dtype=torch.int32)[None, :],
        slot_mapping=torch.arange(start, end),
        seq_tags=torch.tensor([5]),
        token_seq=torch.zeros(count, dtype=torch.long),
        page_owner=torch.full((kv.num_pages,), 5),
    )
    attention = PagedAttention(kv, metadata, model.config.attention_scale)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(start, end), attention)
    assert int(attention.violations.sum()) == 0
    return logits.double()


@pytest.mark.slow
def test_fp8_kv_perplexity_and_kl_stay_near_fp32_kv(smollm2_parts):
    model, tokenizer = smollm2_parts
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text[:4096], add_special_tokens=False)[:512]
    targets = torch.tensor(ids[1:])
    log_probs = {
        kv: torch.log_softmax(feed(model, new_pool(model, kv, len(ids)), ids, 0)[:-1], dim=-1)
        for kv in ("fp32", "fp8")
    }
    nll = {kv: -float(lp.gather(1, targets[:, None]).mean()) for kv, lp in log_probs.items()}
    ref = log_probs["fp32"]
    kl = float((ref.exp() * (ref - log_probs["fp8"])).sum(-1).mean())
    # Measured: perplexity -0.08%, KL 2.2e-4 (V rows in e4m3: -0.11%, 6.3e-4).
    assert abs(math.exp(nll["fp8"] - nll["fp32"]) - 1) < 0.003
    assert kl < 4e-4


PROMPTS = (  # a few of benchmarks/kv_accuracy.py's
    "Why does ice float on liquid water?",
    "Describe the smell of rain in one sentence.",
    "Explain in simple terms what a binary search does.",
    "Tell me a fun fact about octopuses.",
    "What does a compiler do?",
    "Why do cats purr?",
)


def greedy(model, tokenizer, kv_dtype: str, prompt: str, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    kv = new_pool(model, kv_dtype, len(ids) + num_tokens)
    out = [int(feed(model, kv, ids, 0)[-1].argmax())]
    while len(out) < num_tokens:
        out.append(int(feed(model, kv, out[-1:], len(ids) + len(out) - 1)[-1].argmax()))
    return out


def shared(answer: list[int], reference: list[int]) -> float:
    common = next(
        (i for i, (a, b) in enumerate(zip(answer, reference, strict=True)) if a != b), None
    )
    return 1.0 if common is None else common / len(reference)


@pytest.mark.slow
def test_fp8_kv_greedy_answers_stay_as_close_to_fp32_kv_as_bf16s(smollm2_parts):
    model, tokenizer = smollm2_parts
    answers = {
        kv: [greedy(model, tokenizer, kv, p, 16) for p in PROMPTS] for kv in ("fp32", "bf16", "fp8")
    }
    closeness = {
        kv: sum(shared(a, b) for a, b in zip(answers[kv], answers["fp32"], strict=True))
        / len(PROMPTS)
        for kv in ("bf16", "fp8")
    }
    # Measured: bf16 and fp8 KV both repeat fp32 KV's six answers whole.
    assert closeness["fp8"] >= 0.9 * closeness["bf16"], closeness
