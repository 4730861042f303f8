"""The compiled KV write kernel on a GPU equals `kv_write_ref` bit for bit: fp8 pools' K rows
(int8 codes of the Hadamard-rotated row) and V rows (e4m3), both scales, in both memory
orders; 16/32-bit pools as cast. Runs with TRITON_INTERPRET unset (or 0) on CUDA."""

import os

import pytest
import torch

from gpu_node.cache.kv_quant import FP8_DTYPE, dequantize_keys, kv_pool, scale_shape
from gpu_node.kernels.kv_write.kernel import kv_write
from gpu_node.kernels.kv_write.reference import kv_write_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, not interpreted",
)

NUM_PAGES, PAGE_SIZE = 8, 16


def hard_values(num_tokens: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """Rows of every size (1e-3 .. 1e3), loud channels, an all-zero row, elements just
    below powers of two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= torch.logspace(-3, 3, num_tokens).view(-1, 1, 1)
    x[:, :, 5] = x[:, :, 5] * 3 - 13.5  # an outlier channel, as keys carry
    x[0, 0, :8] = torch.tensor([31.88, -7.87, 1.9686, 0.2499, 447.9, 1e-3, -3e-4, 15.99])
    x[1, -1] = 0.0
    return x.to(dtype)


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
    key = hard_values(num_tokens, num_kv_heads, head_dim, input_dtype, seed=head_dim)
    value = hard_values(num_tokens, num_kv_heads, head_dim, input_dtype, seed=head_dim + 1)
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=torch.Generator().manual_seed(3))
    slots = slots[:num_tokens]
    slots[7] = -1  # padding: skipped
    tags = torch.full((num_tokens,), 7)
    owner = torch.full((NUM_PAGES,), 7)
    results = []
    for write, device in ((kv_write, "cuda"), (kv_write_ref, "cpu")):
        shape = (NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
        k_cache = kv_pool(*shape, cache_dtype, device, head_major=head_major)
        v_cache = kv_pool(*shape, cache_dtype, device, head_major=head_major)
        scales = [None, None]
        if cache_dtype == FP8_DTYPE:
            sshape = scale_shape(NUM_PAGES, PAGE_SIZE, num_kv_heads)
            scales = [torch.ones(sshape, dtype=torch.bfloat16, device=device) for _ in range(2)]
        flags = write(
            key.to(device), value.to(device), k_cache, v_cache, slots.to(device),
            owner.to(device), tags.to(device), *scales,
        )  # fmt: skip
        results.append([t.cpu() for t in (flags, k_cache, v_cache, *scales) if t is not None])
    for got, want in zip(*results, strict=True):
        bits = (lambda t: t.view(torch.uint8)) if got.dtype == FP8_DTYPE else (lambda t: t)
        assert torch.equal(bits(got), bits(want))
    if cache_dtype == FP8_DTYPE:  # and the keys come back close to what was written
        _, k_cache, _, k_scale, _ = results[0]
        written = slots >= 0
        pages, offsets = slots[written] // PAGE_SIZE, slots[written] % PAGE_SIZE
        restored = dequantize_keys(
            k_cache[pages, offsets], k_scale[pages, :, offsets], torch.float32
        )
        want = key[written].float()
        error = (restored - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert float(error.max()) < 0.02
