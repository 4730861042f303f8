"""The PTX that w4a16_mma.py's kernel issues through tl.inline_asm_elementwise.

Per lane and 64-k chunk (pack = 4: a lane's four words, or its four C elements):
four words -> four `mma.sync.m16n8k16` into D, and four more with A = 1 into
x_sum. The magic constants put a nibble under the exponent of 128 (bf16) or 1024
(fp16), so one LOP3 makes two exact 16-bit values (int4.py draws the layout).
"""

from __future__ import annotations

import torch

# activation dtype -> (LOP3 magic: two 16-bit floats 2^e, its value 2^e, two 1.0s)
MAGIC = {
    torch.bfloat16: (0x43004300, 128.0, 0x3F803F80),  # 128 + q; 1.0
    torch.float16: (0x64006400, 1024.0, 0x3C003C00),  # 1024 + q; 1.0
}


def _mma(ab_type: str, d: str, a: str, b: str, c: str) -> str:
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32 {d}, {a}, {b}, {c};"


def _d_asm(ab_type: str, magic: int) -> str:
    """PTX for one 64-k chunk of one lane and row block: four words -> four mma into D.

    Operands: $0-$3 D out, $4-$7 the words (k16 step s), $8-$11 and $12-$15 the
    lane's eight activation pairs (step s takes pairs 2s and 2s + 1), $16-$19 D in.
    """
    lines = ["{", ".reg .b32 a<4>, sh<3>;"]
    for s in range(4):
        word = f"${4 + s}"
        for r in range(4):
            src = word
            if r:
                lines.append(f"shr.u32 sh{r - 1}, {word}, {4 * r};")
                src = f"sh{r - 1}"
            # (src & 0x000F000F) | magic: the LOP3 truth table 0xEA is (a & b) | c
            lines.append(f"lop3.b32 a{r}, {src}, 0x000F000F, {magic:#x}, 0xEA;")
        c = "{$16, $17, $18, $19}" if s == 0 else "{$0, $1, $2, $3}"
        b = f"{{${8 + 2 * s}, ${9 + 2 * s}}}"
        lines.append(_mma(ab_type, "{$0, $1, $2, $3}", "{a0, a1, a2, a3}", b, c))
    lines.append("}")
    return "\n".join(lines)


def _s_asm(ab_type: str, one: int) -> str:
    """PTX for one 64-k chunk: x_sum += 1 @ x (the activations' sum, every row alike).

    Operands: $0-$3 x_sum out, $4-$7 and $8-$11 the activation pairs, $12-$15 x_sum in.
    """
    lines = ["{", ".reg .b32 one;", f"mov.b32 one, {one:#x};"]
    for s in range(4):
        c = "{$12, $13, $14, $15}" if s == 0 else "{$0, $1, $2, $3}"
        b = f"{{${4 + 2 * s}, ${5 + 2 * s}}}"
        lines.append(_mma(ab_type, "{$0, $1, $2, $3}", "{one, one, one, one}", b, c))
    lines.append("}")
    return "\n".join(lines)


def _ab_type(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f16"


D_ASM = {dt: _d_asm(_ab_type(dt), magic) for dt, (magic, _, _) in MAGIC.items()}
S_ASM = {dt: _s_asm(_ab_type(dt), one) for dt, (_, _, one) in MAGIC.items()}
D_CONSTRAINTS = ",".join(["=f"] * 4 + ["r"] * 12 + ["f"] * 4)  # D out; words, x; D in
S_CONSTRAINTS = ",".join(["=f"] * 4 + ["r"] * 8 + ["f"] * 4)  # x_sum out; x; x_sum in
