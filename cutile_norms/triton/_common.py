"""What the Triton forward and backward share: the split rows' exchange, the config arithmetic."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 (the CPU CI) programs run one after another: no program may wait for
# another, so a split launch runs as two launches (partial sums, then the rest).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def exchange(SLOTS, COUNT, tile, rows, row_ok, partial, part, ROWS: tl.constexpr, SPLIT: tl.constexpr,
             PHASE: tl.constexpr):
    """The sum over a row's SPLIT programs of `partial` ([ROWS] fp32, this program's part of each row).

    Each program stores its partials in the rows' slots (SLOTS[row * SPLIT + part]), then takes a
    ticket on the tile's counter (release); the tile's SPLIT tickets of one launch are a run of SPLIT
    consecutive values from a multiple of SPLIT (every launch leaves the counter at a multiple), so
    each program waits (acquire) until the counter reaches the end of its run, then sums the SPLIT
    slots in a fixed order: every part gets the same bits, the counters never need clearing, and a
    replayed CUDA graph counts on. Counters are kept per SPLIT value (a launch with another SPLIT
    would break the runs)."""
    slot_rows = SLOTS + rows * SPLIT
    if PHASE != 2:
        tl.store(slot_rows + part, partial, mask=row_ok)
    if PHASE == 0:
        tl.debug_barrier()  # every thread's slot store happens before the ticket's release
        ticket = tl.atomic_add(COUNT + tile, 1, sem="acq_rel", scope="gpu")
        target = (ticket // SPLIT + 1) * SPLIT
        seen = ticket + 1
        while seen < target:  # poll with plain loads (no atomic traffic while waiting)
            seen = tl.load(COUNT + tile, volatile=True)
        tl.atomic_add(COUNT + tile, 0, sem="acquire", scope="gpu")  # acquire the run's slot stores
        tl.debug_barrier()
    total = partial
    if PHASE != 1:
        parts = tl.load(slot_rows[:, None] + tl.arange(0, SPLIT)[None, :], mask=row_ok[:, None], other=0.0,
                        volatile=True)
        total = tl.sum(parts, axis=1)
    return total


@dataclass(frozen=True)
class TileConfig:
    """The launch config both passes share: how a program's tile covers rows and columns, and the grid."""

    rows: int  # rows per tile (several for narrow rows; 1 when split)
    split: int  # programs per row (a power of two)
    part: int  # columns per program: N when split == 1, else a multiple of 16
    block_n: int  # columns per load (a power of two >= part, or the chunk length)
    chunks: int  # loads per part (1: the part stays in registers)
    num_warps: int
    programs_per_sm: int  # the persistent grid's programs per SM (or CU); 0: one program per row tile
    num_stages: int = 1  # Triton's software pipelining of the tile loop (1: none)

    def short(self) -> str:
        shape = f"{self.rows} rows x {self.block_n} cols" + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
        return (f"tile {shape}, split {self.split} (part {self.part}), {self.num_warps} warps, "
                f"{self.programs_per_sm} programs/SM")


def pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def lanes_per_warp(vendor: str) -> int:
    """Threads per warp: 64-lane wavefronts on AMD CDNA GPUs, 32 on NVIDIA."""
    return 64 if vendor == "amd" else 32


MAX_WARPS = {"nvidia": 32, "amd": 16}  # 1024 threads either way


def warps_for(elems: int, elem_bytes: int, lanes: int, vendor: str) -> int:
    """Warps for a tile of `elems` values: two 16-byte vectors per thread (16 values of a 16-bit
    dtype, 8 of fp32), from one warp to 1024 threads."""
    per_thread = 32 // elem_bytes
    threads = min(1024, max(lanes, pow2_ceil(-(-elems // per_thread))))
    return max(1, min(MAX_WARPS.get(vendor, 32), threads // lanes))


def split_for(N: int, tile_elems: int, split_max: int) -> tuple[int, int, int, int]:
    """(split, part, block_n, chunks) for rows of N: the whole row in one program up to tile_elems,
    else the fewest programs per row (a power of two, at most split_max) whose parts (a multiple of 16
    columns) fit, else split_max programs whose parts run in chunks of tile_elems."""
    if N <= tile_elems:
        return 1, N, pow2_ceil(N), 1
    split_cap = 1 << (max(1, split_max).bit_length() - 1)
    split = min(split_cap, pow2_ceil(-(-N // tile_elems)))
    part = round_up(-(-N // split), 16)
    if part <= tile_elems:
        return split, part, pow2_ceil(part), 1
    return split, part, tile_elems, -(-part // tile_elems)


def needs_int64(M: int, row_elems: int) -> bool:
    """Row offsets in int64: M rows of `row_elems` (the longer of stride and N) pass int32."""
    return M * row_elems >= (1 << 31) - 1


_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(device: torch.device) -> int:
    """The current stream's handle (the workspaces are kept per stream); 0 for CPU tensors."""
    return _raw(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" and _raw else 0
