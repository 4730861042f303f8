"""The PTX that w4a16/mma.py's kernel issues through tl.inline_asm_elementwise.

Per lane and 64-k chunk (pack = 4: a lane's four words, or its four C elements):
four words -> four `mma.sync.m16n8k16` into D, and four more with A = 1 into
x_sum (each chain of four optionally alternating between two accumulators). The
magic constants put a nibble under the exponent of 128 (bf16) or 1024
(fp16), so one LOP3 makes two exact 16-bit values (int4.py draws the layout); fp16's
wider mantissa also takes the odd nibbles in place, as 1024 + 16 q (HIGH_ROWS).
"""

from __future__ import annotations

import struct

import torch

# activation dtype -> (LOP3 magic: two 16-bit floats 2^e, its value 2^e, two 1.0s)
MAGIC = {
    torch.bfloat16: (0x43004300, 128.0, 0x3F803F80),  # 128 + q; 1.0
    torch.float16: (0x64006400, 1024.0, 0x3C003C00),  # 1024 + q; 1.0
}
# Rows g + 8 of a fragment come out of the mma times this (fp16 reads their nibbles in
# place, 4 bits up; bf16's 7-bit mantissa cannot).
HIGH_ROWS = {torch.bfloat16: 1.0, torch.float16: 16.0}


def _mma(ab_type: str, d: str, a: str, b: str, c: str) -> str:
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32 {d}, {a}, {b}, {c};"


def _regs(base: int) -> str:
    return f"{{${base}, ${base + 1}, ${base + 2}, ${base + 3}}}"


def _dequant(word: str, magic: int, high_in_place: bool) -> list[str]:
    """PTX: a word's eight nibbles -> A registers a0..a3 (two 16-bit values each).

    Register r takes nibbles r and r + 4; (src & mask) | magic, the LOP3 truth table 0xEA
    being (a & b) | c. bf16 has 7 mantissa bits, so every nibble is shifted down to bits
    0-3 first (3 shifts, 4 LOP3). fp16 has 10: the odd registers (rows g + 8) take their
    nibbles in place at bits 4-7, as 1024 + 16 q (1 shift, 4 LOP3), and the caller divides
    those rows' scale by HIGH_ROWS.
    """
    lines = []
    if high_in_place:
        lines.append(f"shr.u32 sh0, {word}, 8;")
        for r, (src, mask) in enumerate(
            ((word, 0x000F000F), (word, 0x00F000F0), ("sh0", 0x000F000F), ("sh0", 0x00F000F0))
        ):
            lines.append(f"lop3.b32 a{r}, {src}, {mask:#010x}, {magic:#x}, 0xEA;")
        return lines
    for r in range(4):
        src = word
        if r:
            lines.append(f"shr.u32 sh{r - 1}, {word}, {4 * r};")
            src = f"sh{r - 1}"
        lines.append(f"lop3.b32 a{r}, {src}, 0x000F000F, {magic:#x}, 0xEA;")
    return lines


def _chain(s: int, chains: int, halves: bool) -> tuple[int, bool]:
    """k16 step s -> (its accumulator, whether it is that chain's first step)."""
    if halves:  # steps 0-1 and 2-3: the chunk's two g32 groups apart
        return s // 2, s % 2 == 0
    return s % chains, s < chains


def _d_asm(dtype: torch.dtype, chains: int = 1, halves: bool = False) -> str:
    """PTX for one 64-k chunk of one lane and row block: four words -> four mma into D.

    With `chains` = 2 the k16 steps alternate between two accumulators, so two mma
    chains of half the length run side by side (their sum is taken by the caller);
    with `halves` steps 0-1 go to the first and 2-3 to the second, one group of 32 k
    each (the caller scales each by its own group's scale).
    Operands: D out (4 per chain), then the words (k16 step s), then the lane's eight
    activation pairs (step s takes pairs 2s and 2s + 1), then D in (4 per chain).
    """
    ab_type, magic, in_place = _ab_type(dtype), MAGIC[dtype][0], HIGH_ROWS[dtype] > 1
    words, x, d_in = 4 * chains, 4 * chains + 4, 4 * chains + 12
    lines = ["{", ".reg .b32 a<4>, sh<3>;"]
    for s in range(4):
        lines += _dequant(f"${words + s}", magic, high_in_place=in_place)
        chain, first = _chain(s, chains, halves)
        c = _regs(d_in + 4 * chain) if first else _regs(4 * chain)
        b = f"{{${x + 2 * s}, ${x + 1 + 2 * s}}}"
        lines.append(_mma(ab_type, _regs(4 * chain), "{a0, a1, a2, a3}", b, c))
    lines.append("}")
    return "\n".join(lines)


def _s_asm(dtype: torch.dtype, chains: int = 1, halves: bool = False) -> str:
    """PTX for one 64-k chunk: x_sum += 1 @ x (the activations' sum, every row alike);
    the steps go to the accumulators as in `_d_asm`.

    Operands: x_sum out (4 per chain), the activation pairs, x_sum in (4 per chain).
    """
    ab_type, one = _ab_type(dtype), MAGIC[dtype][2]
    x, s_in = 4 * chains, 4 * chains + 8
    lines = ["{", ".reg .b32 one;", f"mov.b32 one, {one:#x};"]
    for s in range(4):
        chain, first = _chain(s, chains, halves)
        c = _regs(s_in + 4 * chain) if first else _regs(4 * chain)
        b = f"{{${x + 2 * s}, ${x + 1 + 2 * s}}}"
        lines.append(_mma(ab_type, _regs(4 * chain), "{one, one, one, one}", b, c))
    lines.append("}")
    return "\n".join(lines)


def _ab_type(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f16"


def _constraints(outputs: int, registers: int, inputs: int) -> str:
    return ",".join(["=f"] * outputs + ["r"] * registers + ["f"] * inputs)


# CHAINS (accumulators per mma chain) -> (D's PTX by dtype, its constraints, x_sum's PTX by
# dtype, its constraints). D: D out; words and activation pairs; D in. x_sum: the same
# without the words.
PTX = {
    chains: (
        {dt: _d_asm(dt, chains) for dt in MAGIC},
        _constraints(4 * chains, 12, 4 * chains),
        {dt: _s_asm(dt, chains) for dt in MAGIC},
        _constraints(4 * chains, 8, 4 * chains),
    )
    for chains in (1, 2)
}
# Groups of 32: two accumulators a chain, steps 0-1 in the first and 2-3 in the second.
HALVES_PTX = (
    {dt: _d_asm(dt, 2, halves=True) for dt in MAGIC},
    _constraints(8, 12, 8),
    {dt: _s_asm(dt, 2, halves=True) for dt in MAGIC},
    _constraints(8, 8, 8),
)


def _dequant_asm(dtype: torch.dtype) -> str:
    """PTX for a lane's four words of a 64-k chunk (k16 steps s, $16..$19) -> their A
    registers, dequantized once for every token tile the GEMM multiplies them by: output
    4r + s (output tensor r, element s) is A register r of step s's word."""
    magic, in_place = MAGIC[dtype][0], HIGH_ROWS[dtype] > 1
    lines = ["{", ".reg .b32 a<4>, sh<3>;"]
    for s in range(4):
        lines += _dequant(f"${16 + s}", magic, high_in_place=in_place)
        lines += [f"mov.b32 ${4 * r + s}, a{r};" for r in range(4)]
    lines.append("}")
    return "\n".join(lines)


def _tile_mma_asm(dtype: torch.dtype, halves: bool) -> str:
    """PTX for one 64-k chunk of one token tile (8 activation rows) and row block: the four
    k16 steps' A registers (from `_dequant_asm`) -> four mma into D (with `halves`, steps
    0-1 into the first accumulator and 2-3 into the second, one g32 group each).

    Operands: D out (4 per accumulator), the A registers (4r + s: register r of step s),
    the lane's eight activation pairs of the tile (step s takes pairs 2s and 2s + 1), D in.
    """
    ab_type, outputs = _ab_type(dtype), 8 if halves else 4
    a, x, d_in = outputs, outputs + 16, outputs + 24
    lines = []
    for s in range(4):
        chain, first = _chain(s, 2 if halves else 1, halves)
        c = _regs(d_in + 4 * chain) if first else _regs(4 * chain)
        regs = "{" + ", ".join(f"${a + 4 * r + s}" for r in range(4)) + "}"
        b = f"{{${x + 2 * s}, ${x + 1 + 2 * s}}}"
        lines.append(_mma(ab_type, _regs(4 * chain), regs, b, c))
    return "\n".join(lines)


# The GEMM's PTX by dtype: (dequantize, its constraints; a tile's mma, its constraints;
# x_sum, its constraints), one accumulator a tile (groups of 64 and 128) or two (of 32).
GEMM_PTX = {
    halves: (
        {dt: _dequant_asm(dt) for dt in MAGIC},
        ",".join(["=r"] * 16 + ["r"] * 4),
        {dt: _tile_mma_asm(dt, halves) for dt in MAGIC},
        _constraints(8 if halves else 4, 24, 8 if halves else 4),
        {dt: _s_asm(dt, 2 if halves else 1, halves) for dt in MAGIC},
        _constraints(8 if halves else 4, 8, 8 if halves else 4),
    )
    for halves in (False, True)
}


def _f32(value: float) -> str:
    """A PTX fp32 immediate, exactly (0fXXXXXXXX)."""
    return "0f" + struct.pack(">f", value).hex().upper()


def scales_asm(dtype: torch.dtype, symmetric: bool) -> str:
    """PTX: the 16 bytes of a group's scales that lane 4g + t loads ($8..$11, four words of
    two fp16 each) and g % 4 ($12) -> the scale ($0..$3) and the correction
    min - OFFSET * scale ($4..$7) of its C elements 0..3 (rows g, g, g + 8, g + 8), fp32.

    Asymmetric tiles hold two words a g, (scale, min) of row g then of row g + 8: the
    lane's are words 0-1 of its 16 bytes for even g, 2-3 for odd. Symmetric tiles hold one
    word a g, (scale of row g, scale of row g + 8), word g % 4 of the 16 bytes; the min is
    -8 * scale. Rows g + 8 came
    out of the mma HIGH_ROWS times too large, so their scale is divided by it (exact: a
    power of two). Every product here is exact in fp32 (an fp16 times a power of two, or
    times 136 / 1032 / 72, two set bits), so the correction rounds once, as the fused
    multiply-add of the Triton code it replaces did: the same bits.
    """
    offset, high = MAGIC[dtype][1], HIGH_ROWS[dtype]
    lines = [
        "{",
        ".reg .b16 h<4>;",
        ".reg .b32 w0, w1, w2, w3;",
        ".reg .pred odd, high;",
        ".reg .f32 s0, s1, m0, m1, c0, c1;",
        "and.b32 w0, $12, 1;",
        "setp.ne.b32 odd, w0, 0;",
    ]
    if symmetric:
        lines += [
            "and.b32 w0, $12, 2;",
            "setp.ne.b32 high, w0, 0;",
            "selp.b32 w1, $9, $8, odd;",
            "selp.b32 w2, $11, $10, odd;",
            "selp.b32 w0, w2, w1, high;",
            "mov.b32 {h0, h1}, w0;",
            "cvt.f32.f16 s0, h0;",
            "cvt.f32.f16 s1, h1;",
            f"mul.f32 c0, s0, {_f32(-(8 + offset))};",
            f"mul.f32 c1, s1, {_f32(-(8 + offset / high))};",
        ]
        if high != 1:
            lines.append(f"mul.f32 s1, s1, {_f32(1 / high)};")
    else:
        lines += [
            "selp.b32 w0, $10, $8, odd;",
            "selp.b32 w1, $11, $9, odd;",
            "mov.b32 {h0, h1}, w0;",
            "mov.b32 {h2, h3}, w1;",
            "cvt.f32.f16 s0, h0;",
            "cvt.f32.f16 m0, h1;",
            "cvt.f32.f16 s1, h2;",
            "cvt.f32.f16 m1, h3;",
        ]
        if high != 1:
            lines.append(f"mul.f32 s1, s1, {_f32(1 / high)};")
        lines += [
            f"fma.rn.f32 c0, s0, {_f32(-offset)}, m0;",
            f"fma.rn.f32 c1, s1, {_f32(-offset)}, m1;",
        ]
    lines += [
        "mov.b32 $0, s0;",
        "mov.b32 $1, s0;",
        "mov.b32 $2, s1;",
        "mov.b32 $3, s1;",
        "mov.b32 $4, c0;",
        "mov.b32 $5, c0;",
        "mov.b32 $6, c1;",
        "mov.b32 $7, c1;",
        "}",
    ]
    return "\n".join(lines)


def group_step_constants(
    dtype: torch.dtype, chains: int, group_size: int = 64, symmetric: bool = False
) -> dict[str, object]:
    """The constexprs a kernel built on w4a16_mma's group step takes for activations of
    `dtype`, `chains` accumulators a chain, groups of `group_size` and tiles with or without
    mins (`symmetric`): OFFSET, HIGH and the PTX with its constraints. Groups of 32 take two
    chains, one a group (HALVES_PTX)."""
    if group_size == 32 and chains != 2:
        raise ValueError(f"groups of 32 take CHAINS 2 (one accumulator a group), got {chains}")
    d_asm, d_constraints, s_asm, s_constraints = HALVES_PTX if group_size == 32 else PTX[chains]
    return {
        "OFFSET": MAGIC[dtype][1],
        "HIGH": HIGH_ROWS[dtype],
        "D_ASM": d_asm[dtype],
        "D_CONSTRAINTS": d_constraints,
        "S_ASM": s_asm[dtype],
        "S_CONSTRAINTS": s_constraints,
        "SM_ASM": scales_asm(dtype, symmetric),
    }
