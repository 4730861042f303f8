"""INT4 weights with a scale and a minimum per group, as pure functions.

A weight `[..., K]` (the leading dims are output rows, and experts for MoE) is
cut along K into groups of `group_size` (32, 64 or 128) consecutive values; each
group keeps an fp16 `scale` and an fp16 `min`, and each value a 4-bit code
`q` in 0..15:

    w = scale * q + min                                  (in fp32)

This is GGUF Q4_1's arithmetic exactly, so Q4_1 blocks import without loss.
A zero point z in the usual `scale * (q - z)` form is `min = -z * scale`;
symmetric quantization is the special case `min = -8 * scale`, so one kernel
serves both.

Packing (shared by the torch reference and the Triton kernels), per row of K
values, in chunks of 32 values -> 16 bytes, exactly as Q4_1 lays out its block:

    values   k:  c*32+0  c*32+1 ... c*32+15 | c*32+16 c*32+17 ... c*32+31
    byte c*16+i:      low nibble = value c*32+i, high nibble = value c*32+16+i

    packed   uint8 [..., K // 2]        byte b of chunk c at column c*16 + b
    scales   fp16  [..., K // group_size]
    mins     fp16  [..., K // group_size]

So a 16-byte run of a row unpacks into two runs of 16 consecutive values (the
low nibbles, then the high ones); the kernels load the activations for each run
with plain strided offsets and never shuffle nibbles across lanes.

Letters: N rows (out features), K columns (in features), G group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CHUNK = 32  # values per packing chunk (16 bytes); every group size is a multiple
GROUP_SIZES = (32, 64, 128)
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


@dataclass(frozen=True)
class Int4Weight:
    """A quantized weight of logical shape `shape` (..., N, K); see the module docstring."""

    packed: torch.Tensor  # uint8 [..., K // 2]
    scales: torch.Tensor  # fp16 [..., K // G]
    mins: torch.Tensor  # fp16 [..., K // G]
    shape: tuple[int, ...]
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(
            packed=self.packed.to(device),
            scales=self.scales.to(device),
            mins=self.mins.to(device),
            shape=self.shape,
            group_size=self.group_size,
        )


def _check_shape(shape: tuple[int, ...], group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if len(shape) < 1 or shape[-1] == 0:
        raise ValueError(f"cannot quantize a weight of shape {shape}")
    if shape[-1] % group_size:
        raise ValueError(f"last dim {shape[-1]} is not a multiple of group_size {group_size}")


def symmetric_mins(scales: torch.Tensor) -> torch.Tensor:
    """The fp16 mins of symmetric quantization, -8 * scale (exact: a power-of-two multiple)."""
    return (scales.float() * -8).to(torch.float16)


def _fp16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """fp32 -> fp16 rounding towards +inf (up) or -inf, so stored ranges still cover the data."""
    h = x.to(torch.float16)
    off = h.float() < x if up else h.float() > x
    try:
        toward = torch.full_like(h, float("inf") if up else float("-inf"))
        moved = torch.nextafter(h, toward)
    except (RuntimeError, NotImplementedError):  # no fp16 nextafter on this device
        # One fp16 ulp of h (at least the smallest subnormal), in fp32 where it is exact.
        ulp = torch.ldexp(torch.ones_like(x), torch.frexp(h.float()).exponent - 11).clamp_min(
            2.0**-24
        )
        moved = (h.float() + ulp if up else h.float() - ulp).to(torch.float16)
    return torch.where(off, moved, h)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [..., K] in 0..15 -> packed uint8 [..., K // 2] in the chunk layout."""
    lead, k = q.shape[:-1], q.shape[-1]
    chunks = q.reshape(*lead, k // CHUNK, 2, CHUNK // 2)  # [..., C, lo|hi, 16]
    packed = chunks[..., 0, :] | (chunks[..., 1, :] << 4)
    return packed.reshape(*lead, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., K // 2] -> codes uint8 [..., K]."""
    lead, half = packed.shape[:-1], packed.shape[-1]
    chunks = packed.reshape(*lead, half // (CHUNK // 2), 1, CHUNK // 2)
    codes = torch.cat([chunks & 0x0F, chunks >> 4], dim=-2)  # [..., C, lo|hi, 16]
    return codes.reshape(*lead, half * 2)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest INT4 of `weight` [..., K] with one scale (and min) per group.

    Asymmetric: scale = (max - min) / 15 over the group, codes 0..15.
    Symmetric: scale = absmax / 7, codes -8..7 stored as 0..15 with min = -8 * scale.
    The stored fp16 scale is rounded up and the fp16 min down, so every value of
    the group lies inside the representable range and the rounding error is at
    most scale / 2 (plus fp32 rounding of the dequantized product).
    """
    shape = tuple(weight.shape)
    _check_shape(shape, group_size)
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    lead, k = shape[:-1], shape[-1]
    groups = weight.detach().float().reshape(*lead, k // group_size, group_size)  # [..., K/G, G]
    if not bool(torch.isfinite(groups).all()):
        raise ValueError("weight holds inf or nan; refusing to quantize")
    if symmetric:
        absmax = groups.abs().amax(dim=-1)
        scales = _fp16_round(absmax / 7, up=True)
        mins = symmetric_mins(scales)
    else:
        mins = _fp16_round(groups.amin(dim=-1), up=False)
        scales = _fp16_round((groups.amax(dim=-1) - mins.float()) / 15, up=True)
    scale_f = scales.float().unsqueeze(-1)
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = torch.round((groups - mins.float().unsqueeze(-1)) / safe)
    codes = torch.where(scale_f > 0, codes, torch.zeros_like(codes)).clamp_(0, 15)
    q = codes.to(torch.uint8).reshape(*lead, k)
    return Int4Weight(
        packed=pack_int4(q), scales=scales, mins=mins, shape=shape, group_size=group_size
    )


def dequantize_int4(q: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Int4Weight -> dense [..., K] in `dtype`, computed in fp32 as scale * q + min."""
    lead, k = q.shape[:-1], q.shape[-1]
    codes = unpack_int4(q.packed).reshape(*lead, k // q.group_size, q.group_size).float()
    w = codes * q.scales.float().unsqueeze(-1) + q.mins.float().unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


def int4_from_gguf_q4_1(raw_blocks: Any, shape: tuple[int, ...]) -> Int4Weight:
    """GGUF Q4_1 blocks -> Int4Weight (group 32) without loss and without any float weights.

    `raw_blocks`: uint8 numpy array or tensor [..., rows, K // 32 * 20] as `gguf`
    returns it (`ReaderTensor.data`); `shape`: the logical shape in torch order
    (..., N, K), i.e. the GGUF shape reversed. The nibble bytes are copied as
    they are (our packing is Q4_1's), d becomes the scale and m the min.
    """
    shape = tuple(int(d) for d in shape)
    _check_shape(shape, 32)
    data = raw_blocks.cpu().numpy() if torch.is_tensor(raw_blocks) else np.asarray(raw_blocks)
    if data.dtype != np.uint8:
        raise TypeError(f"Q4_1 blocks must be uint8, got {data.dtype}")
    lead, k = shape[:-1], shape[-1]
    num_blocks = k // 32
    expected = int(np.prod(lead, dtype=np.int64)) * num_blocks * Q4_1_BLOCK_BYTES
    if data.size != expected:
        raise ValueError(f"Q4_1 data holds {data.size} bytes, shape {shape} needs {expected}")
    blocks = data.reshape(*lead, num_blocks, Q4_1_BLOCK_BYTES)  # [..., K/32, 20]
    # Each slice is copied once into its own (writable) array: 4-bit codes stay 4-bit.
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(*lead, num_blocks)
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(*lead, num_blocks)
    packed = np.ascontiguousarray(blocks[..., 4:]).reshape(*lead, k // 2)
    return Int4Weight(
        packed=torch.from_numpy(packed),
        scales=torch.from_numpy(scales),
        mins=torch.from_numpy(mins),
        shape=shape,
        group_size=32,
    )


@dataclass(frozen=True)
class Int4WeightKN:
    """The same INT4 weight laid out for the CUDA-core decode GEMV (gpu_node/kernels/w4a16/gemv.py).

    W [N, K] is stored transposed, eight consecutive k of one row per int32 word:

        words   int32 [K // 8, N]   bits 4p..4p+3 of words[kw, n] = code of W[n, 8 * kw + p]
        scales  fp16  [K // G, N]
        mins    fp16  [K // G, N]

    so a warp reading one row of words reads 32 neighbouring output rows (coalesced),
    and every lane needs the same eight activations x[8kw : 8kw + 8] (one broadcast).
    The arithmetic is Int4Weight's: w = scale * q + min. Same bytes as Int4Weight.
    """

    words: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    shape: tuple[int, int]
    group_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.mins))


def to_kn(weight: Int4Weight) -> Int4WeightKN:
    """Int4Weight [N, K] -> Int4WeightKN (lossless; `from_kn` inverts it).

    Byte j of a little-endian word holds values 2j (low nibble) and 2j + 1 (high), so
    a word is four such bytes in k order: the codes never leave uint8 (no wide
    temporaries on the GPU).
    """
    if len(weight.shape) != 2:
        raise ValueError(f"to_kn takes a 2-D weight, got shape {weight.shape}")
    n, k = weight.shape
    codes = unpack_int4(weight.packed).reshape(n, k)  # uint8 [N, K]
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # uint8 [N, K/2], k order
    words = pairs.contiguous().view(torch.int32)  # [N, K/8]
    return Int4WeightKN(
        words=words.T.contiguous(),
        scales=weight.scales.T.contiguous(),
        mins=weight.mins.T.contiguous(),
        shape=(n, k),
        group_size=weight.group_size,
    )


def from_kn(weight: Int4WeightKN) -> Int4Weight:
    """Int4WeightKN -> Int4Weight [N, K]."""
    n, k = weight.shape
    pairs = weight.words.T.contiguous().view(torch.uint8)  # [N, K/2], k order
    codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(n, k)
    return Int4Weight(
        packed=pack_int4(codes),
        scales=weight.scales.T.contiguous(),
        mins=weight.mins.T.contiguous(),
        shape=(n, k),
        group_size=weight.group_size,
    )


MMA_ROWS = 16  # output rows per row block: the M side of one mma.sync m16n8k16
MMA_CHUNK = 64  # k values per chunk: four k16 steps, one int32 word per lane and step
MMA_GROUP_SIZES = (32, 64, 128)  # half, one or two chunks per group: what the kernels handle


def mma_step(group_size: int) -> int:
    """k values per tile (the kernels' loop step): the group, or a chunk of two g32 groups."""
    return max(group_size, MMA_CHUNK)


def mma_tile_width(group_size: int, symmetric: bool) -> int:
    """int32 of one Int4WeightMMA tile: a step's words, then 16 int32 of scales and mins a
    group (8 of scales alone for symmetric tiles)."""
    step = mma_step(group_size)
    return 2 * step + (8 if symmetric else 16) * (step // group_size)


def mma_fits(k: int, group_size: int) -> bool:
    """Whether a weight of K = `k` in groups of `group_size` has an Int4WeightMMA layout."""
    return group_size in MMA_GROUP_SIZES and k % mma_step(group_size) == 0


@dataclass(frozen=True)
class Int4WeightMMA:
    """The same INT4 weight laid out as tensor-core fragments (gpu_node/kernels/w4a16/mma.py).

    W [N, K] (N padded with zero rows to a multiple of 16) is cut into row blocks of
    16 rows and chunks of 64 k. Within a (row block rb, chunk c), lane L = 4g + t of
    a warp holds four words, one per k16 step s; each word is that lane's A fragment
    of `mma.m16n8k16` (rows g and g + 8) for the 4 k values kb .. kb + 3,
    kb = 64c + 16t + 4s (groups of 64 or 128) or 64c + 32 (s // 2) + 8t + 4 (s % 2)
    (groups of 32: steps 0-1 of every lane in the chunk's first group, 2-3 in its second):

        nibble 0 | 4: W[16rb + g,     kb + 0 | 1]      1 | 5: W[16rb + g + 8, kb + 0 | 1]
        nibble 2 | 6: W[16rb + g,     kb + 2 | 3]      3 | 7: W[16rb + g + 8, kb + 2 | 3]

    so `(word >> 4r) & 0x000F000F` is A register r with the codes of two
    neighbouring k in its two 16-bit halves, and lane t's activations for the whole
    chunk are the 16 contiguous values x[64c + 16t .. 64c + 16t + 15] (groups of 32: the
    8 at 64c + 8t and the 8 at 64c + 32 + 8t). One tile per
    (row block, step of T = max(G, 64) k) holds the step's T / 64 chunks and then the
    scales and mins of its T / G groups (one group of 64 or 128; two of 32, the first
    on steps 0-1 of the chunk, the second on steps 2-3):

        tiles  int32 [N16 / 16, K / T, 2T + 16 T / G]   a view of storage [K / T, N16 / 16, ...]
               [0, 2T):      words (chunk of the step, lane L, step s)
               then 16 int32 a group: fp16 (g, 4): scale, min of row 16rb + g, then of
               row 16rb + g + 8
               symmetric: 8 int32 a group instead, fp16 (g, 2): the scales of rows
               16rb + g and 16rb + g + 8 (every min is -8 * scale, so none is stored)

    The storage is group-major: the warps of a split, which walk the groups together,
    read neighbouring row blocks' tiles from one region of memory at a time.

    The arithmetic is Int4Weight's: w = scale * q + min. Same bytes, plus the pad rows
    (a symmetric weight: 2 bytes a group and row fewer, 3% of a group of 128's).
    """

    tiles: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    symmetric: bool = False

    def __post_init__(self) -> None:
        # What the kernels can read (they take the tiles' strides; the last must be 1).
        n, k = self.shape
        if self.group_size not in MMA_GROUP_SIZES:
            message = f"Int4WeightMMA takes group sizes {MMA_GROUP_SIZES}, got {self.group_size}"
            raise ValueError(message)
        step = mma_step(self.group_size)
        if k % step:
            raise ValueError(f"Int4WeightMMA takes K a multiple of {step}, got {k}")
        expected = (-(-n // MMA_ROWS), k // step, mma_tile_width(self.group_size, self.symmetric))
        tiles = self.tiles
        aligned = tiles.stride(0) % 4 == 0 and tiles.stride(1) % 4 == 0  # 16-byte tiles
        if (
            tiles.dtype != torch.int32
            or tuple(tiles.shape) != expected
            or tiles.stride(2) != 1
            or not aligned
            or tiles.storage_offset() % 4
        ):
            raise ValueError(
                f"Int4WeightMMA.tiles must be int32 {list(expected)} with unit last stride "
                f"and the others (and the offset) multiples of 4, got {tiles.dtype} "
                f"{list(tiles.shape)} strides {tiles.stride()} offset {tiles.storage_offset()}"
            )

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()

    @property
    def words(self) -> torch.Tensor:
        """int32 [N16 / 16, K / 64, 32, 4] (a copy): the words of every chunk."""
        rbs, steps = self.tiles.shape[:2]
        step = mma_step(self.group_size)
        words = self.tiles[:, :, : 2 * step].contiguous()
        return words.reshape(rbs, steps * step // MMA_CHUNK, 32, 4)

    @property
    def scale_mins(self) -> torch.Tensor:
        """fp16 [N16 / 16, K / G, 8, 4] (a copy): per g, scale and min of rows g and g + 8
        (a symmetric weight's mins, -8 * scale, written out)."""
        rbs, steps = self.tiles.shape[:2]
        step = mma_step(self.group_size)
        sm = self.tiles[:, :, 2 * step :].contiguous().view(torch.float16)
        if not self.symmetric:
            return sm.reshape(rbs, steps * step // self.group_size, 8, 4)
        scales = sm.reshape(rbs, steps * step // self.group_size, 8, 2)
        return torch.stack([scales, symmetric_mins(scales)], dim=-1).flatten(-2)


def _mma_order(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes [N16, K] -> [N16/16, K/64, 8 (g), 4 (t), 4 (s = 2 s1 + s0), 8 (nibble)]."""
    n16, k = codes.shape
    # n = 16rb + 8hr + g; nibble = hr + 2h + 4e; k = 64c + 16t + 8s1 + 4s0 + 2h + e, or
    # with groups of 32 k = 64c + 32s1 + 8t + 4s0 + 2h + e (steps 0-1 in the first group).
    v = codes.reshape(n16 // 16, 2, 8, k // 64, 4, 2, 2, 2, 2)  # rb hr g c t s1 s0 h e
    if group_size == 32:
        v = v.reshape(n16 // 16, 2, 8, k // 64, 2, 4, 2, 2, 2)  # rb hr g c s1 t s0 h e
        v = v.transpose(4, 5)  # rb hr g c t s1 s0 h e
    v = v.permute(0, 3, 2, 4, 5, 6, 8, 7, 1)  # rb c g t s1 s0 e h hr
    return v.reshape(n16 // 16, k // 64, 8, 4, 4, 8)


def _mma_order_inverse(nib: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N16/16, K/64, 8, 4, 4, 8] -> codes [N16, K]: undoes `_mma_order`."""
    rbs, chunks = nib.shape[:2]
    v = nib.reshape(rbs, chunks, 8, 4, 2, 2, 2, 2, 2)  # rb c g t s1 s0 e h hr
    v = v.permute(0, 8, 2, 1, 3, 4, 5, 7, 6)  # rb hr g c t s1 s0 h e
    if group_size == 32:
        v = v.transpose(4, 5)  # rb hr g c s1 t s0 h e
    return v.reshape(rbs * 16, chunks * 64)


def is_symmetric(weight: Int4Weight) -> bool:
    """Whether every min is -8 * its scale (quantize_int4(..., symmetric=True) makes them so),
    so the scales alone describe the weight."""
    return bool(torch.equal(weight.mins, symmetric_mins(weight.scales)))


def to_mma(weight: Int4Weight, symmetric: bool = False) -> Int4WeightMMA:
    """Int4Weight [N, K] -> Int4WeightMMA (lossless; `from_mma` inverts it). Groups of 32, 64
    or 128 (K a multiple of 64). `symmetric`: store the scales alone (every min must be
    -8 * its scale, `is_symmetric`), 2 bytes a group and row fewer."""
    if len(weight.shape) != 2:
        raise ValueError(f"to_mma takes a 2-D weight, got shape {weight.shape}")
    n, k = weight.shape
    if weight.group_size not in MMA_GROUP_SIZES:
        raise ValueError(f"to_mma takes group sizes {MMA_GROUP_SIZES}, got {weight.group_size}")
    if k % MMA_CHUNK:
        raise ValueError(f"to_mma takes K a multiple of {MMA_CHUNK}, got {k}")
    n16 = -(-n // MMA_ROWS) * MMA_ROWS
    codes = unpack_int4(weight.packed).reshape(n, k)  # uint8 [N, K]
    scales, mins = weight.scales, weight.mins  # fp16 [N, K / G]
    if n16 != n:
        codes = torch.cat([codes, codes.new_zeros(n16 - n, k)])
        scales = torch.cat([scales, scales.new_zeros(n16 - n, scales.shape[1])])
        mins = torch.cat([mins, mins.new_zeros(n16 - n, mins.shape[1])])
    if symmetric and not is_symmetric(weight):
        raise ValueError("to_mma(symmetric=True) takes a weight whose mins are -8 * scale")
    rbs, groups = n16 // 16, k // weight.group_size
    step = mma_step(weight.group_size)
    steps = k // step
    # [N16, K/G] -> [rb, hr, g, K/G, scale|min] -> [rb, K/G, g, hr, scale|min]
    parts = [scales] if symmetric else [scales, mins]
    sm = torch.stack(parts, dim=-1).reshape(rbs, 2, 8, groups, len(parts))
    sm = sm.permute(0, 3, 2, 1, 4).reshape(rbs, groups, -1).contiguous().view(torch.int32)
    sm = sm.reshape(rbs, steps, -1)  # a step's groups one after another
    nib = _mma_order(
        codes, weight.group_size
    )  # uint8 [..., 8]; byte b of a word = nibbles 2b | 2b + 1
    pairs = nib[..., 0::2] | (nib[..., 1::2] << 4)
    words = pairs.contiguous().view(torch.int32).reshape(rbs, steps, 2 * step)
    storage = torch.cat([words, sm], dim=-1).transpose(0, 1).contiguous()  # group-major
    return Int4WeightMMA(
        tiles=storage.transpose(0, 1),
        shape=(n, k),
        group_size=weight.group_size,
        symmetric=symmetric,
    )


def from_mma(weight: Int4WeightMMA) -> Int4Weight:
    """Int4WeightMMA -> Int4Weight [N, K] (the pad rows dropped)."""
    n, k = weight.shape
    n16 = weight.tiles.shape[0] * MMA_ROWS
    pairs = weight.words.view(torch.uint8).reshape(n16 // 16, k // 64, 8, 4, 4, 4)
    nib = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).flatten(-2)  # [..., 8] by nibble
    codes = _mma_order_inverse(nib, weight.group_size)
    groups = k // weight.group_size
    sm = weight.scale_mins.reshape(n16 // 16, groups, 8, 2, 2)  # rb, K/G, g, hr, scale|min
    sm = sm.permute(0, 3, 2, 1, 4).reshape(n16, groups, 2)[:n]  # [N, K/G, scale|min]
    return Int4Weight(
        packed=pack_int4(codes[:n].contiguous()),
        scales=sm[..., 0].contiguous(),
        mins=sm[..., 1].contiguous(),
        shape=(n, k),
        group_size=weight.group_size,
    )


GATE_ROWS = 8  # gate (or up) rows of one feature block: half an mma row block


def gated_row_order(n: int) -> torch.Tensor:
    """Row order of a gated weight [gate; up] (n = 2I rows) that puts gate rows 8r .. 8r + 7
    and up rows I + 8r .. I + 8r + 7 in row block r, so a lane's C fragment holds the gate
    (row g) and the up (row g + 8) of the same feature 8r + g. int64 [2I]."""
    inner = n // 2
    if n % 2 or inner % GATE_ROWS:
        raise ValueError(f"a gated weight needs 2I rows with I a multiple of {GATE_ROWS}, got {n}")
    gate = torch.arange(inner).reshape(-1, GATE_ROWS)  # [I / 8, 8]
    return torch.cat([gate, gate + inner], dim=1).reshape(-1)


@dataclass(frozen=True)
class Int4ExpertsMMA:
    """A stack of E experts' weights [E, N, K] in Int4WeightMMA's layout, one after another.

        tiles  int32 [E, N16 / 16, K / T, 2T + 16 T / G]   a view of storage [E, K / T, N16 / 16, ...]

    `tiles[e]` is expert e's Int4WeightMMA tiles exactly (group-major within the expert),
    so the MoE decode kernel (gpu_node/kernels/moe/mma.py) walks an expert as the dense
    tensor-core GEMV walks a weight. `gated`: the rows of each expert's [gate; up] weight
    are in `gated_row_order` (the kernel then applies silu(gate) * up in registers).
    """

    tiles: torch.Tensor
    shape: tuple[int, int, int]
    group_size: int
    gated: bool = False

    def __post_init__(self) -> None:
        if self.tiles.dim() != 4 or self.tiles.shape[0] != self.shape[0]:
            raise ValueError(
                f"Int4ExpertsMMA.tiles must be [E, ...] for E = {self.shape[0]}, "
                f"got {list(self.tiles.shape)}"
            )
        self.expert(0)  # checks the per-expert shape, dtype and strides

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()

    def expert(self, e: int) -> Int4WeightMMA:
        return Int4WeightMMA(tiles=self.tiles[e], shape=self.shape[1:], group_size=self.group_size)


def int4_expert(weight: Int4Weight, e: int) -> Int4Weight:
    """Expert e of a stacked Int4Weight [E, N, K], as a 2-D Int4Weight (views)."""
    return Int4Weight(
        packed=weight.packed[e],
        scales=weight.scales[e],
        mins=weight.mins[e],
        shape=weight.shape[1:],
        group_size=weight.group_size,
    )


def experts_to_mma(weight: Int4Weight, gated: bool = False) -> Int4ExpertsMMA:
    """Int4Weight [E, N, K] -> Int4ExpertsMMA (lossless; `experts_from_mma` inverts it).

    gated: the weight is [gate; up] (N = 2I); its rows go in `gated_row_order`."""
    if len(weight.shape) != 3:
        raise ValueError(f"experts_to_mma takes a 3-D weight [E, N, K], got shape {weight.shape}")
    if gated:
        order = gated_row_order(weight.shape[1]).to(weight.packed.device)
        weight = Int4Weight(
            packed=weight.packed[:, order],
            scales=weight.scales[:, order],
            mins=weight.mins[:, order],
            shape=weight.shape,
            group_size=weight.group_size,
        )
    # Each expert's tiles are a transposed view of group-major storage; stacking the
    # storage keeps every expert group-major.
    storage = torch.stack(
        [to_mma(int4_expert(weight, e)).tiles.transpose(0, 1) for e in range(weight.shape[0])]
    )  # [E, K / T, N16 / 16, 2T + 16 T / G]
    e, n, k = weight.shape
    return Int4ExpertsMMA(
        tiles=storage.transpose(1, 2), shape=(e, n, k), group_size=weight.group_size, gated=gated
    )


def experts_from_mma(weight: Int4ExpertsMMA) -> Int4Weight:
    """Int4ExpertsMMA -> Int4Weight [E, N, K]."""
    parts = [from_mma(weight.expert(e)) for e in range(weight.shape[0])]
    rows: slice | torch.Tensor = slice(None)
    if weight.gated:  # back from gated_row_order
        rows = torch.argsort(gated_row_order(weight.shape[1])).to(weight.tiles.device)
    return Int4Weight(
        packed=torch.stack([p.packed for p in parts])[:, rows],
        scales=torch.stack([p.scales for p in parts])[:, rows],
        mins=torch.stack([p.mins for p in parts])[:, rows],
        shape=weight.shape,
        group_size=weight.group_size,
    )
