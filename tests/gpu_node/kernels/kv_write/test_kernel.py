"""KV write kernel vs `kv_write_ref` under the Triton interpreter: bit-exact, ownership exact."""

import os

import pytest
import torch

import gpu_node.kernels.kv_write.kernel as kv_write_module
from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    dequantize_rows,
    kv_pool,
    pool_strides,
    quantize_rows,
    scale_shape,
)
from gpu_node.kernels.kv_write.reference import kv_write_ref

kv_write = kv_write_module.kv_write

# CPU tensors through the interpreter; the compiled kernel on a GPU at the end of the file.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only: CPU tensors"
)
compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, not interpreted",
)

NUM_PAGES, PAGE_SIZE = 6, 16
# Pages 0, 1, 5 belong to tag 7; 2, 3 to tag 9; 4 is free.
OWNER = torch.tensor([7, 7, 9, 9, -1, 7])


def make_cache(dtype, num_kv_heads, head_dim):
    """A poisoned cache: any row the write leaves alone keeps a recognisable value."""
    shape = (NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
    if dtype == FP8_DTYPE:
        cache = torch.full(shape, 0x5A, dtype=torch.uint8).view(FP8_DTYPE)
        scale = torch.full(
            scale_shape(NUM_PAGES, PAGE_SIZE, num_kv_heads), 99, dtype=torch.bfloat16
        )
        return cache, cache.clone(), scale, scale.clone()
    cache = torch.full(shape, -7.0, dtype=dtype)
    return cache, cache.clone(), None, None


def run_both(key, value, slot_mapping, token_tags, dtype):
    results = []
    for write in (kv_write, kv_write_ref):
        k_cache, v_cache, k_scale, v_scale = make_cache(dtype, key.shape[1], key.shape[2])
        flags = write(
            key, value, k_cache, v_cache, slot_mapping, OWNER, token_tags, k_scale, v_scale
        )
        results.append((flags, k_cache, v_cache, k_scale, v_scale))
    return results


def as_bits(t):
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def hard_values(num_tokens, num_kv_heads, head_dim, dtype):
    """K/V rows that stress the rounding: values just below powers of two and tiny ones,
    an all-zero row, and row maxima from 1e-3 to 1e3."""
    torch.manual_seed(1)
    x = torch.randn(num_tokens, num_kv_heads, head_dim)
    x *= torch.logspace(-3, 3, num_tokens).view(-1, 1, 1)
    x[0, 0, :8] = torch.tensor([31.88, -7.87, 1.9686, 0.2499, 447.9, 1e-3, -3e-4, 15.99])
    x[1, -1] = 0.0
    return x.to(dtype)


@interpreted
def test_scales_are_stored_page_then_head_then_offset():
    """The [P, H, S] layout: token slot 2 * 16 + 5, head h -> k_scale[2, h, 5], nothing else."""
    # A row along dim 0 rotates to a constant row (H_D's first column is all ones): its
    # max maps onto code 127 (keys: scales 1, 2, 4; values: 0.5, 1, 2).
    key = torch.zeros(1, 3, 64)
    key[0, :, 0] = torch.tensor([127.0, 2 * 127.0, 4 * 127.0])
    value = torch.zeros(1, 3, 64)
    value[0, :, 0] = torch.tensor([63.5, 127.0, 2 * 127.0])
    slot = torch.tensor([2 * PAGE_SIZE + 5])
    for write in (kv_write, kv_write_ref):
        k_cache, v_cache, k_scale, v_scale = make_cache(FP8_DTYPE, 3, 64)
        flags = write(
            key, value, k_cache, v_cache, slot, OWNER, torch.tensor([9]), k_scale, v_scale
        )
        assert flags.tolist() == [False]
        assert k_scale[2, :, 5].tolist() == [1.0, 2.0, 4.0]
        assert v_scale[2, :, 5].tolist() == [0.5, 1.0, 2.0]
        untouched = torch.ones_like(k_scale, dtype=torch.bool)
        untouched[2, :, 5] = False
        assert bool((k_scale[untouched] == 99).all()) and bool((v_scale[untouched] == 99).all())


@pytest.mark.parametrize(
    ("cache_dtype", "input_dtype", "num_kv_heads", "head_dim"),
    [
        (FP8_DTYPE, torch.bfloat16, 3, 64),
        (FP8_DTYPE, torch.float32, 2, 32),
        (FP8_DTYPE, torch.float16, 1, 128),
        (torch.bfloat16, torch.bfloat16, 3, 64),
        (torch.float16, torch.float32, 4, 32),
        (torch.float32, torch.float32, 3, 64),
    ],
)
@interpreted
def test_kernel_equals_reference_bit_for_bit(cache_dtype, input_dtype, num_kv_heads, head_dim):
    num_tokens = 13
    key = hard_values(num_tokens, num_kv_heads, head_dim, input_dtype)
    value = -2.0 * key
    # Owned slots of tag 7 (pages 0, 1, 5), partly filling page 5.
    slot_mapping = torch.tensor([0, 1, 15, 16, 17, 31, 80, 81, 82, 83, 84, 85, 86])
    token_tags = torch.full((num_tokens,), 7)
    (flags, *kernel), (flags_ref, *ref) = run_both(
        key, value, slot_mapping, token_tags, cache_dtype
    )
    assert flags.tolist() == [False] * num_tokens
    assert torch.equal(flags, flags_ref)
    for got, want in zip(kernel, ref, strict=True):
        if want is not None:
            assert torch.equal(as_bits(got), as_bits(want))
    # The written rows hold the new data; every other row kept its poison.
    k_cache = kernel[0]
    written = torch.zeros(NUM_PAGES * PAGE_SIZE, dtype=torch.bool)
    written[slot_mapping] = True
    rows = as_bits(k_cache).view(NUM_PAGES * PAGE_SIZE, -1)
    poison = 0x5A if cache_dtype == FP8_DTYPE else -7.0
    assert bool((rows[~written] == poison).all())


@interpreted
def test_keys_and_values_are_int8_codes_of_the_rotated_row():
    """K and V bytes are int8 codes of H_D k and H_D v (kv_quant.quantize_rows)."""
    key = hard_values(4, 2, 64, torch.float32)
    value = key.flip(0) * 3.0
    slots = torch.tensor([0, 1, 2, 3])
    k_cache, v_cache, k_scale, v_scale = make_cache(FP8_DTYPE, 2, 64)
    kv_write(key, value, k_cache, v_cache, slots, OWNER, torch.full((4,), 7), k_scale, v_scale)
    for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, scales = quantize_rows(rows)
        assert torch.equal(as_bits(cache[0, :4]), as_bits(codes))
        assert torch.equal(scale[0, :, :4], scales.T)
        restored = dequantize_rows(cache[0, :4], scale[0, :, :4].T, torch.float32)
        assert float((restored - rows).norm() / rows.norm()) < 0.01


@interpreted
def test_fp8_pools_need_a_power_of_two_head_dim():
    k_cache, v_cache, k_scale, v_scale = make_cache(FP8_DTYPE, 2, 48)
    key = torch.zeros(1, 2, 48)
    for write in (kv_write, kv_write_ref):
        with pytest.raises(ValueError, match="power-of-two head dim"):
            write(key, key, k_cache, v_cache, torch.tensor([0]), OWNER, torch.tensor([7]),
                  k_scale, v_scale)  # fmt: skip


@interpreted
def test_ownership_violations_are_flagged_and_not_written():
    num_kv_heads, head_dim = 3, 64
    key = hard_values(8, num_kv_heads, head_dim, torch.bfloat16)
    value = key + 1
    slot_mapping = torch.tensor([0, 40, 70, -1, 96, 1000, 17, 5 * 16 + 3])
    token_tags = torch.tensor([7, 7, 7, 7, 7, 7, 9, 7])
    # 0: page 0 owned by 7, ok. 40: page 2 belongs to 9. 70: page 4 is free.
    # -1: padding, skipped silently. 96 and 1000: past the last slot (95).
    # 17: page 1 belongs to 7, not 9. 83: page 5, ok.
    expected = [False, True, True, False, True, True, True, False]
    for dtype in (FP8_DTYPE, torch.bfloat16):
        (flags, k_cache, v_cache, *_), (flags_ref, *ref) = run_both(
            key, value, slot_mapping, token_tags, dtype
        )
        assert flags.tolist() == expected
        assert flags_ref.tolist() == expected
        assert torch.equal(as_bits(k_cache), as_bits(ref[0]))
        assert torch.equal(as_bits(v_cache), as_bits(ref[1]))
        # Exactly slots 0 and 83 changed.
        poison = 0x5A if dtype == FP8_DTYPE else -7.0
        rows = as_bits(k_cache).view(NUM_PAGES * PAGE_SIZE, -1)
        changed = (rows != poison).any(dim=1).nonzero().flatten().tolist()
        assert changed == [0, 83]


@interpreted
def test_ownership_check_off_writes_foreign_pages():
    key = hard_values(2, 3, 64, torch.bfloat16)
    k_cache, v_cache, _, _ = make_cache(torch.bfloat16, 3, 64)
    flags = kv_write(
        key,
        key,
        k_cache,
        v_cache,
        torch.tensor([40, 200]),
        OWNER,
        torch.tensor([7, 7]),
        check_owner=False,
    )
    assert flags.tolist() == [False, True]  # the range check stays on
    assert torch.equal(k_cache.view(-1, 3, 64)[40], key[0])


@interpreted
def test_no_tokens_is_a_no_op():
    k_cache, v_cache, k_scale, v_scale = make_cache(FP8_DTYPE, 3, 64)
    empty = torch.empty(0, 3, 64, dtype=torch.bfloat16)
    none = torch.empty(0, dtype=torch.int64)
    flags = kv_write(empty, empty, k_cache, v_cache, none, OWNER, none, k_scale, v_scale)
    assert flags.shape == (0,) and flags.dtype == torch.bool


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": torch.zeros(2, 4, 64)}, r"key must be \[T, 3, 64\]"),
        ({"slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping must be int64"),
        ({"token_tags": torch.tensor([7])}, "token_tags must be int64"),
        ({"k_scale": None}, "an fp8 cache needs k_scale"),
        (
            {"key": torch.zeros(2, 3, 64, dtype=torch.float64)},
            "key and value must share one of fp32/bf16/fp16",
        ),
    ],
)
@interpreted
def test_bad_input_raises_value_error(change, message):
    k_cache, v_cache, k_scale, v_scale = make_cache(FP8_DTYPE, 3, 64)
    args = {
        "key": torch.zeros(2, 3, 64),
        "value": torch.zeros(2, 3, 64),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": torch.tensor([0, 1]),
        "page_owner": OWNER,
        "token_tags": torch.tensor([7, 7]),
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kv_write(**args)


@interpreted
@pytest.mark.parametrize("cache_dtype", [FP8_DTYPE, torch.bfloat16])
def test_head_major_pools_hold_the_same_rows(cache_dtype):
    """A head-major pool (kv_pool(head_major=True): [P, H, S, D] in memory, indexed
    [P, S, H, D]) gets, from the kernel and from the reference, bit for bit the rows and
    scales a token-major pool gets (the kernel addresses rows by the pool's strides)."""
    num_kv_heads, head_dim, num_tokens = 3, 64, 13
    key = hard_values(num_tokens, num_kv_heads, head_dim, torch.bfloat16)
    value = -2.0 * key
    slot_mapping = torch.tensor([0, 1, 15, 16, 17, 31, 80, 81, 82, 83, 84, 85, 40])
    token_tags = torch.tensor([7] * 12 + [7])  # slot 40: page 2 is tag 9's -> refused
    (flags_tm, k_tm, v_tm, ks_tm, vs_tm), _ = run_both(
        key, value, slot_mapping, token_tags, cache_dtype
    )
    for write in (kv_write, kv_write_ref):
        k_cache, v_cache, k_scale, v_scale = make_cache(cache_dtype, num_kv_heads, head_dim)
        k_hm = kv_pool(NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim, cache_dtype, head_major=True)
        v_hm = kv_pool(NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim, cache_dtype, head_major=True)
        k_hm.copy_(k_cache)  # the same poison
        v_hm.copy_(v_cache)
        assert pool_strides(k_hm) == (head_dim, PAGE_SIZE * head_dim)
        flags = write(key, value, k_hm, v_hm, slot_mapping, OWNER, token_tags, k_scale, v_scale)
        assert flags.tolist() == [False] * 12 + [True]
        assert torch.equal(flags, flags_tm)
        assert torch.equal(as_bits(k_hm), as_bits(k_tm))
        assert torch.equal(as_bits(v_hm), as_bits(v_tm))
        if cache_dtype == FP8_DTYPE:
            assert torch.equal(k_scale, ks_tm) and torch.equal(v_scale, vs_tm)
        assert k_hm.permute(0, 2, 1, 3).is_contiguous()  # still head-major, written in place


@interpreted
def test_with_one_kv_head_both_orders_are_the_same_pool():
    """With one kv head the two orders are the same memory: either may be passed for K
    and V, and the rows land alike."""
    key = hard_values(3, 1, 64, torch.bfloat16)
    slots = torch.tensor([0, 17, 83])
    tags = torch.full((3,), 7)
    k_tm = make_cache(torch.bfloat16, 1, 64)[0]
    v_hm = kv_pool(NUM_PAGES, PAGE_SIZE, 1, 64, torch.bfloat16, head_major=True)
    v_hm.copy_(k_tm)
    assert pool_strides(k_tm) == pool_strides(v_hm) == (64, 64)
    for write in (kv_write, kv_write_ref):
        k_cache, v_cache = k_tm.clone(), v_hm.clone()
        flags = write(key, key, k_cache, v_cache, slots, OWNER, tags)
        assert flags.tolist() == [False] * 3
        assert torch.equal(k_cache, v_cache)
        assert torch.equal(k_cache[1, 1, 0], key[1, 0])


@interpreted
def test_a_pool_in_another_memory_order_is_refused():
    k_cache = make_cache(torch.bfloat16, 3, 64)[0]
    strided = torch.zeros(NUM_PAGES, 3, 64, PAGE_SIZE, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    head_major = kv_pool(NUM_PAGES, PAGE_SIZE, 3, 64, torch.bfloat16, head_major=True)
    for bad_k, bad_v in ((strided, strided), (k_cache, head_major)):  # K and V differ
        with pytest.raises(
            ValueError, match=r"contiguous \[P, S, H, D\] tensors or \[P, H, S, D\]"
        ):
            kv_write(
                torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), bad_k, bad_v,
                torch.tensor([0]), OWNER, torch.tensor([7]),
            )  # fmt: skip


# The compiled kernel on a GPU: bit for bit its reference (fp8 pools' K and V rows as int8
# codes of the Hadamard-rotated row, both scales, in both memory orders).

GPU_NUM_PAGES = 8


def gpu_hard_values(num_tokens: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """Rows of every size (1e-3 .. 1e3), loud channels, an all-zero row, elements just
    below powers of two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= torch.logspace(-3, 3, num_tokens).view(-1, 1, 1)
    x[:, :, 5] = x[:, :, 5] * 3 - 13.5  # an outlier channel, as keys carry
    x[0, 0, :8] = torch.tensor([31.88, -7.87, 1.9686, 0.2499, 447.9, 1e-3, -3e-4, 15.99])
    x[1, -1] = 0.0
    return x.to(dtype)


@compiled
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(
    ("cache_dtype", "input_dtype", "num_kv_heads", "head_dim"),
    [
        (FP8_DTYPE, torch.bfloat16, 3, 64),  # SmolLM2
        (FP8_DTYPE, torch.float16, 8, 128),  # Llama-8B
        (FP8_DTYPE, torch.float32, 1, 256),  # Gemma 3 270M
        (FP8_DTYPE, torch.bfloat16, 2, 32),
        (torch.bfloat16, torch.bfloat16, 3, 64),
    ],
)
def test_compiled_kernel_equals_reference_bit_for_bit(
    cache_dtype, input_dtype, num_kv_heads, head_dim, head_major
):
    num_tokens = 40
    key = gpu_hard_values(num_tokens, num_kv_heads, head_dim, input_dtype, seed=head_dim)
    value = gpu_hard_values(num_tokens, num_kv_heads, head_dim, input_dtype, seed=head_dim + 1)
    slots = torch.randperm(GPU_NUM_PAGES * PAGE_SIZE, generator=torch.Generator().manual_seed(3))
    slots = slots[:num_tokens]
    slots[7] = -1  # padding: skipped
    tags = torch.full((num_tokens,), 7)
    owner = torch.full((GPU_NUM_PAGES,), 7)
    results = []
    for write, device in ((kv_write, "cuda"), (kv_write_ref, "cpu")):
        shape = (GPU_NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
        k_cache = kv_pool(*shape, cache_dtype, device, head_major=head_major)
        v_cache = kv_pool(*shape, cache_dtype, device, head_major=head_major)
        scales = [None, None]
        if cache_dtype == FP8_DTYPE:
            sshape = scale_shape(GPU_NUM_PAGES, PAGE_SIZE, num_kv_heads)
            scales = [torch.ones(sshape, dtype=torch.bfloat16, device=device) for _ in range(2)]
        flags = write(
            key.to(device), value.to(device), k_cache, v_cache, slots.to(device),
            owner.to(device), tags.to(device), *scales,
        )  # fmt: skip
        results.append([t.cpu() for t in (flags, k_cache, v_cache, *scales) if t is not None])
    for got, want in zip(*results, strict=True):
        bits = (lambda t: t.view(torch.uint8)) if got.dtype == FP8_DTYPE else (lambda t: t)
        assert torch.equal(bits(got), bits(want))
    if cache_dtype == FP8_DTYPE:  # and K and V come back close to what was written
        _, k_cache, v_cache, k_scale, v_scale = results[0]
        written = slots >= 0
        pages, offsets = slots[written] // PAGE_SIZE, slots[written] % PAGE_SIZE
        for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
            restored = dequantize_rows(
                cache[pages, offsets], scale[pages, :, offsets], torch.float32
            )
            want = rows[written].float()
            error = (restored - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
            assert float(error.max()) < 0.02
