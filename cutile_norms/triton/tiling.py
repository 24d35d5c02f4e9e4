"""How a Triton program's tile covers rows and columns, shared by the forward's and the backward's
config rules (pure Python: imports without Triton)."""
from __future__ import annotations

from dataclasses import dataclass

from .._util import pow2_ceil


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
    prefetch: bool = False  # a persistent program loads its next tile before it reduces this one
    one_tile: bool = False  # the forward's one-program-per-tile path as straight-line code (split rows: always)

    def short(self) -> str:
        shape = f"{self.rows} rows x {self.block_n} cols" + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
        return (f"tile {shape}, split {self.split} (part {self.part}), {self.num_warps} warps, "
                f"{self.programs_per_sm} programs/SM" + (", prefetch" if self.prefetch else "")
                + (", one tile" if self.one_tile else ""))


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def lanes_per_warp(vendor: str) -> int:
    """Threads per warp: 64-lane wavefronts on AMD CDNA GPUs, 32 on NVIDIA."""
    return 64 if vendor == "amd" else 32


MAX_WARPS = {"nvidia": 32, "amd": 16}  # 1024 threads either way


def warps_for(elems: int, elem_bytes: int, lanes: int, vendor: str, per_thread: int | None = None) -> int:
    """Warps for a tile of `elems` values, `per_thread` values per thread (default: two 16-byte vectors,
    16 values of a 16-bit dtype, 8 of fp32), from one warp to 1024 threads."""
    per_thread = per_thread or 32 // elem_bytes
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


def offset_align(*values: int) -> int:
    """The kernel's ALIGN: the largest power of two under 16 dividing every value, the elements its row
    and column offsets are multiples of; 1 where all are multiples of 16, which Triton infers itself (an
    integer argument divisible by 16 is specialised as such) and where the kernel stays as measured.
    Without it rows of N = 8 (mod 16) 16-bit elements moved 2 bytes per load (0.32 x copy at N = 1128
    on an H200, 0.69 at 1120)."""
    align = 16
    for v in values:
        while align > 1 and v % align:
            align //= 2
    return 1 if align == 16 else align


def tma_addressable(*tensors_strides: tuple, align: int = 16) -> bool:
    """Rows a TMA descriptor can address, for each (tensor, row stride): a 16-byte aligned start, a row
    stride of a multiple of 16 bytes, no zero stride (`align`: a stricter alignment of both, in bytes),
    fewer than 2^31 rows (a tile's coordinates are signed 32-bit)."""
    return all(t.data_ptr() % align == 0 and s > 0 and s * t.element_size() % align == 0 and t.shape[0] < 2 ** 31
               for t, s in tensors_strides)
