"""The register-resident fp8 decode attention kernel (paged_attention/mma.py).

On CUDA: it equals the fp32 reference over the same fp8 pages, for the head shapes it
takes, any context length (a single token, partial halves and pages, many splits and
empty ones), page sizes 16/32/48 and q in bf16/fp16/fp32; and it flags exactly the
sequences whose pages are not theirs. On CPU: what it takes and refuses, and its PTX
operands line up with their constraints (the interpreter cannot run inline asm).
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import replace

import pytest
import torch

from gpu_node.cache.kv_quant import FP8_DTYPE, kv_pool, pool_strides
from gpu_node.kernels.launch import launches_early
from gpu_node.kernels.paged_attention import mma_asm as asm
from gpu_node.kernels.paged_attention.dot import DotTuning, paged_decode_attention
from gpu_node.kernels.paged_attention.mma import (
    MmaTuning,
    batch_class,
    paged_decode_attention_mma,
    resident_warps,
    split_plan,
    supports,
)
from gpu_node.kernels.paged_attention.reference import paged_decode_attention_ref
from tests.gpu_node.kernels.paged_attention.test_dot import (
    FAULTS,
    build_batch,
    fault_batch,
    head_major,
    inject,
    relative_error,
)

on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9)
    or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs an sm_89+ CUDA GPU, not interpreted (inline PTX)",
)

# Both sides read the same fp8 pages; the kernel rounds q (times a power of two) and the
# probabilities to fp16 (2**-11 relative) and sums in fp32 on the tensor cores.
TOLERANCE = 2e-3

# The kernel's variants (module defaults and their alternatives), each tested.
VARIANTS = [
    MmaTuning(),
    MmaTuning(linear_v=False, full_steps=False, defer_owners=False),
    MmaTuning(linear_v=True, full_steps=True, defer_owners=True),
    MmaTuning(linear_v=True, full_steps=True, defer_owners=False),
]
VARIANT_IDS = ["defaults", "log2_guarded", "linear_full_deferred", "linear_full_before"]


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
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_matches_reference(num_heads, num_kv_heads, head_dim, page, q_dtype, min_split, variant):
    lens = [1, 17, 100, 4097, 33, 2000, 15, 16, 64, 31, 40, 96]
    batch = build_batch(
        lens, cache_dtype=FP8_DTYPE, q_dtype=q_dtype, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page,
    )  # fmt: skip
    args, scales = _on_cuda(batch)
    tuning = replace(variant, min_split=min_split)
    out, violations = paged_decode_attention_mma(*args, **scales, tuning=tuning)
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert out.dtype == q_dtype
    assert violations.tolist() == [False] * len(lens)
    for seq in range(len(lens)):
        assert relative_error(out[seq], ref[seq]) < TOLERANCE, seq


@on_gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page"),
    [(9, 3, 64, 16), (32, 8, 128, 16), (12, 3, 128, 48)],
)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_head_major_pools_give_the_same_output(num_heads, num_kv_heads, head_dim, page, variant):
    """The kernel reads a head-major pool (kv_pool) by its strides: bit for bit the
    token-major result."""
    lens = [1, 17, 100, 4097, 33, 2000, 15, 16, 64, 31]
    batch = build_batch(
        lens, cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page,
    )  # fmt: skip
    args, scales = _on_cuda(batch)
    moved = head_major(replace(batch, k_cache=args[1], v_cache=args[2]))
    args_hm = [args[0], moved.k_cache, moved.v_cache, *args[3:]]
    assert pool_strides(moved.k_cache) == (head_dim, page * head_dim)
    tuning = replace(variant, min_split=32)
    out, violations = paged_decode_attention_mma(*args, **scales, tuning=tuning)
    out_hm, violations_hm = paged_decode_attention_mma(*args_hm, **scales, tuning=tuning)
    assert torch.equal(out_hm, out)
    assert violations_hm.tolist() == violations.tolist() == [False] * len(lens)


@on_gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128)])
def test_early_merge_gives_the_same_output(num_heads, num_kv_heads, head_dim):
    """The merge kernel launched early (programmatic dependent launch, waiting on the
    device for the split kernel) merges exactly what it merges launched after it, and
    flags the same sequence. (Equal outputs cannot show that the launch overlapped; the
    benchmark's early-merge part times it.)"""
    if not launches_early(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    batch = fault_batch() if head_dim == 64 else None
    if batch is None:
        batch = build_batch(
            [1, 17, 4097, 2000], cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16,
        )  # fmt: skip
    bad = inject(batch, "foreign_page") if head_dim == 64 else set()
    args, scales = _on_cuda(batch)
    after, flags_after = paged_decode_attention_mma(
        *args, **scales, tuning=MmaTuning(min_split=32, early_merge=False)
    )
    early, flags_early = paged_decode_attention_mma(
        *args, **scales, tuning=MmaTuning(min_split=32, early_merge=True)
    )
    assert torch.equal(early, after)
    assert (
        flags_early.tolist() == flags_after.tolist() == [i in bad for i in range(len(flags_after))]
    )


@on_gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_tiny_and_huge_value_scales(variant):
    """V rows scaled down to 2**-100 and up to 2**20 next to ordinary ones: the per-token
    scale is folded into P normalised by the running max of p * v_scale, so neither
    underflows fp16 nor overflows it."""
    batch = build_batch(
        [300, 77], cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, num_heads=9,
        num_kv_heads=3, head_dim=64, page_size=16,
    )  # fmt: skip
    batch.v_scale[::3] = batch.v_scale[::3] * 2.0**-100
    batch.v_scale[1::5] = batch.v_scale[1::5] * 2.0**20
    args, scales = _on_cuda(batch)
    out, _ = paged_decode_attention_mma(*args, **scales, tuning=replace(variant, min_split=32))
    ref, _ = paged_decode_attention_ref(*args, **scales)
    assert relative_error(out, ref) < TOLERANCE


@on_gpu
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("check_owner", [True, False])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_flags_exactly_the_bad_sequence(fault, check_owner, variant):
    batch = fault_batch()
    clean, _ = paged_decode_attention_ref(*_on_cuda(batch)[0], **_on_cuda(batch)[1])
    bad = inject(batch, fault)
    args, scales = _on_cuda(batch)
    out, violations = paged_decode_attention_mma(
        *args, **scales, check_owner=check_owner, tuning=replace(variant, min_split=32)
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
    dot, _ = paged_decode_attention(*args, **scales, tuning=DotTuning())
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
    with pytest.raises(
        ValueError, match="tuning must be a DotTuning, an MmaTuning or None, got 'fast'"
    ):
        paged_decode_attention(*batch.args(), tuning="fast")
    with pytest.raises(ValueError, match="needs fp8 pages"):
        paged_decode_attention(*batch.args(), tuning=MmaTuning())


@pytest.mark.parametrize(
    ("batch", "kv_heads", "head_dim", "length", "expected"),
    [
        # 192 (sequence, kv head) pairs: 144 registers (14 warps a multiprocessor), 32 / 14
        # waves: 4224 // 192 = 22 splits of 47 steps
        (64, 3, 64, 32768, (22, 1504, 144)),
        # 24 pairs: 128 registers, one wave of 16 warps: 2112 // 24 = 88 -> 12 steps -> 86
        (8, 3, 64, 32768, (86, 384, 128)),
        # 64 pairs at 216 registers (9 warps), 16 / 9 waves: 2112 // 64 = 33 -> 32 of 1024
        (8, 8, 128, 32768, (32, 1024, 216)),
        # 512 pairs: one wave, 1188 // 512 = 2 splits
        (64, 8, 128, 32768, (2, 16384, 216)),
        # batch 1: capped at 128 splits (head dim 128) / 256 (64, at most 8 pairs: 144
        # registers) a sequence
        (1, 8, 128, 32768, (128, 256, 216)),
        (1, 3, 64, 32768, (256, 128, 144)),
        # short contexts: splits of at least 64 tokens
        (1, 8, 128, 1024, (16, 64, 216)),
        (2, 3, 64, 1, (1, 64, 144)),
        # class edges at head dim 64: 126 pairs take 128 registers and 16 warps
        # (2112 // 126 = 16 splits), 129 pairs 144 and 32 (4224 // 129 = 32)
        (42, 3, 64, 4096, (16, 256, 128)),
        (43, 3, 64, 4096, (32, 128, 144)),
    ],
)
def test_split_plan(batch, kv_heads, head_dim, length, expected):
    assert split_plan(batch, kv_heads, head_dim, length, num_sms=132) == expected
    splits, size, _ = expected
    assert (splits - 1) * size < length <= splits * size or length < size


def test_split_plan_takes_explicit_options():
    tuning = MmaTuning(warps_per_sm=8, min_split=1000, max_splits=3, max_registers=0)
    assert split_plan(4, 2, 64, 10000, 132, tuning) == (3, 3360, 0)
    # half a wave at 128 registers (16 warps): 8 x 132 // 8 pairs = 132 splits -> 3 steps
    half_wave = MmaTuning(waves=0.5, max_registers=128)
    assert split_plan(4, 2, 64, 10000, 132, half_wave) == (105, 96, 128)


def test_batch_classes_pick_the_variant_and_the_plan():
    tiny, small, large = (batch_class(b, 3, 64) for b in (1, 8, 64))
    assert (tiny.max_registers, tiny.max_splits, tiny.full_steps, tiny.defer_owners) == (
        144, 256, True, True
    )  # fmt: skip
    assert (small.max_registers, small.full_steps, small.defer_owners) == (128, False, False)
    assert (large.max_registers, large.full_steps, large.defer_owners) == (144, True, True)
    assert batch_class(2, 4, 64) is tiny and batch_class(3, 3, 64) is small  # 8 / 9 pairs
    assert batch_class(42, 3, 64) is small and batch_class(43, 3, 64) is large  # 126 / 129
    assert [batch_class(b, 8, 128).full_steps for b in (1, 16)] == [True, True]
    assert batch_class(15, 8, 128).max_pairs == 127 and batch_class(16, 8, 128).max_pairs is None


def test_resident_warps():
    assert [resident_warps(r) for r in (0, 64, 128, 137, 144, 216)] == [8, 32, 16, 14, 14, 9]


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
        (asm.RUN_MAX, asm.RUN_MAX_CONSTRAINTS),
        (asm.Q_QUADS, asm.Q_QUADS_CONSTRAINTS),
        (asm.SPREAD, asm.SPREAD_CONSTRAINTS),
        (asm.P_F16, asm.P_CONSTRAINTS),
        asm.load_k(head_dim, 3 * head_dim),
        asm.load_v(head_dim, 3 * head_dim),
        asm.load_k(head_dim, 3 * head_dim, guarded=False),
        asm.load_v(head_dim, 3 * head_dim, guarded=False),
        (asm.LOAD_SCALES_FULL, asm.LOAD_SCALES_CONSTRAINTS),
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
    # the QK block reads every q fragment register and K word; each PV block one V word
    # per token
    assert _operands(asm.QK[head_dim]) == set(range(len(asm.QK_CONSTRAINTS[head_dim].split(","))))
    words = head_dim // 32
    for mtile, pv in enumerate(asm.PV[head_dim]):
        v_words = sorted(n for n in _operands(pv) if 8 <= n < 8 + 4 * words)
        assert v_words == [8 + token * words + (2 * mtile) // 4 for token in range(4)]


# --- CPU: the QK^T and P.V asm blocks run on an emulated warp --------------------------
# A few PTX instructions are interpreted per lane (mov, cvt, prmt, xor, sub) and mma.sync through
# PTX's fragment tables for m16n8k16 (not through the kernel's code):
#   A (16 x 16): register r of lane 4g + t holds A[g + 8 (r % 2)][2t + 8 (r // 2) + {0, 1}]
#   B (16 x 8):  register h holds B[2t + 8h + {0, 1}][g]
#   C (16 x 8):  element i holds C[g + 8 (i // 2)][2t + i % 2]
# The lanes' operands are placed as the kernel's loads place them (its docstring), so
# the tests check that the token and dim permutations, the byte selections and the
# operand numbering compose into q K^T and P V.

LANES = torch.arange(32)
G_OF, T_OF = LANES // 4, LANES % 4


def _f16_pairs(reg: torch.Tensor) -> torch.Tensor:
    """[32] 32-bit registers (int64 bits) -> their (low, high) fp16 halves as float [32, 2]."""
    halves = torch.stack([reg & 0xFFFF, (reg >> 16) & 0xFFFF], dim=1)
    return ((halves + 0x8000) % 0x10000 - 0x8000).to(torch.int16).view(torch.float16).float()


def _f16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def _mma(a: list, b: list, c: list) -> list:
    mat_a, mat_b = torch.zeros(16, 16), torch.zeros(16, 8)
    for lane in range(32):
        g, t = int(G_OF[lane]), int(T_OF[lane])
        for r in range(4):
            row, col = g + 8 * (r % 2), 2 * t + 8 * (r // 2)
            mat_a[row, col : col + 2] = _f16_pairs(a[r])[lane]
        for h in range(2):
            mat_b[2 * t + 8 * h : 2 * t + 8 * h + 2, g] = _f16_pairs(b[h])[lane]
    mat_c = torch.zeros(16, 8)
    for lane in range(32):
        g, t = int(G_OF[lane]), int(T_OF[lane])
        for i in range(4):
            mat_c[g + 8 * (i // 2), 2 * t + i % 2] = c[i][lane]
    mat_d = mat_a @ mat_b + mat_c
    return [mat_d[G_OF + 8 * (i // 2), 2 * T_OF + i % 2] for i in range(4)]


def run_asm(
    text: str,
    operands: dict[int, torch.Tensor],
    memory: torch.Tensor | None = None,
    outputs: int = 4,
) -> list[torch.Tensor]:
    """Interpret a QK / PV / P_F16 / load block: operands $n -> [32] per-lane values (int64
    bits, or fp32 for f32 operands); `memory` the bytes that addresses index (uint8);
    returns $0 .. $(outputs - 1) ([32] each). A predicated-off load leaves its
    registers as they were: -1 (all ones) unless the block wrote them."""
    regs: dict[str, torch.Tensor] = {f"${n}": v for n, v in operands.items()}
    for n in range(outputs):
        regs.setdefault(f"${n}", torch.full((32,), -1, dtype=torch.int64))

    def val(name: str) -> torch.Tensor:
        name = name.strip()
        if name.startswith("0x"):  # an immediate, the same in every lane
            return torch.full((32,), int(name, 16), dtype=torch.int64)
        return regs[name]

    def names(group: str) -> list[str]:
        return [x.strip() for x in group.strip("{} ").split(",")]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        if op == "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32":
            groups = [g + "}" for g in rest.split("}")[:4]]
            d, a, b, c = (names(g.strip(", ")) for g in groups)
            out = _mma([val(x) for x in a], [val(x) for x in b], [val(x).float() for x in c])
            for name, v in zip(d, out, strict=True):
                regs[name] = v
            continue
        if op == "mov.b32" and rest.startswith("{"):
            lo, hi = names(rest.split("}")[0])
            src = val(rest.split("}")[1].strip(", "))
            regs[lo], regs[hi] = src & 0xFFFF, (src >> 16) & 0xFFFF
            continue
        if op.startswith(("@", "ld.global")):  # [@p] ld.global.nc.v{n}.b32 {regs}, [a+imm]
            if op.startswith("@"):
                pred, (load, _, rest) = regs[op[1:]], rest.partition(" ")
            else:
                pred, load = torch.ones(32, dtype=torch.bool), op
            assert load.startswith("ld.global.nc.v") and memory is not None, line
            dests = names(rest.split("}")[0])
            base, _, imm = rest.split("[")[1].rstrip("]").partition("+")
            address = val(base) + int(imm or 0)
            for i, dest in enumerate(dests):
                word = _words(
                    torch.stack([memory[int(a) + 4 * i : int(a) + 4 * i + 4] for a in address])
                )[:, 0]
                regs[dest] = torch.where(pred, word, regs.get(dest, torch.full((32,), -1)))
            continue
        args = [x.strip() for x in rest.split(",")]
        if op == "setp.lt.s32":
            regs[args[0]] = val(args[1]) < val(args[2])
        elif op == "cvt.s64.s32":
            regs[args[0]] = val(args[1])
        elif op in ("add.s64", "add.s32"):
            right = val(args[2]) if args[2].startswith(("$", "o", "a")) else int(args[2])
            regs[args[0]] = val(args[1]) + right
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << int(args[2])) & 0xFFFFFFFF
        elif op == "xor.b32":
            regs[args[0]] = val(args[1]) ^ int(args[2], 16)
        elif op == "max.f32":
            regs[args[0]] = torch.maximum(val(args[1]).float(), val(args[2]).float())
        elif op == "shfl.sync.bfly.b32":  # d, a, lane mask, clamp, member mask
            regs[args[0]] = val(args[1])[LANES ^ int(args[2])]
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & int(args[2], 16)
        elif op in ("mov.f32", "mov.b32"):
            regs[args[0]] = (
                torch.zeros(32, dtype=torch.int64)
                if args[1] in ("0", "0f00000000")
                else val(args[1])
            )
        elif op == "sub.rn.f16x2":  # both halves, each rounded to fp16
            diff = _f16_pairs(val(args[1])) - _f16_pairs(val(args[2]))
            regs[args[0]] = _f16_bits(diff[:, 0]) | (_f16_bits(diff[:, 1]) << 16)
        elif op == "cvt.rn.f16x2.f32":  # d = (hi: a, lo: b)
            regs[args[0]] = _f16_bits(val(args[2]).float()) | (
                _f16_bits(val(args[1]).float()) << 16
            )
        elif op == "prmt.b32":
            a, b, sel = val(args[1]), val(args[2]), int(args[3], 16)
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [
                (b >> (8 * i)) & 0xFF for i in range(4)
            ]
            regs[args[0]] = sum(pool[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))
        else:
            raise AssertionError(f"not emulated: {line}")
    return [regs[f"${i}"] for i in range(outputs)]


def _q_fragments(lane_pairs: torch.Tensor, head_dim: int) -> dict[int, torch.Tensor]:
    """The lanes' q pairs [32, D/8] (pair p: operand tensor p // 4, element p % 4) through
    Q_QUADS -> the QK block's A-fragment operands ($4 + 4 s + r: k step s, register r)."""
    operands = {}
    for c in range(head_dim // 32):
        ops = {8 + j: lane_pairs[:, 4 * c + j] for j in range(4)}
        quads = run_asm(asm.Q_QUADS, ops, outputs=8)
        for n, reg in enumerate(quads):
            operands[4 + 8 * c + n] = reg
    return operands


def _words(rows: torch.Tensor) -> torch.Tensor:
    """fp8 bytes [..., 4n] -> their little-endian 32-bit words [..., n] (int64)."""
    b = rows.view(torch.uint8).to(torch.int64).reshape(*rows.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


@pytest.mark.parametrize("head_dim", asm.HEAD_DIMS)
def test_emulated_warp_computes_q_k_and_p_v(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    # one half; K and V bytes are int8 codes (kv_quant.quantize_rows), the extremes included
    keys = torch.randint(-128, 128, (16, head_dim), generator=gen, dtype=torch.int8)
    keys[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    keys = keys.view(FP8_DTYPE)
    values = torch.randint(-128, 128, (16, head_dim), generator=gen, dtype=torch.int8)
    values[3, :2] = torch.tensor([127, -128], dtype=torch.int8)
    values = values.view(FP8_DTYPE)
    q = torch.randn(8, head_dim, generator=gen).to(torch.float16)  # rows: heads g
    # q pairs of lane t: dims t D/4 + 2p, + 1 -> operand tensor p // 4, element p % 4
    q_pairs = _f16_bits(q[G_OF].float()).reshape(32, -1, 2)  # [lane, D/2, 2]
    q_pairs = q_pairs[:, :, 0] | q_pairs[:, :, 1] << 16  # [lane, D/2]
    lane_pairs = torch.stack(
        [
            q_pairs[lane, T_OF[lane] * head_dim // 8 : (T_OF[lane] + 1) * head_dim // 8]
            for lane in range(32)
        ]
    )  # [32, D/8]
    k_token = 4 * (G_OF // 2) + G_OF % 2
    k_words = _words(keys)  # [16, D/4]
    words = head_dim // 16
    lane_k = [
        torch.stack(
            [
                k_words[
                    int(k_token[n]) + 2 * tok, int(T_OF[n]) * words : (int(T_OF[n]) + 1) * words
                ]
                for n in range(32)
            ]
        )
        for tok in range(2)
    ]  # 2 x [32, D/16]
    operands = _q_fragments(lane_pairs, head_dim)
    flat = [lane_k[0][:, i] for i in range(words)] + [lane_k[1][:, i] for i in range(words)]
    for n, v in enumerate(flat):
        operands[4 + 4 * words + n] = v
    scores = run_asm(asm.QK[head_dim], operands)  # element j: token 4t + j, head g
    want = q.float() @ keys.view(torch.int8).float().T  # [8 heads, 16 tokens]
    for j in range(4):
        torch.testing.assert_close(
            scores[j].float(), want[G_OF, 4 * T_OF + j], rtol=1e-5, atol=1e-3
        )

    # P.V: P[head g, token 4t + j] as the kernel packs it; V bytes of tokens 4t + i, dims g D/8 ..
    p = torch.rand(8, 16, generator=gen)
    packed = run_asm(asm.P_F16, {4 + j: p[G_OF, 4 * T_OF + j] for j in range(4)})
    v_words = _words(values)  # [16, D/4]
    vw = head_dim // 32
    lane_v = torch.stack(
        [
            torch.cat(
                [
                    v_words[4 * int(T_OF[n]) + i, int(G_OF[n]) * vw : (int(G_OF[n]) + 1) * vw]
                    for i in range(4)
                ]
            )
            for n in range(32)
        ]
    )  # [32, 4 tokens x D/32 words] in token order
    want = p.half().float() @ values.view(torch.int8).float()  # [8 heads, D]
    for mtile, text in enumerate(asm.PV[head_dim]):
        ops = {4 + j: packed[j] for j in range(4)}
        for n in range(4 * vw):
            ops[8 + n] = lane_v[:, n]
        acc = 8 + 4 * vw
        for j in range(4):
            ops[acc + j] = torch.zeros(32)
        out = run_asm(text, ops)
        for j in range(4):  # head 2t + j % 2, dim g D/8 + 2 mtile + j // 2
            dim = G_OF * (head_dim // 8) + 2 * mtile + j // 2
            torch.testing.assert_close(
                out[j].float(), want[2 * T_OF + j % 2, dim], rtol=1e-5, atol=1e-3
            )


@pytest.mark.parametrize(
    ("head_dim", "page_size", "left", "guarded"),
    [(64, 32, 11, True), (128, 16, 16, True), (128, 48, 3, True), (64, 48, 16, False),
     (128, 32, 16, False)],
)  # fmt: skip
@pytest.mark.parametrize("head_major", [False, True])
def test_emulated_loads_feed_the_products(head_dim, page_size, left, guarded, head_major):
    """One half through the kernel's load blocks (addresses as the kernel forms them) from
    a paged pool in either memory order (kv_pool), then QK^T and P.V: the right tokens'
    scores and sums; tokens at or past `left` are not loaded (V reads zero). Unguarded
    blocks (a half wholly in the context) load all 16 tokens."""
    gen = torch.Generator().manual_seed(head_dim + left)
    pages, kv_heads, kv_head, page, offset = 4, 2, 1, 2, page_size - 16
    shape = (pages, page_size, kv_heads, head_dim)
    k_cache = kv_pool(pages, page_size, kv_heads, head_dim, FP8_DTYPE, head_major=head_major)
    v_cache = kv_pool(pages, page_size, kv_heads, head_dim, FP8_DTYPE, head_major=head_major)
    codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    k_cache.copy_(codes.view(FP8_DTYPE))  # int8 codes, as kv_write stores K and V
    v_codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    v_cache.copy_(v_codes.view(FP8_DTYPE))
    k_scale = torch.rand(pages, kv_heads, page_size, generator=gen).add(0.5).bfloat16()
    v_scale = torch.rand(pages, kv_heads, page_size, generator=gen).add(0.5).bfloat16()
    row, head_stride = pool_strides(k_cache)
    assert (row, head_stride) == (
        (head_dim, page_size * head_dim) if head_major else (kv_heads * head_dim, head_dim)
    )
    # the kernel's loop-invariant lane offsets and the half's base (_half_data)
    k_token = 4 * (G_OF // 2) + G_OF % 2
    k_lane = k_token * row + T_OF * (head_dim // 4)
    v_token = 4 * T_OF
    v_lane = v_token * row + G_OF * (head_dim // 8)
    page_bytes = page_size * kv_heads * head_dim
    base = torch.full((32,), page * page_bytes + offset * row + kv_head * head_stride)
    scale_base = torch.full((32,), ((page * kv_heads + kv_head) * page_size + offset) * 2)
    full_left = torch.full((32,), left)
    # the pools' bytes in memory order
    order = (0, 2, 1, 3) if head_major else (0, 1, 2, 3)
    k_bytes = k_cache.permute(order).contiguous().view(torch.uint8).reshape(-1)
    v_bytes = v_cache.permute(order).contiguous().view(torch.uint8).reshape(-1)
    assert k_bytes.data_ptr() == k_cache.data_ptr()  # no copy: the pool's own storage

    text, constraints = asm.load_k(head_dim, row, guarded)
    k_out = 4 * (constraints.count("=") // 4)
    ops = {k_out + 4 * i: x for i, x in enumerate([base, k_lane, k_token, full_left])}
    k_regs = run_asm(text, ops, k_bytes, outputs=k_out)
    text, constraints = asm.load_v(head_dim, row, guarded)
    v_out = 4 * (constraints.count("=") // 4)
    ops = {v_out + 4 * i: x for i, x in enumerate([base, v_lane, v_token, full_left])}
    v_regs = run_asm(text, ops, v_bytes, outputs=v_out)
    # scales: K's and V's bf16 of tokens 4t + j packed; the K-scale pool first, then V's
    pool = torch.cat([k_scale.view(torch.uint8).reshape(-1), v_scale.view(torch.uint8).reshape(-1)])
    ops = {
        4: scale_base,
        8: scale_base + k_scale.numel() * 2,
        12: 2 * v_token,
        16: v_token,
        20: full_left,
    }
    packed = run_asm(asm.LOAD_SCALES if guarded else asm.LOAD_SCALES_FULL, ops, pool)

    keys = k_cache[page, offset : offset + 16, kv_head]
    values = v_cache[page, offset : offset + 16, kv_head]
    ks = k_scale[page, kv_head, offset : offset + 16].float()
    vs = v_scale[page, kv_head, offset : offset + 16].float()
    for j in range(4):  # element j: token 4t + j (masked by the caller past `left`)
        valid = 4 * T_OF + j < left
        got_k = ((packed[j] & 0xFFFF0000).to(torch.int32)).view(torch.float32)
        got_v = ((packed[j] << 16) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        assert torch.equal(got_k[valid], ks[(4 * T_OF + j)[valid]])
        assert torch.equal(got_v[valid], vs[(4 * T_OF + j)[valid]])

    q = torch.randn(8, head_dim, generator=gen).to(torch.float16)
    q_bits = _f16_bits(q[G_OF].float()).reshape(32, -1, 2)
    q_bits = q_bits[:, :, 0] | q_bits[:, :, 1] << 16  # [lane, D / 2] pairs
    lane_pairs = torch.stack(
        [
            q_bits[n, int(T_OF[n]) * head_dim // 8 : (int(T_OF[n]) + 1) * head_dim // 8]
            for n in range(32)
        ]
    )
    operands = _q_fragments(lane_pairs, head_dim)
    for i, reg in enumerate(k_regs):  # load order: token a's vectors, then token b's
        operands[4 + head_dim // 4 + i] = reg
    scores = run_asm(asm.QK[head_dim], operands)
    want = q.float() @ keys.view(torch.int8).float().T
    for j in range(4):
        valid = 4 * T_OF + j < left
        torch.testing.assert_close(
            scores[j][valid].float(), want[G_OF, 4 * T_OF + j][valid], rtol=1e-5, atol=1e-3
        )

    p = torch.rand(8, 16, generator=gen) * (torch.arange(16) < left)  # 0 past the context
    packed_p = run_asm(asm.P_F16, {4 + j: p[G_OF, 4 * T_OF + j] for j in range(4)})
    want = p.half().float() @ values.view(torch.int8).float()
    for mtile, text in enumerate(asm.PV[head_dim]):
        ops = {4 + j: packed_p[j] for j in range(4)}
        for n, reg in enumerate(v_regs):
            ops[8 + n] = reg
        for j in range(4):
            ops[8 + len(v_regs) + j] = torch.zeros(32)
        out = run_asm(text, ops)
        for j in range(4):
            dim = G_OF * (head_dim // 8) + 2 * mtile + j // 2
            torch.testing.assert_close(
                out[j].float(), want[2 * T_OF + j % 2, dim], rtol=1e-5, atol=1e-3
            )


def test_emulated_running_max_is_the_quads_and_the_running_value():
    """RUN_MAX: per lane, the max over its quad's eight values of a and b and the running
    max's first element, in all four outputs; elements 1-3 of `running` are not read."""
    gen = torch.Generator().manual_seed(5)
    a = [torch.randn(32, generator=gen) for _ in range(4)]
    b = [torch.randn(32, generator=gen) for _ in range(4)]
    running = torch.randn(32, generator=gen) + 0.5
    ops = {4 + j: a[j] for j in range(4)} | {8 + j: b[j] for j in range(4)}
    ops |= {12: running} | {13 + j: torch.full((32,), 1e9) for j in range(3)}
    out = run_asm(asm.RUN_MAX, ops)
    quad_max = torch.stack(a + b).amax(0).view(8, 4).amax(1)[G_OF]  # over lanes 4g .. 4g + 3
    want = torch.maximum(quad_max, running)
    for j in range(4):
        assert torch.equal(out[j], want)


def test_emulated_dot_kernel_conversion_gives_the_codes():
    """The tl.dot kernel's int8 -> fp16 PTX (its fp16 dots on a GPU), four codes a lane,
    the extremes included: the low two codes in $0, the high two in $1."""
    from gpu_node.kernels.paged_attention.dot import _tile_to_dot_tl

    source = inspect.getsource(_tile_to_dot_tl.fn)  # jitted or interpreted
    source = source.split("inline_asm_elementwise(")[1].split('"=r,=r,r"')[0]
    text = "".join(re.findall(r'"([^"]*)"', source))
    lines = text.replace("{", "{;").replace("}", ";}").split(";")
    lines = "\n".join(x.strip() for x in lines if x.strip())
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(-128, 128, (32, 4), generator=gen, dtype=torch.int8)
    codes[0] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    out = run_asm(lines, {2: _words(codes.view(FP8_DTYPE))[:, 0]}, outputs=2)
    assert torch.equal(torch.cat([_f16_pairs(out[0]), _f16_pairs(out[1])], 1), codes.float())
