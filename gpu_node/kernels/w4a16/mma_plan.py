"""Launch plans of the tensor-core W4A16 GEMV (w4a16/mma.py): the heuristic config a shape
takes (mma_gemv_config, from the H200 sweeps in docs/benchmarks.md), and the grid and
constexprs a call launches with (plan_launch), cached per shape for the serving path
(default_plan). Pure Python: no GPU is needed to plan, so CI checks the exact configs.

The serving path takes a measured config over the heuristic where the tuning table
(mma_tuned.json, written by benchmarks/tune_w4a16_mma.py on the device it names)
has one for the GPU's name and the layer's shape: per-device tables of this kind, checked
in, are what a launch rule could not be at three shapes of the H200 sweeps (KWARPS wins
there and loses at shapes whose launches look alike). The table is measured at M = 1 with
bf16 activations and serves every M up to 8 and fp16 as well: its launches are correct for
all of them (GPU tests), only their speed was measured at the one.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from gpu_node.kernels.launch import launches_early
from gpu_node.kernels.w4a16.dot import num_sms
from gpu_node.kernels.w4a16.gemv import MAX_TILES
from gpu_node.kernels.w4a16.mma_asm import PTX, group_step_constants
from gpu_node.quant.int4 import MMA_ROWS, mma_step

# Programmatic dependent launch: each call starts its first weight loads while the previous
# kernel finishes, and lets the next one launch once its own weights are read (2). Letting
# it launch from the start (1) lost up to 16% at long K in the H200 runs (the next call's
# loads competing with this one's), where from the tail costs nothing there.
EARLY_AT_TAIL = 2

# Warps a launch should bring per multiprocessor: about one wave of resident warps at
# this kernel's 40-80 registers (one-buffer loop), else at least LEAST_WARPS before the
# splits shorten.
FULL_WAVE_WARPS = 24
LEAST_WARPS = 12
LONG_K_GROUPS = 128  # from this many groups on, one-row-block warps on 32-group splits first

# Registers a thread of the one-buffer loop takes at groups of 128, by row blocks a warp, as
# Triton 3.6 compiles it for sm_90 over 4 to 28 splits (56-64 and 70-72; bf16 and fp16
# alike): they set how many programs of 4 warps a multiprocessor holds. Groups of 64 and
# 32 move more with the split count (40-80), too much for a table, and skip the wave check.
PIPE0_REGISTERS = {1: 58, 2: 72}
# A launch past one wave of resident programs must fill more than this much of the second:
# the few programs of a short second wave run at a fraction of the bandwidth (H200:
# 1.09 waves at DeepSeek-V3's dense shapes took 31-33 us where 0.95 or 1.9 waves of other
# launches took 25-27).
SECOND_WAVE_LEAST = 0.25


def resident_programs(rows_per_warp: int, warps: int = 4) -> int:
    """Programs of the one-buffer loop a multiprocessor holds: 64K registers, given out 8
    a thread at a time, and at most 64 warps."""
    registers = -(-PIPE0_REGISTERS[rows_per_warp] // 8) * 8
    return min(65536 // (registers * 32 * warps), 64 // warps)


def default_chains(rows_per_warp: int, group_size: int) -> int:
    """Accumulators per mma chain a launch takes: two for one-row-block warps; one for
    two-row-block warps, whose registers would cut a wave; two at groups of 32 always (one
    accumulator a group)."""
    return 2 if rows_per_warp == 1 or group_size == 32 else 1


@functools.cache
def _cached_config(
    n: int, k: int, group_size: int, num_sms: int, symmetric: bool
) -> tuple[tuple[str, int], ...]:
    num_groups = k // mma_step(group_size)  # steps: groups, or pairs of g32 groups

    def warps(rows_per_warp: int, per_split: int) -> int:
        warp_rows = -(-n // (MMA_ROWS * rows_per_warp))  # warps along N
        return warp_rows * -(-num_groups // per_split)

    if symmetric:  # the two-buffer loop (mma_gemv_config says why)
        per_split = min(num_groups, 8 if num_groups <= 64 else 16)
        if warps(2, per_split) >= LEAST_WARPS * num_sms:
            chains = default_chains(2, group_size)
            return (("WARPS", 4), ("R", 2), ("GROUPS_PER_SPLIT", per_split), ("CHAINS", chains))

    def short_second_wave(rows_per_warp: int, per_split: int) -> bool:
        # The register table is the one-buffer loop's: symmetric tiles falling through to
        # here still run the two-buffer loop, and other group sizes have no table.
        if group_size != 128 or symmetric:
            return False
        programs = -(-n // (MMA_ROWS * rows_per_warp * 4)) * -(-num_groups // per_split)
        resident = resident_programs(rows_per_warp) * num_sms
        return 1 < programs / resident < 1 + SECOND_WAVE_LEAST

    candidates = [(2, 16), (2, 8), (1, 32), (1, 16), (1, 8), (1, 4)]
    if num_groups >= LONG_K_GROUPS:
        candidates.insert(0, (1, 32))
    # A small layer never fills the GPU (nor, with too few steps for any split but the
    # shortest, does a layer whose every candidate is a short second wave).
    rows_per_warp, per_split = 1, min(2, num_groups)
    for least in (FULL_WAVE_WARPS, LEAST_WARPS):
        fits = [
            c
            for c in candidates
            if c[1] <= num_groups and warps(*c) >= least * num_sms and not short_second_wave(*c)
        ]
        if fits:
            rows_per_warp, per_split = fits[0]
            break
    return (
        ("WARPS", 4),
        ("R", rows_per_warp),
        ("GROUPS_PER_SPLIT", per_split),
        ("CHAINS", default_chains(rows_per_warp, group_size)),
    )


def mma_gemv_config(
    n: int, k: int, group_size: int, num_sms: int, symmetric: bool = False
) -> dict[str, int]:
    """Warps, row blocks per warp, groups per split and accumulator chains (from the H200
    sweeps); M does not matter.

    4 warps a program. The first of (2 row blocks a warp, splits of 16 or 8 groups),
    then (1 row block, 32, 16, 8 or 4 groups) that launches about one wave of resident
    warps (FULL_WAVE_WARPS a multiprocessor) -- with LONG_K_GROUPS groups or more, (1
    row block, 32 groups) is tried first; failing that, the first that launches
    LEAST_WARPS; failing that (a small layer), 1 row block a warp and splits of 2
    groups. At groups of 128 (asymmetric tiles) a launch just past one wave of resident
    programs (PIPE0_REGISTERS; between 1 and 1 + SECOND_WAVE_LEAST waves) is passed over.
    In the sweeps (docs/benchmarks.md) the best configurations launched 27-31 warps a
    multiprocessor; 2-row-block warps on splits shorter than 8 groups end
    before their loads one group ahead pay off, so they are never chosen. One-row-block
    warps split each mma chain in two (CHAINS = 2: 56 registers instead of 50 on the
    H200, still a full wave); two-row-block warps do not (both chain counts compile to
    72 registers there, and two chains measured 17% slower at 8192 x 28672).
    Groups of 32 count as steps of two (one chunk) and always take CHAINS = 2; in the
    H200 sweeps their best configurations were two-row-block
    warps too (4096 x 14336: 16.1 us against 19.6 for one row block, 8 steps a split).

    Symmetric tiles run the two-buffer loop, whose registers (about 126 for two row blocks
    a warp) leave 4 programs a multiprocessor: two-row-block warps on splits of 8 steps up
    to 64 steps of K, else 16 (in an H200 sweep, the best of its two-row-block
    launches at the 70B and DeepSeek-V3 shapes, or within 5%), unless those launch fewer
    than LEAST_WARPS a multiprocessor, where the asymmetric choice stands.
    """
    return dict(_cached_config(n, k, group_size, num_sms, symmetric))


@dataclass(frozen=True)
class Plan:
    """What a call's launch takes besides its tensors: the grid and the constexprs."""

    programs: int
    splits: int
    tile: tuple[int, int]  # a program's partial: (R, 128 W), with KWARPS (R, 128)
    num_groups: int
    constexprs: Mapping[str, object]  # the kernel's constexprs and launch options


SYMMETRIC_FP16_REGISTERS = 128  # the cap of two-row-block warps over symmetric tiles in fp16
CONFIG_KEYS = frozenset(
    ("WARPS", "R", "GROUPS_PER_SPLIT", "CHAINS", "PIPE", "KWARPS", "EARLY", "MAXNREG", "SPLITS")
)


def plan_launch(
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    symmetric: bool,
    config: Mapping[str, int] | None,
) -> Plan:
    """The heuristic config (mma_gemv_config) with `config` over it, checked.

    `config` keys (CONFIG_KEYS): WARPS, R (row blocks a warp), GROUPS_PER_SPLIT, CHAINS, PIPE
    (the loop, 0 or 2; 2 always for symmetric tiles), KWARPS (the warps split K,
    GROUPS_PER_SPLIT then being about a warp's share), EARLY (programmatic dependent launch:
    0 off, 1 the next kernel may launch from this one's start, 2 from its tail, the default
    where the GPU can), MAXNREG (a register cap, 0 none) and SPLITS (a split count given
    outright, for tests and sweeps).
    """
    unknown = sorted(set(config or {}) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(CONFIG_KEYS)}")
    cfg = mma_gemv_config(n, k, group_size, num_sms(device), symmetric)
    cfg.update(config or {})
    pipe = int(cfg.get("PIPE", 2 if symmetric else 0))
    if pipe not in (0, 2) or (symmetric and pipe != 2):
        raise ValueError(f"PIPE must be 0 or 2 (2 for symmetric tiles), got {pipe}")
    if cfg["GROUPS_PER_SPLIT"] < 1:
        raise ValueError(f"GROUPS_PER_SPLIT must be >= 1, got {cfg['GROUPS_PER_SPLIT']}")
    warps, rows_per_warp = cfg["WARPS"], cfg["R"]
    if rows_per_warp not in (1, 2, 4, 8):  # a power of two; the epilogue sums 8 // R at a time
        raise ValueError(f"R must be 1, 2, 4 or 8, got {rows_per_warp}")
    chains = cfg["CHAINS"]
    if chains not in PTX:
        raise ValueError(f"CHAINS must be 1 or 2, got {chains}")
    early = int(cfg.get("EARLY", EARLY_AT_TAIL if launches_early(device) else 0))
    if early not in (0, 1, 2):
        raise ValueError(f"EARLY must be 0, 1 or 2, got {early}")
    num_groups = k // mma_step(group_size)  # steps
    kwarps = bool(cfg.get("KWARPS", False))
    if kwarps and symmetric:
        # With symmetric tiles at groups of 128 and 64 (tile strides 264 and 136 int32, no
        # multiple of 16) and two row blocks it gives wrong sums on the H200 (relative error
        # 11-130; one warp and one split too). The H200's own TTGIR shows why: Triton lays the
        # dequantize-and-mma asm's operands out one element a thread, where the asm needs
        # each lane's four consecutive words (pack = 4), because it cannot prove those loads
        # 16-byte aligned there. Groups of 32 (stride 144) and asymmetric tiles get the
        # four-a-lane layout and the one-buffer loop's bits (GPU tests).
        raise ValueError("KWARPS takes asymmetric tiles, not symmetric ones")
    if config and "SPLITS" in config:  # a split count given outright
        splits = int(config["SPLITS"])
        if not 1 <= splits <= num_groups:
            raise ValueError(f"SPLITS must be 1..{num_groups} (steps of K), got {splits}")
    elif kwarps:
        # GROUPS_PER_SPLIT is the least steps of a warp's share: a split is WARPS equal
        # shares, so the split count is the largest up to steps / (GROUPS_PER_SPLIT * WARPS)
        # that divides them.
        splits = max(1, num_groups // (cfg["GROUPS_PER_SPLIT"] * warps))
        while splits > 1 and num_groups % (splits * warps):
            splits -= 1
    else:
        splits = triton.cdiv(num_groups, cfg["GROUPS_PER_SPLIT"])
    if kwarps and num_groups % (splits * warps):
        raise ValueError(
            f"KWARPS takes splits of equal shares: {splits} splits of {warps} warps do "
            f"not divide {num_groups} steps"
        )
    maxnreg = cfg.get("MAXNREG")
    if (
        maxnreg is None
        and symmetric
        and dtype == torch.float16
        and pipe == 2
        and rows_per_warp == 2
    ):
        # Two row blocks of symmetric tiles from fp16 activations take 138 registers where
        # bf16 takes 128 (Triton 3.6, H200): three programs a multiprocessor instead of four,
        # 17-32% slower. Capped at 128 (no spills) they are 10-26% faster than uncapped
        # (H200). A config's MAXNREG 0 leaves it off.
        maxnreg = SYMMETRIC_FP16_REGISTERS
    programs = triton.cdiv(triton.cdiv(n, MMA_ROWS), (1 if kwarps else warps) * rows_per_warp)
    if programs > MAX_TILES:
        raise ValueError(f"{programs} programs exceed {MAX_TILES}")
    constexprs = {
        "GROUP_SIZE": group_size,
        "WARPS": warps,
        "R": rows_per_warp,
        "SPLIT_K": splits,
        "CHAINS": chains,
        "EARLY": early,
        "SYMMETRIC": symmetric,
        "PIPE": pipe,
        "KWARPS": kwarps,
        **group_step_constants(dtype, chains, group_size, symmetric),
        "num_warps": warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),  # a config's cap, or the one above
        **({"launch_pdl": True} if early else {}),
    }
    tile = (rows_per_warp, 128 if kwarps else 128 * warps)
    return Plan(programs, splits, tile, num_groups, types.MappingProxyType(constexprs))


TUNED_PATH = Path(__file__).with_name("mma_tuned.json")


def tuned_key(n: int, k: int, group_size: int, symmetric: bool) -> str:
    """A tuning table's key for a layer: K x N (in x out, as the benchmarks write shapes),
    the group size and the layout."""
    return f"{k}x{n}/g{group_size}/{'sym' if symmetric else 'asym'}"


def parse_tuned_key(key: str) -> tuple[int, int, int, bool]:
    """tuned_key's inverse: (n, k, group_size, symmetric)."""
    shape, group, layout = key.split("/")
    k, n = (int(v) for v in shape.split("x"))
    if not group.startswith("g") or layout not in ("asym", "sym"):
        raise ValueError(f"not a tuning table key: {key!r}")
    return n, k, int(group.removeprefix("g")), layout == "sym"


@functools.cache
def tuned_table() -> Mapping[str, Mapping[str, Mapping[str, int]]]:
    """GPU name -> tuned_key -> config, from the tuning table at TUNED_PATH (empty if there
    is none)."""
    if not TUNED_PATH.is_file():
        return {}
    devices = json.loads(TUNED_PATH.read_text())["devices"]
    return {
        name: {key: dict(entry["config"]) for key, entry in device["configs"].items()}
        for name, device in devices.items()
    }


def device_name(device: torch.device) -> str:
    """What the tuning table knows a GPU by (torch's name for it); "" off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def tuned_config(
    n: int, k: int, group_size: int, device: torch.device, symmetric: bool
) -> Mapping[str, int] | None:
    """The tuning table's config for this layer on this GPU, or None (the heuristic)."""
    table = tuned_table().get(device_name(device), {})
    return table.get(tuned_key(n, k, group_size, symmetric))


@functools.cache
def default_plan(
    n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device, symmetric: bool
) -> Plan:
    """The serving path's plan (calls without a config): the tuned config of the layer's
    shape on this GPU where the table has one, else the heuristic's. Cached per shape: at
    decode sizes the host time of a call is most of its cost."""
    config = tuned_config(n, k, group_size, device, symmetric)
    return plan_launch(n, k, group_size, dtype, device, symmetric, config)
