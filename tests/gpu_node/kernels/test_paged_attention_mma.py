"""The register-resident fp8 decode attention kernel (paged_attention_mma.py).

On CUDA: it equals the fp32 reference over the same fp8 pages, for the head shapes it
takes, any context length (a single token, partial halves and pages, many splits and
empty ones), page sizes 16/32/48 and q in bf16/fp16/fp32; and it flags exactly the
sequences whose pages are not theirs. On CPU: what it takes and refuses, and its PTX
operands line up with their constraints (the interpreter cannot run inline asm).
"""

from __future__ import annotations

import re

import pytest
import torch

from gpu_node.kernels import paged_attention_mma_asm as asm
from gpu_node.kernels.paged_attention import paged_decode_attention
from gpu_node.kernels.paged_attention_mma import paged_decode_attention_mma, supports
from gpu_node.kernels.paged_attention_ref import paged_decode_attention_ref
from gpu_node.kv_quant import FP8_DTYPE
from tests.gpu_node.kernels.test_paged_attention import (
    FAULTS,
    build_batch,
    fault_batch,
    inject,
    relative_error,
)

on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9)
    or __import__("os").environ.get("TRITON_INTERPRET") == "1",
    reason="needs an sm_89+ CUDA GPU, not interpreted (inline PTX)",
)

# Both sides read the same fp8 pages; the kernel rounds q (times a power of two) and the
# probabilities to fp16 (2**-11 relative) and sums in fp32 on the tensor cores.
TOLERANCE = 2e-3


def _on_cuda(batch):
    args = [t.cuda() for t in batch.args()]
    scales = {k: v.cuda() for k, v in batch.scales().items()}
    return args, scales


@on_gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page", "q_dtype"),
    [
        (9, 3, 64, 16, torch.bfloat16),  # SmolLM2
        (32, 8, 128, 16, torch.bfloat16),  # Llama-3-8B
        (16, 2, 128, 32, torch.float16),  # G = 8, the mma's rows all used
        (4, 4, 64, 48, torch.float32),  # G = 1, page 48
        (12, 3, 128, 16, torch.bfloat16),  # G = 4
    ],
)
@pytest.mark.parametrize("min_split", [32, 256])
def test_matches_reference(num_heads, num_kv_heads, head_dim, page, q_dtype, min_split):
    lens = [1, 17, 100, 4097, 33, 2000, 15, 16, 64, 31, 40, 96]
    batch = build_batch(
        lens, cache_dtype=FP8_DTYPE, q_dtype=q_dtype, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page,
    )  # fmt: skip
    args, scales = _on_cuda(batch)
    out, violations = paged_decode_attention_mma(*args, **scales, min_split=min_split)
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert out.dtype == q_dtype
    assert violations.tolist() == [False] * len(lens)
    for seq in range(len(lens)):
        assert relative_error(out[seq], ref[seq]) < TOLERANCE, seq


@on_gpu
def test_tiny_and_huge_value_scales():
    """V rows scaled down to 2**-100 and up to 2**20 next to ordinary ones: the per-token
    scale is folded into P as log2, so neither underflows fp16 nor overflows it."""
    batch = build_batch(
        [300, 77], cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, num_heads=9,
        num_kv_heads=3, head_dim=64, page_size=16,
    )  # fmt: skip
    batch.v_scale[::3] = batch.v_scale[::3] * 2.0**-100
    batch.v_scale[1::5] = batch.v_scale[1::5] * 2.0**20
    args, scales = _on_cuda(batch)
    out, _ = paged_decode_attention_mma(*args, **scales, min_split=32)
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert relative_error(out, ref) < TOLERANCE


@on_gpu
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("check_owner", [True, False])
def test_flags_exactly_the_bad_sequence(fault, check_owner):
    batch = fault_batch()
    clean, _ = paged_decode_attention_ref(*_on_cuda(batch)[0], **_on_cuda(batch)[1])
    bad = inject(batch, fault)
    args, scales = _on_cuda(batch)
    out, violations = paged_decode_attention_mma(
        *args, **scales, min_split=32, check_owner=check_owner
    )
    owner_faults = {"foreign_page", "freed_page", "stale_generation", "two_sequences"}
    if check_owner or fault not in owner_faults:
        assert violations.tolist() == [i in bad for i in range(4)]
    else:  # without the owner comparison only range faults remain
        assert violations.tolist() == [False] * 4
    good = [i for i in range(4) if i not in bad and not (fault == "two_sequences" and i == 3)]
    assert relative_error(out[good], clean[good]) < TOLERANCE


@on_gpu
def test_empty_batch_and_errors():
    batch = build_batch(
        [5], cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, num_heads=4, num_kv_heads=1,
        head_dim=64, page_size=16,
    )  # fmt: skip
    args, scales = _on_cuda(batch)
    with pytest.raises(ValueError, match="at most 8 query heads per kv head"):
        q = torch.zeros(1, 16, 64, dtype=torch.bfloat16, device="cuda")
        paged_decode_attention_mma(q, *args[1:], **scales)


@on_gpu
def test_default_decode_attention_takes_fp8_pages_here():
    """paged_decode_attention runs this kernel for fp8 pages unless told otherwise."""
    batch = build_batch(
        [300, 5, 64], cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, num_heads=32,
        num_kv_heads=8, head_dim=128, page_size=16,
    )  # fmt: skip
    args, scales = _on_cuda(batch)
    auto, _ = paged_decode_attention(*args, **scales)
    mma, _ = paged_decode_attention_mma(*args, **scales)
    dot, _ = paged_decode_attention(*args, **scales, kernel="dot")
    assert torch.equal(auto, mma)
    assert not torch.equal(dot, mma)  # a different kernel, both close to the reference
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert relative_error(dot, ref) < 8e-3 and relative_error(mma, ref) < TOLERANCE
    numel = args[1].numel()
    misaligned = torch.empty(numel + 16, dtype=FP8_DTYPE, device="cuda")[1 : numel + 1]
    misaligned = misaligned.view(args[1].shape)  # 1 byte off 16-byte alignment
    assert not supports(args[0], misaligned, args[2], **scales)


def test_kernel_choice_is_checked():
    batch = build_batch(
        [5], cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, num_heads=4, num_kv_heads=1,
        head_dim=64, page_size=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="kernel must be 'auto', 'dot' or 'mma', got 'fast'"):
        paged_decode_attention(*batch.args(), kernel="fast")
    with pytest.raises(ValueError, match="needs fp8 pages"):
        paged_decode_attention(*batch.args(), kernel="mma")


def test_refuses_what_it_does_not_take():
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    fp8 = torch.zeros(4, 16, 2, 64).to(FP8_DTYPE)
    assert not supports(q, fp8)  # CPU tensors
    assert not supports(q, fp8.to(torch.bfloat16))
    with pytest.raises(ValueError, match="needs fp8 pages with head dim 64 or 128"):
        paged_decode_attention_mma(
            q, fp8, fp8, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            k_scale=torch.ones(4, 2, 16, dtype=torch.bfloat16),
            v_scale=torch.ones(4, 2, 16, dtype=torch.bfloat16),
        )  # fmt: skip


def _operands(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\$(\d+)", text)}


@pytest.mark.parametrize("head_dim", asm.HEAD_DIMS)
def test_asm_operands_match_their_constraints(head_dim):
    """Every $n an asm block names exists in its constraint list, outputs first."""
    blocks = [
        (asm.QK[head_dim], asm.QK_CONSTRAINTS[head_dim]),
        *((pv, asm.PV_CONSTRAINTS[head_dim]) for pv in asm.PV[head_dim]),
        (asm.QUAD_MAX, asm.QUAD_CONSTRAINTS),
        (asm.SPREAD, asm.SPREAD_CONSTRAINTS),
        (asm.P_F16, asm.P_CONSTRAINTS),
        asm.load_k(head_dim, 3 * head_dim),
        asm.load_v(head_dim, 3 * head_dim),
        (asm.EXP2_DIFF, asm.EXP2_DIFF_CONSTRAINTS),
        (asm.SPREAD_EXP2_DIFF, asm.SPREAD_EXP2_DIFF_CONSTRAINTS),
        (asm.LOAD_SCALES, asm.LOAD_SCALES_CONSTRAINTS),
    ]
    for text, constraints in blocks:
        kinds = constraints.split(",")
        outputs = sum(kind.startswith("=") for kind in kinds)
        assert outputs % 4 == 0 and all(kind.startswith("=") for kind in kinds[:outputs])
        assert max(_operands(text)) < len(kinds)
        assert set(range(outputs)) <= _operands(text)  # every output written
    # the QK block reads every q pair and K word; each PV block one V word per token
    assert _operands(asm.QK[head_dim]) == set(range(len(asm.QK_CONSTRAINTS[head_dim].split(","))))
    words = head_dim // 32
    for mtile, pv in enumerate(asm.PV[head_dim]):
        v_words = sorted(n for n in _operands(pv) if 8 <= n < 8 + 4 * words)
        assert v_words == [8 + token * words + (2 * mtile) // 4 for token in range(4)]
