"""The PTX that paged_attention/mma.py's kernel issues through tl.inline_asm_elementwise.

Every block works on one lane's four elements of [128] tensors (pack = 4): operand
$0-$3 are the output's four, then four per input tensor in the order given. Lane
4g + t (group g, thread t of the mma fragments) holds query head g's state; the
docstring of paged_attention/mma.py draws which tokens and dims each element is.
"""

from __future__ import annotations

FULL_MASK = "0xffffffff"


def _outputs(kind: str) -> list[str]:
    return [f"={kind}"] * 4


def _constraints(out_kind: str, in_kinds: list[str]) -> str:
    return ",".join(_outputs(out_kind) + [kind for kind in in_kinds for _ in range(4)])


def _replicate(reg: str) -> list[str]:
    return [f"mov.b32 ${i}, {reg};" for i in range(4)]


def _quad(op: str) -> str:
    """The `op` (max or add) of the lane's four elements and its quad's (lanes 4g..4g+3)."""
    lines = ["{", ".reg .f32 m, o;", f"{op}.f32 m, $4, $5;", f"{op}.f32 m, m, $6;"]
    lines.append(f"{op}.f32 m, m, $7;")
    for offset in (1, 2):
        lines.append(f"shfl.sync.bfly.b32 o, m, {offset}, 0x1f, {FULL_MASK};")
        lines.append(f"{op}.f32 m, m, o;")
    lines += [*_replicate("m"), "}"]
    return "\n".join(lines)


QUAD_MAX = _quad("max")

# Running max of head g: max(a's and b's four elements over the quad, running's first
# element), replicated. Only element 0 of `running` is read, so a loop-carried running
# max is one register, not four.
RUN_MAX = "\n".join(
    ["{", ".reg .f32 m, o;", "max.f32 m, $4, $5;"]
    + [f"max.f32 m, m, ${i};" for i in (6, 7, 8, 9, 10, 11)]
    + [
        f"shfl.sync.bfly.b32 o, m, {offset}, 0x1f, {FULL_MASK};\nmax.f32 m, m, o;"
        for offset in (1, 2)
    ]
    + ["max.f32 m, m, $12;", *_replicate("m"), "}"]
)
RUN_MAX_CONSTRAINTS = _constraints("f", ["f", "f", "f"])
QUAD_SUM = _quad("add")
QUAD_CONSTRAINTS = _constraints("f", ["f"])

# exp2(a - b) of a lane's first elements (values replicated in the lane), replicated.
EXP2_DIFF = "\n".join(
    ["{", ".reg .f32 d;", "sub.f32 d, $4, $8;", "ex2.approx.ftz.f32 d, d;", *_replicate("d"), "}"]
)
EXP2_DIFF_CONSTRAINTS = _constraints("f", ["f", "f"])


def _spread(prologue: list[str], value: str) -> str:
    """Head g's `value` (replicated in lane 4g + t) -> (head 2t, head 2t + 1, head 2t,
    head 2t + 1): the heads of the lane's P.V accumulator elements."""
    lines = ["{", ".reg .b32 lane, src, a, b;", *prologue, "mov.u32 lane, %laneid;"]
    lines += ["and.b32 src, lane, 3;", "shl.b32 src, src, 3;"]
    lines += [f"shfl.sync.idx.b32 a, {value}, src, 0x1f, {FULL_MASK};", "add.u32 src, src, 4;"]
    lines += [f"shfl.sync.idx.b32 b, {value}, src, 0x1f, {FULL_MASK};"]
    lines += ["mov.b32 $0, a;", "mov.b32 $1, b;", "mov.b32 $2, a;", "mov.b32 $3, b;", "}"]
    return "\n".join(lines)


SPREAD = _spread([], "$4")
SPREAD_CONSTRAINTS = _constraints("f", ["f"])
# SPREAD of exp2(a - b): the rescale factor of the accumulator's heads.
SPREAD_EXP2_DIFF = _spread([".reg .f32 d;", "sub.f32 d, $4, $8;", "ex2.approx.ftz.f32 d, d;"], "d")
SPREAD_EXP2_DIFF_CONSTRAINTS = _constraints("f", ["f", "f"])


# Two fp32 -> one fp16 pair (elementwise, pack = 1): $0 = (lo: $1, hi: $2).
PAIR_F16 = "cvt.rn.f16x2.f32 $0, $2, $1;"
PAIR_CONSTRAINTS = "=r,f,f"
# Fast base-2 exp and log, reciprocal (elementwise); subnormal results flush to zero.
EXP2 = "ex2.approx.ftz.f32 $0, $1;"
LOG2 = "lg2.approx.ftz.f32 $0, $1;"
RCP = "rcp.approx.ftz.f32 $0, $1;"
UNARY_CONSTRAINTS = "=f,f"

# Four probabilities (tokens 4t .. 4t + 3 of a half) -> the fp16 pairs of the P.V B
# operand: (b0, b1, b0, b1).
P_F16 = "\n".join(
    [
        "{",
        ".reg .b32 b0, b1;",
        "cvt.rn.f16x2.f32 b0, $5, $4;",
        "cvt.rn.f16x2.f32 b1, $7, $6;",
        "mov.b32 $0, b0;",
        "mov.b32 $1, b1;",
        "mov.b32 $2, b0;",
        "mov.b32 $3, b1;",
        "}",
    ]
)
P_CONSTRAINTS = _constraints("r", ["f"])


def _qk_asm(head_dim: int) -> str:
    """S = q K^T for one 16-token half: fp16 m16n8k16 with q's head g in row g (rows
    8-15 -q, their scores dropped) and K, converted from int8 codes in registers, as the B operand: column n of
    the two n-tiles is token pi(n) and pi(n) + 2 of the half.

    Inputs: the lane's A fragments of q, one tensor per k step (Q_QUADS' outputs: D / 16
    tensors, four registers each), then its K words of its two tokens (D / 16 each: dims
    t D/4 + 4s .. + 3; D / 64 tensors each). Outputs the four scores of tokens 4t .. 4t + 3.
    """
    words = head_dim // 16
    ka, kb = 4 + 4 * words, 4 + 5 * words
    lines = ["{", ".reg .f32 c<8>;", ".reg .b32 b0, b1, u, bias;"]
    lines += [f"mov.f32 c{i}, 0f00000000;" for i in range(8)]
    lines += ["mov.b32 bias, 0x64806480;"]  # (1152, 1152) in fp16
    for step in range(words):
        a = ", ".join(f"${4 + 4 * step + r}" for r in range(4))
        for tile, k_first in ((0, ka), (1, kb)):
            c = ", ".join(f"c{4 * tile + i}" for i in range(4))
            # int8 codes -> fp16, exactly: c + 128 as a byte under the exponent of 1024
            # is the fp16 1152 + c; the bias comes off in one f16x2 subtract.
            lines += [
                f"xor.b32 u, ${k_first + step}, 0x80808080;",
                "prmt.b32 b0, u, 0x64646464, 0x4140;",
                "prmt.b32 b1, u, 0x64646464, 0x4342;",
                "sub.rn.f16x2 b0, b0, bias;",
                "sub.rn.f16x2 b1, b1, bias;",
                f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{c}}}, {{{a}}}, {{b0, b1}}, {{{c}}};",
            ]
    lines += ["mov.b32 $0, c0;", "mov.b32 $1, c1;", "mov.b32 $2, c4;", "mov.b32 $3, c5;", "}"]
    return "\n".join(lines)


# A pair tensor of q (pairs 4c .. 4c + 3 of the lane) -> the A fragments of k steps 2c and
# 2c + 1: (pair 4c, -pair 4c, pair 4c + 1, -pair 4c + 1), (pair 4c + 2, ...). Rows 8-15
# (registers 1 and 3) hold -q, whose scores the kernel ignores, rather than zeros: four
# distinct values, built once before the loop, that the register allocator can keep as
# the mma's quads (zeros are constants it rebuilds beside each mma).
Q_QUADS = "\n".join(
    line
    for reg in range(4)
    for line in (
        f"mov.b32 ${2 * reg}, ${8 + reg};",
        f"xor.b32 ${2 * reg + 1}, ${8 + reg}, 0x80008000;",
    )
)
Q_QUADS_CONSTRAINTS = ",".join(["=r"] * 8 + ["r"] * 4)


def _pv_asm(head_dim: int, mtile: int) -> str:
    """O^T[dims of m-tile mtile] += V^T P^T for one half: fp16 m16n8k16, the lane's V
    bytes (int8 codes) of tokens 4t .. 4t + 3 paired two tokens a register and converted
    in place, as the QK block converts K.

    Inputs: the P pairs (P_F16's output), the lane's V words (tokens 4t .. 4t + 3, D / 32
    words each, four per tensor), the accumulator. Row g of the tile is the lane's dim
    2 mtile, row g + 8 dim 2 mtile + 1 (of its D / 8).
    """
    words = head_dim // 32  # per token and lane
    word, byte = divmod(2 * mtile, 4)
    select = byte | (4 + byte) << 4 | (byte + 1) << 8 | (5 + byte) << 12
    v = [f"${8 + token * words + word}" for token in range(4)]
    acc = 8 + words * 4  # first operand of the accumulator input
    return "\n".join(
        [
            "{",
            ".reg .b32 x01, x23, a0, a1, a2, a3, bias;",
            "mov.b32 bias, 0x64806480;",  # (1152, 1152) in fp16
            f"prmt.b32 x01, {v[0]}, {v[1]}, {select:#x};",
            f"prmt.b32 x23, {v[2]}, {v[3]}, {select:#x};",
            # int8 codes -> fp16 exactly, as in the QK block: a0 = (token 0, token 1) of
            # the first dim, a1 of the second; a2, a3 tokens 2 and 3
            "xor.b32 x01, x01, 0x80808080;",
            "xor.b32 x23, x23, 0x80808080;",
            "prmt.b32 a0, x01, 0x64646464, 0x4140;",
            "prmt.b32 a1, x01, 0x64646464, 0x4342;",
            "prmt.b32 a2, x23, 0x64646464, 0x4140;",
            "prmt.b32 a3, x23, 0x64646464, 0x4342;",
            "sub.rn.f16x2 a0, a0, bias;",
            "sub.rn.f16x2 a1, a1, bias;",
            "sub.rn.f16x2 a2, a2, bias;",
            "sub.rn.f16x2 a3, a3, bias;",
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            f"{{a0, a1, a2, a3}}, {{$4, $5}}, {{${acc}, ${acc + 1}, ${acc + 2}, ${acc + 3}}};",
            "}",
        ]
    )


HEAD_DIMS = (64, 128)
QK = {d: _qk_asm(d) for d in HEAD_DIMS}
QK_CONSTRAINTS = {d: _constraints("f", ["r"] * (d // 16 + d // 32)) for d in HEAD_DIMS}
PV = {d: tuple(_pv_asm(d, m) for m in range(d // 16)) for d in HEAD_DIMS}
PV_CONSTRAINTS = {d: _constraints("f", ["r"] + ["r"] * (d // 32) + ["f"]) for d in HEAD_DIMS}


# Loads: one block per half and kind, a register's worth of addressing for all of it.
# Operands after the outputs (four per output tensor): the half's base address (uniform),
# the lane's byte offset and first token, and how many of the half's tokens are in the
# context (uniform): a token at or past it is not loaded. `.nc`: pages and scales do not
# change during the kernel.
def _load_header(inputs: int) -> tuple[list[str], list[str]]:
    """PTX prologue -> (lines, [base, lane offset, token, left] operand names)."""
    first = 4 * inputs  # outputs come first
    names = [f"${first + 4 * i}" for i in range(4)]
    lines = ["{", ".reg .pred p<4>;", ".reg .b64 a;", ".reg .s64 o;", ".reg .s32 tk;"]
    lines += [f"cvt.s64.s32 o, {names[1]};", f"add.s64 a, {names[0]}, o;"]
    return lines, names


def _guard(pred: int, token: str, plus: int, left: str) -> list[str]:
    if plus == 0:
        return [f"setp.lt.s32 p{pred}, {token}, {left};"]
    return [f"add.s32 tk, {token}, {plus};", f"setp.lt.s32 p{pred}, tk, {left};"]


def _load_k(head_dim: int, row: int, guarded: bool = True) -> str:
    """K of the lane's two tokens (tok, tok + 2): its D / 4 bytes of each, 16 at a time.
    Outputs D / 64 tensors per token (token tok's first); a token not loaded leaves
    whatever the registers held (its score is masked). Unguarded: every token is loaded
    (a half wholly inside the context; token and left are not read)."""
    vectors = head_dim // 64
    lines, (_, _, token, left) = _load_header(2 * vectors)
    for tok in range(2):
        if guarded:
            lines += _guard(tok, token, 2 * tok, left)
        for v in range(vectors):
            out = ", ".join(f"${4 * (tok * vectors + v) + r}" for r in range(4))
            when = f"@p{tok} " if guarded else ""
            lines.append(f"{when}ld.global.nc.v4.b32 {{{out}}}, [a+{2 * tok * row + 16 * v}];")
    return "\n".join([*lines, "}"])


def _load_v(head_dim: int, row: int, guarded: bool = True) -> str:
    """V of the lane's tokens tok .. tok + 3: its D / 8 bytes of each (D / 32 words).
    Outputs D / 32 tensors, four words each in token order; a token not loaded leaves
    zeros (its probability is 0). Unguarded: all four are loaded."""
    words = head_dim // 32
    lines, (_, _, token, left) = _load_header(words)
    if guarded:
        lines += [f"mov.b32 ${i}, 0;" for i in range(4 * words)]
    for tok in range(4):
        if guarded:
            lines += _guard(tok, token, tok, left)
        out = ", ".join(f"${tok * words + r}" for r in range(words))
        when = f"@p{tok} " if guarded else ""
        lines.append(f"{when}ld.global.nc.v{words}.b32 {{{out}}}, [a+{tok * row}];")
    return "\n".join([*lines, "}"])


def _load_constraints(outputs: int) -> str:
    return ",".join(["=r"] * (4 * outputs) + ["l"] * 4 + ["r"] * 12)


def load_k(head_dim: int, row: int, guarded: bool = True) -> tuple[str, str]:
    """(PTX, constraints) of the K load for head dim `head_dim`, `row` bytes a token."""
    return _load_k(head_dim, row, guarded), _load_constraints(2 * (head_dim // 64))


def load_v(head_dim: int, row: int, guarded: bool = True) -> tuple[str, str]:
    return _load_v(head_dim, row, guarded), _load_constraints(head_dim // 32)


# The four consecutive bf16 K scales and V scales of tokens tok .. tok + 3, loaded if tok
# is in the context -> element j = (K scale of token tok + j) << 16 | its V scale.
# Operands: K-scale base ($4), V-scale base ($8) (uniform), lane offset ($12), token
# ($16), left ($20).
def _load_scales(guarded: bool) -> str:
    when = "@p " if guarded else ""
    return "\n".join(
        [
            "{",
            ".reg .pred p;",
            ".reg .b64 a, b;",
            ".reg .s64 o;",
            ".reg .b32 w0, w1, x0, x1;",
            *(["setp.lt.s32 p, $16, $20;"] if guarded else []),
            "cvt.s64.s32 o, $12;",
            "add.s64 a, $4, o;",
            "add.s64 b, $8, o;",
            f"{when}ld.global.nc.v2.b32 {{w0, w1}}, [a];",
            f"{when}ld.global.nc.v2.b32 {{x0, x1}}, [b];",
            "prmt.b32 $0, x0, w0, 0x5410;",
            "prmt.b32 $1, x0, w0, 0x7632;",
            "prmt.b32 $2, x1, w1, 0x5410;",
            "prmt.b32 $3, x1, w1, 0x7632;",
            "}",
        ]
    )


LOAD_SCALES = _load_scales(guarded=True)
LOAD_SCALES_FULL = _load_scales(guarded=False)  # every token of the half in the context
LOAD_SCALES_CONSTRAINTS = ",".join(["=r"] * 4 + ["l"] * 8 + ["r"] * 12)
