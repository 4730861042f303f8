"""Paged decode attention kernel vs `paged_decode_attention_ref` under the Triton interpreter,
the ownership checks (kernel and torch), tags, and the prefill gather."""

import os
from dataclasses import dataclass, replace

import pytest
import torch

import gpu_node.kernels.paged_attention.dot as paged_attention_module
import gpu_node.kernels.paged_attention.split_merge as split_merge
from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    dequantize_rows,
    hadamard,
    kv_pool,
    pool_strides,
    quantize_rows,
    rotate,
    scale_shape,
)
from gpu_node.kernels.kv_write.reference import kv_write_ref
from gpu_node.kernels.paged_attention.reference import (
    check_page_ownership,
    gather_paged_kv,
    paged_decode_attention_ref,
)
from scheduler.block_manager import FREE, owner_tag

paged_decode_attention = paged_attention_module.paged_decode_attention
decode_tile_config = paged_attention_module.decode_tile_config
DecodeTile = paged_attention_module.DecodeTile
DotTuning = paged_attention_module.DotTuning

# The tests below build CPU tensors for the interpreter; compiled kernels (a native run
# with TRITON_INTERPRET=0) are checked on the GPU by the `on_gpu` tests instead.
is_interpreted = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not is_interpreted, reason="CPU tensors need TRITON_INTERPRET=1")
on_gpu = pytest.mark.skipif(
    is_interpreted or not torch.cuda.is_available(), reason="needs a CUDA GPU, not interpreted"
)

# Output dtype -> (atol, rtol). Both sides compute in fp32 from the same exactly
# dequantized K/V; what differs is summation order (~1e-6 relative) and, for 16-bit
# outputs, the final rounding, which may land one ulp apart (bf16 2**-8, fp16 2**-11).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-5, 2**-7),
    torch.float16: (1e-5, 2**-10),
}


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    page_owner: torch.Tensor
    seq_tags: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [L, H, D], as written
    values: list[torch.Tensor]

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.page_owner,
            self.seq_tags,
        )

    def scales(self):
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def build_batch(
    context_lens, *, cache_dtype, q_dtype, num_heads, num_kv_heads, head_dim, page_size, seed=0
):
    """Sequences on shuffled pages, written through `kv_write_ref`, with spare free pages
    and unused block-table columns full of stale page ids (they must be ignored)."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [(n + page_size - 1) // page_size for n in context_lens]
    num_pages = sum(pages_needed) + 3
    max_pages = max(pages_needed) + 1
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    k_scale = v_scale = None
    if cache_dtype == FP8_DTYPE:
        k_scale = torch.zeros(scale_shape(num_pages, page_size, num_kv_heads), dtype=torch.bfloat16)
        v_scale = torch.zeros_like(k_scale)
    page_owner = torch.full((num_pages,), FREE)
    seq_tags = torch.tensor([owner_tag(100 + i, 3) for i in range(len(context_lens))])
    block_tables = torch.randint(0, num_pages, (len(context_lens), max_pages), generator=gen)
    block_tables = block_tables.int()
    order = torch.randperm(num_pages, generator=gen)
    keys, values, used = [], [], 0
    for seq, (length, needed) in enumerate(zip(context_lens, pages_needed, strict=True)):
        pages = order[used : used + needed]
        used += needed
        block_tables[seq, :needed] = pages.int()
        page_owner[pages] = seq_tags[seq]
        # Keys with a few loud channels and tokens, as real keys have.
        key = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        key[:, :, :3] *= 8.0
        key[::7] *= 5.0
        value = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(length)
        slots = pages[positions // page_size] * page_size + positions % page_size
        tags = torch.full((length,), int(seq_tags[seq]))
        flags = kv_write_ref(
            key, value, k_cache, v_cache, slots, page_owner, tags, k_scale, v_scale
        )
        assert not flags.any()
        keys.append(key)
        values.append(value)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(q_dtype)
    return PagedBatch(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        torch.tensor(context_lens, dtype=torch.int32),
        page_owner,
        seq_tags,
        keys,
        values,
    )


CASES = [
    # cache dtype, q dtype, context lens, Q, H, D, page size, target programs (splits)
    (FP8_DTYPE, torch.bfloat16, [1, 17, 100, 33], 9, 3, 64, 16, 24),  # SmolLM2 heads
    (FP8_DTYPE, torch.float16, [130, 64, 1], 12, 2, 32, 64, 4),
    (torch.bfloat16, torch.bfloat16, [40, 3, 77], 8, 2, 48, 16, 8),  # D 48: a masked head dim
    (torch.bfloat16, torch.bfloat16, [5, 64, 31], 8, 2, 64, 32, 1),  # one split
    (torch.float16, torch.float16, [97, 3], 6, 1, 64, 48, 16),  # page size 48, G = 6
    (torch.float32, torch.float32, [16, 1, 47], 4, 4, 16, 16, 12),  # G = 1
]


@interpreted
# prefetch: fp8 full blocks load their page ids a block ahead, or ("scales") two blocks
# ahead and their scales one (16-bit pages ignore both)
@pytest.mark.parametrize(
    ("tokens_m", "prefetch"), [(False, False), (True, False), (True, True), (False, "scales")]
)
@pytest.mark.parametrize(
    ("cache_dtype", "q_dtype", "lens", "num_heads", "num_kv_heads", "head_dim", "page", "programs"),
    CASES,
)
def test_kernel_matches_reference(
    cache_dtype, q_dtype, lens, num_heads, num_kv_heads, head_dim, page, programs, tokens_m,
    prefetch,
):  # fmt: skip
    batch = build_batch(
        lens,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page,
    )
    out, violations = paged_decode_attention(
        *batch.args(), **batch.scales(), tuning=DotTuning(target_programs=programs,
        block_n=16, tokens_m=tokens_m, **prefetch_options(prefetch)),
    )  # fmt: skip
    q, *rest = batch.args()
    ref, ref_violations = paged_decode_attention_ref(
        kernel_query(q, cache_dtype), *rest, **batch.scales()
    )
    assert violations.tolist() == [False] * len(lens)
    assert ref_violations.tolist() == [False] * len(lens)
    assert out.dtype == q_dtype and out.shape == (len(lens), num_heads, head_dim)
    atol, rtol = TOLERANCE[q_dtype]
    torch.testing.assert_close(out, ref.to(q_dtype), atol=atol, rtol=rtol)


def kernel_query(q: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The query the kernel attends with: over fp8 pages it is rotated into the keys' basis
    and rounded to q's dtype (kv_quant.rotate); this rotates that one back in
    fp32 (H_D H_D = D I), so the reference sees what the kernel saw."""
    if cache_dtype != FP8_DTYPE:
        return q
    return hadamard(rotate(q).float())


def kernel_ref(batch: PagedBatch) -> torch.Tensor:
    """The reference's output for the query the kernel attends with, in q's dtype."""
    q, *rest = batch.args()
    out, _ = paged_decode_attention_ref(
        kernel_query(q, batch.k_cache.dtype), *rest, **batch.scales()
    )
    return out.to(q.dtype)


def head_major(batch: PagedBatch) -> PagedBatch:
    """The same batch with its pools copied into head-major ones (kv_pool)."""
    pools = []
    for cache in (batch.k_cache, batch.v_cache):
        pool = kv_pool(*cache.shape, cache.dtype, cache.device, head_major=True)
        pools.append(pool.copy_(cache))
    return replace(batch, k_cache=pools[0], v_cache=pools[1])


@interpreted
@pytest.mark.parametrize(
    ("cache_dtype", "q_dtype", "lens", "num_heads", "num_kv_heads", "head_dim", "page", "programs"),
    [CASES[0], CASES[1], CASES[2]],  # fp8 SmolLM2 heads, fp8 page size 64, bf16 D = 48
)
def test_head_major_pools_give_the_same_output(
    cache_dtype, q_dtype, lens, num_heads, num_kv_heads, head_dim, page, programs
):  # fmt: skip
    """The kernel reads a head-major pool by its strides: bit for bit the token-major
    result, and the reference agrees on both."""
    batch = build_batch(
        lens, cache_dtype=cache_dtype, q_dtype=q_dtype, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page,
    )  # fmt: skip
    moved = head_major(batch)
    assert pool_strides(moved.k_cache) == (head_dim, page * head_dim)
    tuning = DotTuning(target_programs=programs, block_n=16)
    out, violations = paged_decode_attention(*batch.args(), **batch.scales(), tuning=tuning)
    out_hm, violations_hm = paged_decode_attention(*moved.args(), **moved.scales(), tuning=tuning)
    assert torch.equal(out_hm, out)
    assert violations_hm.tolist() == violations.tolist() == [False] * len(lens)
    ref, _ = paged_decode_attention_ref(*batch.args(), **batch.scales())
    ref_hm, _ = paged_decode_attention_ref(*moved.args(), **moved.scales())
    assert torch.equal(ref_hm, ref)


def prefetch_options(prefetch) -> dict:
    return {"prefetch_pages": bool(prefetch), "prefetch_scales": prefetch == "scales"}


@interpreted
@pytest.mark.parametrize("prefetch", [False, True, "scales"])
@pytest.mark.parametrize("block_n", [32, 64])
def test_full_blocks_across_page_boundaries(block_n, prefetch):
    # Page size 48 does not divide the block: a full block starts inside a page and
    # spans parts of two or three pages, so its page ids are per token.
    batch = build_batch(
        [250, 97, 1], cache_dtype=FP8_DTYPE, q_dtype=torch.float32, num_heads=4,
        num_kv_heads=2, head_dim=32, page_size=48,
    )  # fmt: skip
    tuning = DotTuning(target_programs=6, block_n=block_n, **prefetch_options(prefetch))
    out, violations = paged_decode_attention(*batch.args(), **batch.scales(), tuning=tuning)
    ref, _ = paged_decode_attention_ref(*batch.args(), **batch.scales())
    assert violations.tolist() == [False, False, False]
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # Such blocks check ownership per token: a foreign page in the middle of sequence 0
    # (tokens 96-143, inside full blocks) flags it and no other.
    batch.block_tables[0, 2] = batch.block_tables[1, 0]
    out, violations = paged_decode_attention(*batch.args(), **batch.scales(), tuning=tuning)
    assert violations.tolist() == [True, False, False]
    torch.testing.assert_close(out[1:], ref[1:], atol=atol, rtol=rtol)


def test_reference_is_softmax_attention_over_the_written_tokens():
    """The reference against plain attention on the K/V as written (not via pages)."""
    batch = build_batch(
        [19, 1],
        cache_dtype=FP8_DTYPE,
        q_dtype=torch.float32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
    )
    ref, _ = paged_decode_attention_ref(*batch.args(), **batch.scales())
    for seq, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        # What fp8 storage keeps of them: exactly quantize -> dequantize.
        k = dequantize_rows(*quantize_rows(key), torch.float64).repeat_interleave(2, dim=1)
        v = dequantize_rows(*quantize_rows(value), torch.float64).repeat_interleave(2, dim=1)
        q = batch.q[seq].double()  # [Q, D]
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q, k) / 32**0.5, dim=-1)
        expected = torch.einsum("hl,lhd->hd", probs, v)
        torch.testing.assert_close(ref[seq].double(), expected, atol=1e-5, rtol=1e-5)


def fault_batch():
    """Four fp8 sequences of SmolLM2's head shape (9 query, 3 kv heads) to corrupt."""
    return build_batch(
        [3, 20, 100, 40],
        cache_dtype=FP8_DTYPE,
        q_dtype=torch.bfloat16,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        page_size=16,
    )


def inject(batch, fault):
    """Corrupt the batch one way; return the indices of the sequences that must be flagged."""
    if fault == "foreign_page":  # seq 1 reads a page of seq 2
        batch.block_tables[1, 0] = batch.block_tables[2, 1]
        return [1]
    if fault == "freed_page":  # seq 2's last page was freed under it
        batch.page_owner[batch.block_tables[2, 6]] = FREE
        return [2]
    if fault == "stale_generation":  # seq 0 was preempted and re-admitted: new generation
        batch.seq_tags[0] = owner_tag(100, 4)
        return [0]
    if fault == "page_out_of_range":
        batch.block_tables[3, 2] = batch.page_owner.shape[0]
        return [3]
    if fault == "negative_page":
        batch.block_tables[0, 0] = -1
        return [0]
    if fault == "context_past_block_table":  # 3 pages needed, block table has 8 columns
        batch.context_lens[3] = 8 * 16 + 1
        return [3]
    if fault == "two_sequences":  # one page handed to two sequences: seq 1, then seq 3
        batch.block_tables[3, 0] = batch.block_tables[1, 0]
        batch.page_owner[batch.block_tables[1, 0]] = batch.seq_tags[3]
        return [1]  # seq 3 owns the page now; it reads seq 1's data, so it is skipped below
    raise AssertionError(fault)


FAULTS = [
    "foreign_page",
    "freed_page",
    "stale_generation",
    "page_out_of_range",
    "negative_page",
    "context_past_block_table",
    "two_sequences",
]


# Each fault in the default blocks and in full (unmasked) blocks of 16 with one of the
# three ways of loading their page ids (and scales) ahead, in turn: every way meets two or
# three faults (the interpreter takes ~3 s a case; the whole 7 x 4 matrix took 2 minutes).
FULL_BLOCKS = [(16, False), (16, True), (16, "scales")]
OWNERSHIP_CASES = [(fault, None, False) for fault in FAULTS] + [
    (fault, *FULL_BLOCKS[i % len(FULL_BLOCKS)]) for i, fault in enumerate(FAULTS)
]


@interpreted
@pytest.mark.parametrize(("fault", "block_n", "prefetch"), OWNERSHIP_CASES)
def test_ownership_violations_flag_exactly_the_bad_sequence(fault, block_n, prefetch):
    batch = fault_batch()
    clean, _ = paged_decode_attention_ref(*batch.args(), **batch.scales())
    clean_kernel = kernel_ref(batch)
    bad = inject(batch, fault)
    expected = [i in bad for i in range(4)]
    checked = check_page_ownership(
        batch.block_tables, batch.context_lens, 16, batch.page_owner, batch.seq_tags
    )
    assert checked.tolist() == expected
    out, violations = paged_decode_attention(
        *batch.args(), **batch.scales(),
        tuning=DotTuning(target_programs=24, block_n=block_n, **prefetch_options(prefetch)),
    )  # fmt: skip
    assert violations.tolist() == expected
    ref, ref_violations = paged_decode_attention_ref(*batch.args(), **batch.scales())
    assert ref_violations.tolist() == expected
    # The sequences that did nothing wrong get exactly their fault-free answer.
    good = [i for i in range(4) if i not in bad and not (fault == "two_sequences" and i == 3)]
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out[good], clean_kernel[good], atol=atol, rtol=rtol)
    assert torch.equal(ref[good], clean[good])


def test_ownership_check_ignores_columns_past_the_context():
    page_owner = torch.tensor([5, 5, 6, FREE])
    block_tables = torch.tensor([[0, 1, 3, 2], [2, 3, 3, 0]], dtype=torch.int32)
    seq_tags = torch.tensor([5, 6])
    # Seq 0 uses 2 pages (32 tokens): columns 2, 3 (free, foreign) are not read.
    # Seq 1 uses 1 page at 16 tokens, 2 pages (page 3 is free) at 17.
    for lens, expected in (([32, 16], [False, False]), ([33, 17], [True, True])):
        context_lens = torch.tensor(lens, dtype=torch.int32)
        got = check_page_ownership(block_tables, context_lens, 16, page_owner, seq_tags)
        assert got.tolist() == expected


@interpreted
def test_check_off_skips_only_the_owner_comparison():
    batch = build_batch(
        [20, 30],
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=16,
    )
    batch.seq_tags[0] = owner_tag(7, 0)  # every page of seq 0 now looks foreign
    batch.block_tables[1, 0] = 999  # out of range stays a violation
    _, violations = paged_decode_attention(*batch.args(), check_owner=False)
    assert violations.tolist() == [False, True]


@pytest.mark.parametrize("cache_dtype", [FP8_DTYPE, torch.bfloat16])
def test_gather_paged_kv_returns_the_sequence_in_order(cache_dtype):
    batch = build_batch(
        [37, 5],
        cache_dtype=cache_dtype,
        q_dtype=torch.bfloat16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
    )
    k, v = gather_paged_kv(
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[0],
        37,
        torch.float32,
        batch.k_scale,
        batch.v_scale,
    )
    assert k.shape == v.shape == (37, 2, 32)
    if cache_dtype == FP8_DTYPE:
        expected_k = dequantize_rows(*quantize_rows(batch.keys[0]), torch.float32)
        expected_v = dequantize_rows(*quantize_rows(batch.values[0]), torch.float32)
    else:
        expected_k = batch.keys[0].to(cache_dtype).float()
        expected_v = batch.values[0].to(cache_dtype).float()
    assert torch.equal(k, expected_k)
    assert torch.equal(v, expected_v)
    batch.block_tables[0, 1] = -3
    with pytest.raises(ValueError, match=r"page id outside \[0, "):
        gather_paged_kv(
            batch.k_cache,
            batch.v_cache,
            batch.block_tables[0],
            37,
            torch.float32,
            batch.k_scale,
            batch.v_scale,
        )


def test_bad_shapes_raise_value_error():
    batch = build_batch(
        [4],
        cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
    )
    args = list(batch.args())
    with pytest.raises(ValueError, match="num_heads 3 must be a multiple of num_kv_heads 2"):
        paged_decode_attention(batch.q[:, :3].contiguous(), *args[1:])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(*args[:3], batch.block_tables.long(), *args[4:])
    with pytest.raises(ValueError, match=r"context_lens must be contiguous torch\.int32"):
        paged_decode_attention(*args[:4], batch.context_lens.long(), *args[5:])
    odd_pages = torch.zeros(2, 24, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_size must be a multiple of 16, got 24"):
        paged_decode_attention(batch.q, odd_pages, odd_pages.clone(), *args[3:])


def random_fault_trial(gen, fault):
    """Six sequences on shuffled pages; one fault aimed at a random victim. Returns the
    block tables, context lengths, owner table, tags and the victim's index."""
    lens = torch.randint(1, 200, (6,), generator=gen)
    needed = (lens + 15) // 16
    num_pages = int(needed.sum()) + 4
    order = torch.randperm(num_pages, generator=gen)
    block_tables = torch.zeros(6, int(needed.max()) + 1, dtype=torch.int32)
    page_owner = torch.full((num_pages,), FREE)
    seq_tags = torch.tensor([owner_tag(50 + i, generation=i) for i in range(6)])
    used = 0
    for seq in range(6):
        pages = order[used : used + int(needed[seq])]
        used += int(needed[seq])
        block_tables[seq, : len(pages)] = pages.int()
        page_owner[pages] = seq_tags[seq]
    victim, other = torch.randperm(6, generator=gen)[:2].tolist()
    column = int(torch.randint(0, int(needed[victim]), (1,), generator=gen))
    other_column = int(torch.randint(0, int(needed[other]), (1,), generator=gen))
    if fault == "foreign_page":  # the victim's block table points at another's page
        block_tables[victim, column] = block_tables[other, other_column]
    elif fault == "freed_page":  # a page freed under the running victim
        page_owner[block_tables[victim, column]] = FREE
    else:  # the allocator hands one of the victim's pages to another sequence too
        page_owner[block_tables[victim, column]] = seq_tags[other]
    return block_tables, lens.int(), page_owner, seq_tags, victim


@pytest.mark.parametrize("fault", ["foreign_page", "freed_page", "two_sequences"])
def test_randomized_faults_detected_in_100_of_100_trials(fault):
    gen = torch.Generator().manual_seed(1234)
    detected = 0
    for _ in range(100):
        block_tables, lens, page_owner, seq_tags, victim = random_fault_trial(gen, fault)
        flags = check_page_ownership(block_tables, lens, 16, page_owner, seq_tags)
        detected += flags.tolist() == [i == victim for i in range(6)]
    assert detected == 100


@interpreted
@pytest.mark.parametrize("fault", ["foreign_page", "freed_page", "two_sequences"])
def test_randomized_faults_detected_by_the_kernel(fault):
    """The kernel on a few of the same trials (the interpreter is slow; the GPU benchmark's
    check runs 100 per fault)."""
    gen = torch.Generator().manual_seed(99)
    for _ in range(3):
        block_tables, lens, page_owner, seq_tags, victim = random_fault_trial(gen, fault)
        num_pages = page_owner.shape[0]
        cache = torch.randn(num_pages, 16, 1, 16).bfloat16()
        q = torch.randn(6, 2, 16).bfloat16()
        _, flags = paged_decode_attention(
            q, cache, cache, block_tables, lens, page_owner, seq_tags,
            tuning=DotTuning(target_programs=12),
        )  # fmt: skip
        assert flags.tolist() == [i == victim for i in range(6)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@interpreted
@pytest.mark.parametrize("prefetch", [False, True, "scales"])
@pytest.mark.parametrize("bad_id", ["past_the_pool", -1, 2**31 - 1])
def test_bad_page_ids_in_full_blocks_are_flagged(bad_id, prefetch):
    """Unmasked blocks load a clamped page (memory-safe) and still flag the sequence."""
    batch = fault_batch()
    clean = kernel_ref(batch)
    page = batch.page_owner.shape[0] if bad_id == "past_the_pool" else bad_id
    # Columns 0 and 1 of the 100-token sequence: tokens 0-31, two full 16-token blocks
    # of its first split (the unmasked path), not its last, partial block.
    batch.block_tables[2, 0] = page
    batch.block_tables[2, 1] = page
    out, violations = paged_decode_attention(
        *batch.args(), **batch.scales(),
        tuning=DotTuning(target_programs=12, block_n=16, **prefetch_options(prefetch)),
    )  # fmt: skip
    assert violations.tolist() == [False, False, True, False]
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out[[0, 1, 3]], clean[[0, 1, 3]], atol=atol, rtol=rtol)


@interpreted
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("fault", ["foreign_page", "freed_page", "two_sequences"])
def test_ownership_faults_inside_multi_page_blocks_are_flagged(fault, block_n):
    """Blocks of two or four pages: a fault on any page of a block (here never its
    first) flags the sequence, and only it."""
    batch = fault_batch()
    clean = kernel_ref(batch)
    # Sequence 2 has 100 tokens: full blocks over tokens 0-95 (columns 0-5).
    if fault == "foreign_page":  # column 1: tokens 16-31, the second page of a block
        batch.block_tables[2, 1] = batch.block_tables[3, 0]
    elif fault == "freed_page":  # column 4: tokens 64-79
        batch.page_owner[batch.block_tables[2, 4]] = FREE
    else:  # column 3's page handed to sequence 0 as well, which now owns it
        batch.block_tables[0, 1] = batch.block_tables[2, 3]
        batch.page_owner[batch.block_tables[2, 3]] = batch.seq_tags[0]
        batch.context_lens[0] = 17  # sequence 0 reads its second page (now that one)
    out, violations = paged_decode_attention(
        *batch.args(), **batch.scales(),
        tuning=DotTuning(target_programs=24, block_n=block_n, prefetch_pages=True),
    )  # fmt: skip
    assert violations.tolist() == [False, False, True, False]
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out[[1, 3]], clean[[1, 3]], atol=atol, rtol=rtol)


@interpreted
@pytest.mark.parametrize("column", [None, 0, 3, 5, 6])
def test_ownership_check_covers_every_chunk_of_a_long_split(column, monkeypatch):
    """The check runs over a split's block-table columns in chunks (the first loaded
    before the attention loop, the rest after it): with 2 columns held and chunks of 2
    after, the 100-token sequence's 7 columns are 4 chunks, and a foreign page in any is
    found."""
    monkeypatch.setattr(paged_attention_module, "_HELD_BLOCK", 2)
    monkeypatch.setattr(paged_attention_module, "_CHECK_BLOCK", 2)
    batch = fault_batch()
    if column is not None:
        batch.block_tables[2, column] = batch.block_tables[3, 0]
    _, violations = paged_decode_attention(
        *batch.args(), **batch.scales(), tuning=DotTuning(target_programs=1, block_n=16)
    )
    assert violations.tolist() == [False, False, column is not None, False]


def test_tile_defaults_per_page_format():
    tile = decode_tile_config
    assert tile(False, 128) == DecodeTile(64, programs_per_sm=4, tokens_m=False, max_registers=0)
    assert tile(True, 64) == DecodeTile(
        128, programs_per_sm=8, tokens_m=False, max_registers=0, num_stages=3, prefetch_pages=True
    )
    assert tile(True, 128) == DecodeTile(
        64, programs_per_sm=16, tokens_m=True, max_registers=128, prefetch_scales=True
    )


def test_a_pool_needs_pages():
    batch = build_batch(
        [5, 9], cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, num_heads=4,
        num_kv_heads=2, head_dim=32, page_size=16,
    )  # fmt: skip
    q, k_cache, v_cache, tables, lens, _, tags = batch.args()
    empty = k_cache[:0], v_cache[:0]
    with pytest.raises(ValueError, match="the KV cache has no pages"):
        paged_decode_attention(q, *empty, tables, lens, torch.zeros(0, dtype=torch.int64), tags)


# Relative Frobenius error against the fp32 reference with 16-bit MMA operands
# and bf16 outputs (2**-8 rounding); the same bound as benchmarks/bench_paged_attention.py.
GPU_TOLERANCE = 8e-3


@on_gpu
@pytest.mark.parametrize(
    ("cache_dtype", "prefetch"),
    [(FP8_DTYPE, False), (FP8_DTYPE, True), (FP8_DTYPE, "scales"), (torch.bfloat16, False)],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128)])
def test_compiled_kernel_matches_reference_on_gpu(
    cache_dtype, prefetch, num_heads, num_kv_heads, head_dim
):
    batch = build_batch(
        [1, 17, 100, 4097, 33, 2000, 15, 16],
        cache_dtype=cache_dtype,
        q_dtype=torch.bfloat16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=16,
    )
    args = [t.cuda() for t in batch.args()]
    scales = {k: v if v is None else v.cuda() for k, v in batch.scales().items()}
    out, violations = paged_decode_attention(
        *args, **scales, tuning=DotTuning(**prefetch_options(prefetch))
    )
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert violations.tolist() == [False] * 8
    assert relative_error(out, ref) < GPU_TOLERANCE


@on_gpu
@pytest.mark.parametrize("cache_dtype", [FP8_DTYPE, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128)])
def test_compiled_kernel_reads_head_major_pools_on_gpu(
    cache_dtype, num_heads, num_kv_heads, head_dim
):
    batch = build_batch(
        [1, 17, 100, 4097, 33, 2000, 15, 16], cache_dtype=cache_dtype, q_dtype=torch.bfloat16,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16,
    )  # fmt: skip
    args = [t.cuda() for t in batch.args()]
    scales = {k: v if v is None else v.cuda() for k, v in batch.scales().items()}
    moved = head_major(replace(batch, k_cache=args[1], v_cache=args[2]))
    args_hm = [args[0], moved.k_cache, moved.v_cache, *args[3:]]
    out, violations = paged_decode_attention(*args, **scales, tuning=DotTuning())
    out_hm, violations_hm = paged_decode_attention(*args_hm, **scales, tuning=DotTuning())
    assert torch.equal(out_hm, out)
    assert violations_hm.tolist() == violations.tolist() == [False] * 8


@on_gpu
@pytest.mark.parametrize(
    ("block_n", "prefetch"), [(None, False), (16, False), (16, True), (16, "scales")]
)
@pytest.mark.parametrize("fault", FAULTS)
def test_compiled_kernel_flags_exactly_the_bad_sequence_on_gpu(fault, block_n, prefetch):
    batch = fault_batch()
    bad = inject(batch, fault)
    args = [t.cuda() for t in batch.args()]
    scales = {k: v.cuda() for k, v in batch.scales().items()}
    _, violations = paged_decode_attention(
        *args, **scales, tuning=DotTuning(block_n=block_n, **prefetch_options(prefetch))
    )
    assert violations.tolist() == [i in bad for i in range(4)]


@interpreted
def test_the_merge_never_launches_early_under_the_interpreter():
    """The interpreter cannot run griddepcontrol, whatever the tensors' device: the gate
    (shared by the merge, the W4A16 GEMV and the MoE GEMMs) answers before asking any
    GPU (this machine may have none)."""
    from gpu_node.kernels.launch import launches_early

    assert paged_attention_module.launches_early is launches_early
    launches_early.cache_clear()
    assert not launches_early(torch.device("cuda"))
    assert not launches_early(torch.device("cpu"))


@interpreted
def test_merge_writes_every_flag_and_output():
    """The merge overwrites all of `out` and `violations` (the callers pass them
    uninitialised): poisoned buffers come back exact."""
    batch, heads, splits, dim = 3, 4, 5, 16
    gen = torch.Generator().manual_seed(2)
    part_max = torch.randn(batch, heads, splits, generator=gen)
    part_max[1, :, 2:] = float("-inf")  # empty splits weigh nothing
    part_sum = torch.rand(batch, heads, splits, generator=gen) + 0.5
    part_acc = torch.randn(batch, heads, splits, dim, generator=gen)
    part_bad = torch.zeros(batch, splits, dtype=torch.int8)
    part_bad[2, 4] = 1
    out = torch.full((batch, heads, dim), float("nan"))
    violations = torch.ones(batch, dtype=torch.bool)
    split_merge.merge_splits(part_max, part_sum, part_acc, part_bad, out, violations)
    assert violations.tolist() == [False, False, True]
    weights = torch.exp2(part_max - part_max.amax(dim=2, keepdim=True))
    want = (part_acc * weights[..., None]).sum(2) / (part_sum * weights).sum(2)[..., None]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    # Over fp8 pages the sums are in the rows' rotated basis: each output row rotated back.
    out.fill_(float("nan"))
    split_merge.merge_splits(part_max, part_sum, part_acc, part_bad, out, violations, rotate=True)
    torch.testing.assert_close(out, hadamard(want) / dim, atol=1e-6, rtol=1e-5)
