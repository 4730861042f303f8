"""A chain of square W4A16 decode GEMVs in one persistent launch: y_l = y_{l-1} @ W_l^T.

A decode step is a chain of products, each reading the one before. Launched one kernel a
product (w4a16_mma.py), every product pays a launch's fixed costs: the grid filling the
multiprocessors, its first loads' latency with nothing in flight, the tail where the last
programs run alone, and the split sum's round trip through L2 before the next launch may
read y. At 4096x4096 those costs are a third of the call (docs/bench/w4a16_gemv.md: a plain
read of its bytes takes 4.2 us against the 2.1 us its bytes take at the copy bandwidth).

Here one grid runs every layer. Each program walks its (row blocks, split) share of layer
0, then of layer 1, and so on. Between layers it puts the next layer's first weight step in
flight (the weights are nobody's output) and then waits at a barrier in global memory
until every column of the previous layer's y is written: a counter a layer that the
program summing a column's partials moves (release) once its y is stored, polled by the
others (acquire). So each layer's weights start streaming while the previous layer's split
sums finish, and no layer pays a launch.

The barrier needs every program of the grid resident at once: the launch checks the
compiled kernel's registers and shared memory against the GPU (resident_programs) and
lowers the split count until the grid fits. A wait that runs past `max_spins` polls gives
up and raises the status flag rather than hang the GPU; the wrapper checks it where asked
(`check=True`, tests), since reading it back costs a synchronisation.

Each layer is the GEMV's own arithmetic and order (w4a16_mma.py, its one-buffer loop over
asymmetric tiles; the split sum in split order), so a chain gives the bits of the same
launches one at a time (GPU test). The layers' tiles are one stacked storage
(`MMAChain`): one layer stride, so the tile pointers keep the 16-byte alignment the
vector loads need. Square layers only (K = N): a chain of products of one shape, as the
benchmarks time them (benchmarks/bench_w4a16_chain.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_node.kernels.launch import has_mma_sync, launches_early
from gpu_node.kernels.w4a16 import is_interpreted, num_sms
from gpu_node.kernels.w4a16_gemv import MAX_M
from gpu_node.kernels.w4a16_mma_asm import MAGIC, group_step_constants
from gpu_node.kernels.w4a16_mma_plan import EARLY_AT_TAIL, mma_gemv_config
from gpu_node.kernels.w4a16_mma_step import fragment, load_step_fp16, mma_group_step
from gpu_node.quant.int4 import MMA_ROWS, Int4WeightMMA, mma_step

__all__ = ["MMAChain", "chain_plan", "launch_splits", "w4a16_mma_chain"]

# Polls of a layer's barrier before a program gives up on it (status flag 1): about a
# second at the poll's back-off, far past any layer's time, so only a grid that is not all
# resident (a bug) ever reaches it.
MAX_SPINS = 1 << 20


# Thread 0 of a program polls a barrier's flag (an acquire load, a short sleep between
# polls) until it is set, or gives up after $3 polls and raises the status flag; the other
# threads skip ahead, and the CTA barrier after the call holds them until thread 0 is back.
WAIT_PTX = tl.constexpr("""{
.reg .pred p;
.reg .u32 v, tid, n;
mov.u32 $0, 0;
mov.u32 tid, %tid.x;
setp.ne.u32 p, tid, 0;
@p bra DONE;
mov.u32 n, 0;
POLL:
ld.acquire.gpu.global.u32 v, [$1];
setp.ne.u32 p, v, 0;
@p bra DONE;
add.u32 n, n, 1;
setp.ge.u32 p, n, $3;
@p bra GIVE_UP;
nanosleep.u32 32;
bra POLL;
GIVE_UP:
red.relaxed.gpu.global.max.u32 [$2], 1;
DONE:
}""")


@triton.jit
def _wait_for(flag_ptr, status_ptr, max_spins):
    """Every thread of the program past the point where `flag_ptr`'s flag was set (and what
    was written before it was set visible), or the status raised."""
    flag = flag_ptr.to(tl.int64) + tl.zeros([1], tl.int64)
    status = status_ptr.to(tl.int64) + tl.zeros([1], tl.int64)
    spins = max_spins + tl.zeros([1], tl.int32)
    tl.inline_asm_elementwise(
        WAIT_PTX, "=r,l,l,r", [flag, status, spins], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.debug_barrier()


@triton.jit
def _opaque():
    """0, as an instruction the compiler may not move or fold (not pure)."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, 0;", "=r,r", [tl.full([1], 0, tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _weights_at(tiles_ptr, stride_tr, num_row_blocks, num_groups, zero, WARPS: tl.constexpr,
                R: tl.constexpr, SPLIT_K: tl.constexpr, CPG: tl.constexpr):  # fmt: skip
    """A layer's tile pointers, row-block mask and split range: the GEMV's (w4a16_mma.py)."""
    pid_n = tl.program_id(0) + tl.sum(zero, axis=0)
    pid_s = tl.program_id(1)
    i = tl.arange(0, R)[:, None]
    e = tl.arange(0, 128 * WARPS)[None, :]
    j, g, _ = fragment(e)
    rb = (pid_n * R + i) * WARPS + e // 128
    rb_ok = rb < num_row_blocks
    tile_at = tiles_ptr + tl.multiple_of(rb * stride_tr, [4, 4])
    words_at = tile_at + e % 128
    sm_at = (tile_at + 128 * CPG).to(tl.pointer_type(tl.float16)) + g * 4 + j
    g_begin = pid_s * num_groups // SPLIT_K
    g_end = (pid_s + 1) * num_groups // SPLIT_K
    return words_at, sm_at, rb_ok, g_begin, g_end


def prefetch_ptx(chunks: int) -> str:
    """PTX: warp w, lane l of a program asks L2 for the 16 bytes a lane loads of each chunk
    of row block w's tile (`chunks` of 512 bytes from $1 + w * $2) and lane 0 for its
    scales after them; warps at or past $3 (row blocks past N) ask for nothing."""
    lines = [
        "{",
        ".reg .pred p;",
        ".reg .u32 tid, w, l;",
        ".reg .u64 t, o;",
        "mov.b32 $0, 0;",
        "mov.u32 tid, %tid.x;",
        "shr.u32 w, tid, 5;",
        "and.b32 l, tid, 31;",
        "setp.ge.u32 p, w, $3;",
        "@p bra END;",
        "mul.wide.u32 o, w, $2;",
        "add.u64 t, $1, o;",
        "mul.wide.u32 o, l, 16;",
        "add.u64 o, t, o;",
    ]
    lines += [f"prefetch.global.L2 [o+{512 * c}];" for c in range(chunks)]
    lines += [
        "setp.ne.u32 p, l, 0;",
        "@p bra END;",
        f"prefetch.global.L2 [t+{512 * chunks}];",
        "END:",
        "}",
    ]
    return "\n".join(lines)


@triton.jit
def _rest_to_l2(tiles_ptr, stride_tr, stride_tg, num_row_blocks, num_groups, live,
                WARPS: tl.constexpr, R: tl.constexpr, SPLIT_K: tl.constexpr,
                ASM: tl.constexpr):  # fmt: skip
    """A layer's steps after its first asked of L2 (words and scales), where `live`: one
    PTX call a row-block slot and step, in scalars (prefetch_ptx), so it holds no tensor
    of addresses."""
    pid_n = tl.program_id(0) + tl.sum(_opaque(), axis=0)
    pid_s = tl.program_id(1)
    g_begin = pid_s * num_groups // SPLIT_K
    g_end = (pid_s + 1) * num_groups // SPLIT_K
    if live:
        for step in range(g_begin + 1, g_end):
            for i in tl.static_range(R):
                rb0 = (pid_n * R + i) * WARPS
                at = (tiles_ptr + rb0 * stride_tr + step * stride_tg).to(tl.int64)
                tl.inline_asm_elementwise(
                    ASM, "=r,l,r,r",
                    [at + tl.zeros([1], tl.int64), stride_tr * 4 + tl.zeros([1], tl.int32),
                     num_row_blocks - rb0 + tl.zeros([1], tl.int32)],
                    dtype=tl.int32, is_pure=False, pack=1,
                )  # fmt: skip


@triton.jit
def _first_step(tiles_ptr, stride_tr, stride_tg, num_row_blocks, num_groups, live,
                WARPS: tl.constexpr, R: tl.constexpr, SPLIT_K: tl.constexpr, CPG: tl.constexpr,
                SUBS: tl.constexpr, SM2: tl.constexpr):  # fmt: skip
    """A layer's first step of weights, loaded (masked off where not `live`)."""
    words_at, sm_at, rb_ok, g_begin, _ = _weights_at(
        tiles_ptr, stride_tr, num_row_blocks, num_groups, _opaque(), WARPS, R, SPLIT_K, CPG
    )
    return load_step_fp16(words_at, sm_at, g_begin, stride_tg, rb_ok & live, CPG, SUBS, SM2)


@triton.jit
def _column_written(ready_at, go_at, FAN: tl.constexpr):
    """One more column of the layer's y written (every thread's stores before the count);
    the last sets the go flags, which the count's acquire orders after every column."""
    tl.debug_barrier()
    columns = tl.atomic_add(ready_at, 1, sem="acq_rel")
    if columns == tl.num_programs(0) - 1:
        tl.atomic_xchg(go_at + tl.arange(0, FAN) * 32, 1, sem="release")


@triton.jit
def _layer_epilogue(acc, out_ptr, part_ptr, count_ptr, ready_at, go_at, M, N, num_row_blocks,
                    zero, WARPS: tl.constexpr, R: tl.constexpr, SPLIT_K: tl.constexpr,
                    FAN: tl.constexpr):  # fmt: skip
    """A layer's y from its programs' sums, as the GEMV's split-K epilogue, then the
    layer's barrier: the program that wrote a column counts it (release), and the one that
    counts the last column sets the layer's go flags."""
    E: tl.constexpr = 128 * WARPS
    pid_n = tl.program_id(0) + tl.sum(zero, axis=0)
    pid_s = tl.program_id(1)
    i = tl.arange(0, R)[:, None]
    e = tl.arange(0, E)[None, :]
    j, g, t = fragment(e)
    rb = (pid_n * R + i) * WARPS + e // 128
    rb_ok = rb < num_row_blocks
    n_of = rb * 16 + g + 8 * (j // 2)
    m_of = 2 * t + (j % 2)
    out_mask = rb_ok & (n_of < N) & (m_of < M)
    out_at = out_ptr + m_of * N + n_of
    if SPLIT_K == 1:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        _column_written(ready_at, go_at, FAN)
    else:
        tile = R * E
        split_stride = tl.num_programs(0) * tile
        part_at = part_ptr + pid_n * tile + i * E + e
        part_mask = rb_ok & (2 * t < M)
        tl.store(part_at + pid_s * split_stride, acc, mask=part_mask)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.full((R, E), 0.0, tl.float32)
            RED: tl.constexpr = 8 // R
            for p0 in tl.range(0, SPLIT_K, RED, loop_unroll_factor=1):
                for q in tl.static_range(RED):
                    total += tl.load(
                        part_at + (p0 + q) * split_stride,
                        mask=part_mask & (p0 + q < SPLIT_K), other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _column_written(ready_at, go_at, FAN)


@triton.jit
def _chain_mma_kernel(
    x_ptr,  # int32 [M, K / 2]: bf16/fp16 pairs, layer 0's input
    ys_pairs_ptr,  # int32 [L, M, N / 2]: the layers' outputs as pairs, layer l + 1's input
    ys_ptr,  # [L, M, N] in x's dtype: the same storage, where the layers store y
    tiles_ptr,  # int32 [L, K / T, N16 / 16, 2T + 16 T / G]: layer 0's tiles
    stride_tl,  # between layers' tiles (int32)
    stride_tr,  # tiles' strides (int32) along row blocks and groups; the last is 1
    stride_tg,
    part_ptr,  # fp32 [S, programs along N, R, 128 W]
    count_ptr,  # int32 [programs along N]: the split counters, 0 between calls
    ready_ptr,  # int32 [L + 1]: columns of each layer's y written; then programs done
    go_ptr,  # int32 [L + 1, FAN, 32]: each layer's go flag, FAN copies on lines of their own
    status_ptr,  # int32 [1]: 1 once a wait gave up (the grid was not all resident)
    M,
    N,
    num_row_blocks,
    num_groups,
    num_layers,
    max_spins,
    GROUP_SIZE: tl.constexpr,
    WARPS: tl.constexpr,
    R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    OFFSET: tl.constexpr,
    HIGH: tl.constexpr,
    D_ASM: tl.constexpr,
    D_CONSTRAINTS: tl.constexpr,
    S_ASM: tl.constexpr,
    S_CONSTRAINTS: tl.constexpr,
    SM_ASM: tl.constexpr,
    CHAINS: tl.constexpr = 1,
    EARLY: tl.constexpr = 0,
    NEXT_FIRST: tl.constexpr = True,  # the next layer's first step loaded before the split sum
    FAN: tl.constexpr = 16,
    NO_WAIT: tl.constexpr = False,  # benchmarks: no layer waits for the last (y is wrong)
    PREFETCH: tl.constexpr = False,  # the next layer's other steps asked of L2 before the wait
    PREFETCH_ASM: tl.constexpr = "",  # prefetch_ptx(chunks a step)
):
    CPG: tl.constexpr = (GROUP_SIZE + 63) // 64
    SUBS: tl.constexpr = 64 * CPG // GROUP_SIZE
    SM2: tl.constexpr = 16
    num_cols = tl.num_programs(0)
    stride_tg = tl.multiple_of(stride_tg, 4)
    stride_tl = tl.multiple_of(stride_tl, 4)
    # Every layer recomputes its offsets and masks from the program ids through an opaque
    # zero (_opaque), so the compiler cannot hoist them out of the layer loop and keep them
    # all live through the step loop (106 registers against the GEMV's 52 when it did).
    a = _first_step(
        tiles_ptr, stride_tr, stride_tg, num_row_blocks, num_groups, True, WARPS, R, SPLIT_K,
        CPG, SUBS, SM2,
    )  # fmt: skip
    if EARLY != 0:
        gdc_wait()  # x, the counters and the buffers only once the previous kernel is done
    for layer in range(num_layers):
        words_at, sm_at, rb_ok, g_begin, g_end = _weights_at(
            tiles_ptr + layer * stride_tl, stride_tr, num_row_blocks, num_groups, _opaque(),
            WARPS, R, SPLIT_K, CPG,
        )  # fmt: skip
        if layer == 0:
            src = x_ptr
        else:
            # Layer - 1's y, every column of it: its go flag, one of FAN copies on lines of
            # their own (so the waiting programs do not all poll one L2 line).
            if not NO_WAIT:
                flat = tl.program_id(1) * num_cols + tl.program_id(0)
                _wait_for(go_ptr + ((layer - 1) * FAN + flat % FAN) * 32, status_ptr, max_spins)
            src = ys_pairs_ptr + (layer - 1) * (M * (N // 2))
        e = tl.arange(0, 128 * WARPS)[None, :]
        j, g, t = fragment(e)
        x_at = src + tl.where(g < M, g, 0) * (N // 2) + t * (8 // SUBS) + j  # [1, E]; + 32 c
        sm_mul = tl.where(j == 2, 1.0 / HIGH, 1.0)
        acc = tl.full((R, 128 * WARPS), 0.0, tl.float32)
        for grp in range(g_begin, g_end):
            b_mask = rb_ok & (grp + 1 < g_end)
            b = load_step_fp16(words_at, sm_at, grp + 1, stride_tg, b_mask, CPG, SUBS, SM2)
            acc = mma_group_step(
                acc, a, None, x_at, grp * CPG, CPG, 0, CHAINS, SUBS,
                D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM, sm_mul, True, OFFSET, HIGH,
            )  # fmt: skip
            a = b
        if EARLY == 2:  # noqa: SIM102 (a constexpr branch around a runtime one)
            if layer == num_layers - 1:
                gdc_launch_dependents()
        if NEXT_FIRST:  # the next layer's first step in flight behind this layer's split sum
            a = _first_step(
                tiles_ptr + (layer + 1) * stride_tl, stride_tr, stride_tg, num_row_blocks,
                num_groups, layer + 1 < num_layers, WARPS, R, SPLIT_K, CPG, SUBS, SM2,
            )  # fmt: skip
        _layer_epilogue(
            acc, ys_ptr + layer * (M * N), part_ptr, count_ptr, ready_ptr + layer,
            go_ptr + layer * FAN * 32, M, N, num_row_blocks, _opaque(), WARPS, R, SPLIT_K, FAN,
        )  # fmt: skip
        if PREFETCH:  # the next layer's other steps streaming into L2 while it waits
            _rest_to_l2(
                tiles_ptr + (layer + 1) * stride_tl, stride_tr, stride_tg, num_row_blocks,
                num_groups, layer + 1 < num_layers, WARPS, R, SPLIT_K, PREFETCH_ASM,
            )  # fmt: skip
        if not NEXT_FIRST:  # after it (fewer registers live through the epilogue)
            a = _first_step(
                tiles_ptr + (layer + 1) * stride_tl, stride_tr, stride_tg, num_row_blocks,
                num_groups, layer + 1 < num_layers, WARPS, R, SPLIT_K, CPG, SUBS, SM2,
            )  # fmt: skip
    # The last program out sets the barriers back to zero for the next call: every other
    # program has passed every barrier by then (its own count came after).
    tl.debug_barrier()
    out = tl.atomic_add(ready_ptr + num_layers, 1, sem="acq_rel")
    if out == num_cols * SPLIT_K - 1:
        for layer in range(num_layers + 1):
            tl.atomic_xchg(ready_ptr + layer, 0)
            tl.atomic_xchg(go_ptr + (layer * FAN + tl.arange(0, FAN)) * 32, 0)


@dataclass(frozen=True)
class MMAChain:
    """The tiles of L square INT4 layers of one shape in one storage, layer-major (a layer
    stride the kernel steps by): `storage` int32 [L, K / T, N16 / 16, width]."""

    storage: torch.Tensor
    shape: tuple[int, int]
    group_size: int

    @classmethod
    def from_weights(cls, weights: Sequence[Int4WeightMMA]) -> MMAChain:
        if not weights:
            raise ValueError("a chain takes at least one layer")
        first = weights[0]
        n, k = first.shape
        if n != k:
            raise ValueError(f"a chain takes square layers (each reads the last's y), got {n}x{k}")
        for w in weights:
            if w.shape != first.shape or w.group_size != first.group_size or w.symmetric:
                raise ValueError(
                    f"a chain takes asymmetric layers of one shape and group size; "
                    f"{first.shape}/g{first.group_size} and {w.shape}/g{w.group_size}"
                    f"{' symmetric' if w.symmetric else ''}"
                )
        storage = torch.stack([w.tiles.transpose(0, 1) for w in weights]).contiguous()
        return cls(storage=storage, shape=(n, k), group_size=first.group_size)

    @property
    def layers(self) -> int:
        return self.storage.shape[0]

    def layer(self, index: int) -> Int4WeightMMA:
        """Layer `index` as a weight of its own (a view of the storage)."""
        return Int4WeightMMA(
            tiles=self.storage[index].transpose(0, 1), shape=self.shape, group_size=self.group_size
        )

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


@dataclass(frozen=True)
class ChainPlan:
    programs: int  # along N
    splits: int
    rows_per_warp: int
    warps: int
    chains: int
    num_groups: int


def chain_plan(n: int, k: int, group_size: int, sms: int, resident: int | None = None,
               config: dict[str, int] | None = None) -> ChainPlan:  # fmt: skip
    """The GEMV heuristic's launch (mma_gemv_config, `config` over it) for one layer, its
    split count lowered until the grid fits `resident` programs (the GPU's, once the
    kernel is compiled), so that every program is resident for the barriers."""
    cfg = {**mma_gemv_config(n, k, group_size, sms), **(config or {})}
    warps, rows_per_warp = cfg["WARPS"], cfg["R"]
    num_groups = k // mma_step(group_size)
    programs = triton.cdiv(triton.cdiv(n, MMA_ROWS), warps * rows_per_warp)
    splits = int(cfg.get("SPLITS", triton.cdiv(num_groups, cfg["GROUPS_PER_SPLIT"])))
    if resident is not None:
        if programs > resident:
            raise ValueError(f"{programs} programs along N exceed the {resident} resident")
        splits = max(1, min(splits, resident // programs))
    return ChainPlan(programs, splits, rows_per_warp, warps, cfg["CHAINS"], num_groups)


FAN = 16  # copies of a layer's go flag
_STATE: dict[torch.device, tuple[torch.Tensor, ...]] = {}
_SPLITS: dict[tuple, int] = {}  # the split count a shape and config launch with
LAUNCHES: dict[tuple, dict[str, int]] = {}  # what each fitted launch found (benchmarks print it)


def _state(device: torch.device, layers: int) -> tuple[torch.Tensor, ...]:
    """The device's split counters, barrier counters (layers + 1), go flags and status
    flag: zero between calls, each call leaving them so. One set a device, as
    split_counters."""
    have = _STATE.get(device)
    if have is None or have[1].numel() < layers + 1:
        size = max(layers + 1, 64)
        have = (
            torch.zeros(4096, dtype=torch.int32, device=device),
            torch.zeros(size, dtype=torch.int32, device=device),
            torch.zeros(size, FAN, 32, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
        _STATE[device] = have
    return have


def resident_programs(kernel: CompiledKernel, warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel the GPU holds at once: the driver's occupancy for its
    function (cuOccupancyMaxActiveBlocksPerMultiprocessor), times the multiprocessors."""
    kernel._init_handles()  # loads the binary: its function handle
    blocks = ctypes.c_int(0)
    shared = kernel.metadata.shared
    err = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(kernel.function), 32 * warps, shared
    )
    if err:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: error {err}")
    return blocks.value * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def supports(x: torch.Tensor, chain: object) -> bool:
    return (
        isinstance(chain, MMAChain)
        and x.is_cuda
        and not is_interpreted(x)
        and has_mma_sync(x.device)
        and x.dtype in MAGIC
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
    )


def w4a16_mma_chain(
    x: torch.Tensor,
    chain: MMAChain,
    config: dict[str, int] | None = None,
    check: bool = False,
) -> torch.Tensor:
    """x [M, K] bf16/fp16 (1 <= M <= 8, CUDA) through every layer of `chain`: [L, M, N],
    each layer's y in x's dtype (the last is the chain's output).

    `config` overrides the GEMV heuristic's keys (R, GROUPS_PER_SPLIT, CHAINS, SPLITS,
    EARLY, MAXNREG: a register cap, NEXT_FIRST: 0 loads the next layer's first step after
    the split sum, PREFETCH: the next layer's other steps asked of L2 before the wait,
    NO_WAIT, benchmarks only: no layer waits for the last, so y is wrong);
    the split count is then lowered where the grid would
    not be resident (launch_splits says what a call ran). With `check` the call
    synchronises and raises if a barrier gave up."""
    n, k = chain.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if not supports(x, chain):
        raise ValueError(
            f"w4a16_mma_chain takes bf16/fp16 x of 1..{MAX_M} rows on CUDA (sm_80+, "
            f"compiled); got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if x.device != chain.storage.device:
        raise ValueError(f"x on {x.device}, chain on {chain.storage.device}")
    m = x.shape[0]
    device = x.device
    key, config, options = _options(x, chain, config)
    early, maxnreg, next_first, no_wait, prefetch = options
    sms = num_sms(device)
    plan = chain_plan(n, k, chain.group_size, sms, config=config)
    x = x.contiguous()
    if x.storage_offset() % 2:
        x = x.clone()
    pairs = x.view(torch.int32)
    layers = chain.layers
    ys = torch.empty(layers, m, n, device=device, dtype=x.dtype)
    counts, ready, go, status = _state(device, layers)
    if plan.programs > counts.numel():
        raise ValueError(f"{plan.programs} programs along N exceed {counts.numel()} counters")
    storage = chain.storage
    constexprs = {
        "GROUP_SIZE": chain.group_size,
        "WARPS": plan.warps,
        "R": plan.rows_per_warp,
        "CHAINS": plan.chains,
        "EARLY": early,
        "NEXT_FIRST": next_first,
        "FAN": FAN,
        "NO_WAIT": no_wait,
        "PREFETCH": prefetch,
        "PREFETCH_ASM": prefetch_ptx(-(-chain.group_size // 64)) if prefetch else "",
        **group_step_constants(x.dtype, plan.chains, chain.group_size),
        "num_warps": plan.warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **({"launch_pdl": True} if early else {}),
    }

    def args(splits: int) -> tuple:
        part = torch.empty(splits, plan.programs, plan.rows_per_warp, 128 * plan.warps,
                           device=device) if splits > 1 else ys  # fmt: skip
        return (
            pairs, ys.view(torch.int32), ys, storage, storage.stride(0), storage.stride(2),
            storage.stride(1), part, counts, ready, go, status, m, n, storage.shape[2],
            plan.num_groups, layers, MAX_SPINS,
        )  # fmt: skip

    # The split count fitted to what the GPU holds of the compiled kernel (which may
    # itself change with the split count, so until it stands), once a shape and config.
    splits = _SPLITS.get(key)
    if splits is None:
        splits = plan.splits
        for _ in range(4):
            compiled = _chain_mma_kernel.warmup(*args(splits), SPLIT_K=splits, grid=(1,),
                                                **constexprs)  # fmt: skip
            resident = resident_programs(compiled, plan.warps, device)
            fitted = chain_plan(n, k, chain.group_size, sms, resident, config).splits
            if fitted == splits:
                break
            splits = fitted
        if plan.programs * splits > resident:
            raise ValueError(f"{plan.programs}x{splits} programs exceed the {resident} resident")
        _SPLITS[key] = splits
        LAUNCHES[key] = {"splits": splits, "programs": plan.programs, "resident": resident,
                         "registers": compiled.n_regs}  # fmt: skip
    launched = _chain_mma_kernel[(plan.programs, splits)](
        *args(splits), SPLIT_K=splits, **constexprs
    )
    if "launched_registers" not in LAUNCHES[key]:
        launched._init_handles()
        LAUNCHES[key]["launched_registers"] = launched.n_regs
    if check and int(status.item()):
        status.zero_()
        raise RuntimeError(
            f"a layer barrier gave up: the grid was not all resident ({LAUNCHES[key]})"
        )
    return ys


def _options(
    x: torch.Tensor, chain: MMAChain, config: dict[str, int] | None
) -> tuple[tuple, dict[str, int], tuple[int, int | None, bool, bool, bool]]:
    """A call's cache key, the config keys chain_plan takes, and the launch's own (EARLY,
    MAXNREG, NEXT_FIRST, NO_WAIT, PREFETCH)."""
    config = dict(config or {})
    early = int(config.pop("EARLY", EARLY_AT_TAIL if launches_early(x.device) else 0))
    if early not in (0, 1, 2):
        raise ValueError(f"EARLY must be 0, 1 or 2, got {early}")
    maxnreg = config.pop("MAXNREG", None)
    next_first = bool(config.pop("NEXT_FIRST", True))
    no_wait = bool(config.pop("NO_WAIT", False))
    prefetch = bool(config.pop("PREFETCH", False))
    options = (early, maxnreg, next_first, no_wait, prefetch)
    n, k = chain.shape
    key = (x.device, n, k, chain.group_size, x.dtype, tuple(sorted(config.items())), options)
    return key, config, options


def launch_splits(x: torch.Tensor, chain: MMAChain, config: dict[str, int] | None = None) -> int:
    """The split count w4a16_mma_chain launched `chain` with for x's shape and `config`
    (fitted to the GPU on the first such call, then cached)."""
    return _SPLITS[_options(x, chain, config)[0]]


def launch_info(x: torch.Tensor, chain: MMAChain, config: dict[str, int] | None = None) -> dict:
    """What the fitted launch of launch_splits found: splits, programs along N, programs
    resident, registers (compiled to fit, and as launched)."""
    return dict(LAUNCHES[_options(x, chain, config)[0]])
