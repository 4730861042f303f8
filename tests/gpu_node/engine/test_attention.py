"""A step that decodes some sequences and prefills another: on the kernel path its decode rows
take the paged decode kernel in one launch (ownership checked there), its prefill chunk the
per-sequence reference, and every row equals attention over that sequence's own context."""

import os

import pytest
import torch

import gpu_node.cache.kv_cache as kv_cache_module
import gpu_node.engine.attention as attention_module
from gpu_node.cache.kv_cache import KVCache
from gpu_node.engine.attention import PagedAttention, StepMetadata, attend_fused, attend_ref
from scheduler.block_manager import owner_tag
from tests.gpu_node.kernels.kv_write.test_kernel import kv_write
from tests.gpu_node.kernels.paged_attention.test_dot import interpreted, paged_decode_attention

PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 16
# (tokens already cached, tokens this step): A and C decode, B prefills a chunk of 6.
SEQS = [(19, 1), (10, 6), (33, 1)]
PAGES = {0: [3, 7], 1: [0], 2: [5, 1, 6]}  # each sequence's block table, shuffled pages
TAGS = [owner_tag(11, 0), owner_tag(12, 0), owner_tag(13, 2)]


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The GPU's kernel path, interpreted on CPU tensors."""
    monkeypatch.setattr(KVCache, "uses_kernels", property(lambda self: True))
    monkeypatch.setattr(kv_cache_module, "kv_write", kv_write)
    monkeypatch.setattr(attention_module, "paged_decode_attention", paged_decode_attention)


def mixed_step(kv: KVCache, page_owner: torch.Tensor, gen: torch.Generator):
    """Writes each sequence's cached tokens, then returns the step's (metadata, q, k, v) and
    every sequence's whole K/V (cached and new) for the reference."""
    tables = torch.zeros(len(SEQS), 4, dtype=torch.int32)
    slots, token_seq, whole = [], [], []
    qs, ks, vs = [], [], []
    for i, (cached, new) in enumerate(SEQS):
        pages = PAGES[i]
        tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        page_owner[pages] = TAGS[i]
        key = torch.randn(cached + new, KV_HEADS, DIM, generator=gen)
        value = torch.randn(cached + new, KV_HEADS, DIM, generator=gen)
        where = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(cached + new)])
        tags = torch.full((cached + new,), TAGS[i])
        kv.write(0, key[:cached], value[:cached], where[:cached], page_owner, tags[:cached], True)
        slots.append(where[cached:])
        token_seq += [i] * new
        qs.append(torch.randn(new, HEADS, DIM, generator=gen))
        ks.append(key[cached:])
        vs.append(value[cached:])
        whole.append((key, value))
    metadata = StepMetadata(
        query_lens=[new for _, new in SEQS],
        context_lens=[cached + new for cached, new in SEQS],
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        seq_tags=torch.tensor(TAGS),
        token_seq=torch.tensor(token_seq),
        page_owner=page_owner,
    )
    return metadata, torch.cat(qs), torch.cat(ks), torch.cat(vs), whole


def fresh():
    kv = KVCache(
        1, num_pages=8, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=DIM, kv_dtype="fp32"
    )
    return kv, torch.zeros(8, dtype=torch.int64)


@interpreted
def test_every_row_of_a_mixed_step_is_attention_over_its_own_context(kernels_on_cpu):
    kv, page_owner = fresh()
    metadata, q, k, v, whole = mixed_step(kv, page_owner, torch.Generator().manual_seed(0))
    attention = PagedAttention(kv, metadata, DIM**-0.5)
    out = attention(0, q, k, v)
    assert attention._decode_rows is not None  # the decode rows took the kernel
    assert attention._decode_rows.rows.tolist() == [0, 7]
    start = 0
    for (_, new), (key, value) in zip(SEQS, whole, strict=True):
        want = attend_ref(q[start : start + new], key, value, DIM**-0.5)
        torch.testing.assert_close(out[start : start + new], want, atol=1e-5, rtol=1e-5)
        start += new
    assert attention.violations.tolist() == [0, 0, 0]


@interpreted
def test_a_foreign_page_under_a_decode_row_of_a_mixed_step_is_flagged_by_the_kernel(
    kernels_on_cpu,
):
    kv, page_owner = fresh()
    metadata, q, k, v, _ = mixed_step(kv, page_owner, torch.Generator().manual_seed(1))
    metadata.block_tables[2, 0] = PAGES[0][0]  # C reads a page of A's (its write is elsewhere)
    attention = PagedAttention(kv, metadata, DIM**-0.5)
    attention(0, q, k, v)
    assert attention.violations.tolist() == [0, 0, 1]


# (query rows, context length, query heads, kv heads, head dim): a chunk at the end of a
# longer context, a whole prompt, one row, SmolLM2's and Llama's head shapes.
FUSED_CASES = [(6, 40, 9, 3, 64), (48, 48, 4, 2, 16), (1, 30, 8, 8, 32), (300, 2100, 32, 8, 128)]


@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "dim"), FUSED_CASES)
def test_fused_prefill_attention_equals_the_reference(n, length, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(length, kv_heads, dim, generator=gen) for _ in range(2))
    torch.testing.assert_close(
        attend_fused(q, k, v, dim**-0.5), attend_ref(q, k, v, dim**-0.5), atol=2e-6, rtol=1e-5
    )


on_gpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, not interpreted",
)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "length", "heads", "kv_heads", "dim"), FUSED_CASES)
def test_fused_prefill_attention_on_gpu_equals_the_reference(
    n, length, heads, kv_heads, dim, dtype
):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, heads, dim, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(length, kv_heads, dim, generator=gen).to("cuda", dtype) for _ in range(2))
    want = attend_ref(q.float(), k.float(), v.float(), dim**-0.5)
    got = attend_fused(q, k, v, dim**-0.5).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # 16-bit inputs and outputs
