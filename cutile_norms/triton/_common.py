"""What the Triton forward and backward share: the split rows' exchange, the config arithmetic, the
programs of a compiled kernel one SM holds (for one-wave persistent grids)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._workspace import current_raw_stream

# Under TRITON_INTERPRET=1 (the CPU CI) programs run one after another: no program may wait for
# another, so a split launch runs as two launches (partial sums, then the rest).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def row_offsets(rows, stride, ALIGN: tl.constexpr):
    """rows[:, None] * stride, said to be multiples of ALIGN elements (tiling.offset_align): Triton infers
    alignment only from integer arguments divisible by 16, so rows of N = 8 (mod 16) 16-bit elements
    compiled to 2-byte loads and stores (backward, bf16 N = 1128: 0.32 x copy on an H200, 0.69 at 1120)."""
    off = rows * stride
    if ALIGN > 1:
        off = tl.multiple_of(off, [ALIGN])
    return off[:, None]


@triton.jit
def weight_row(W, cols, ok, offset, HAS_OFFSET: tl.constexpr):
    """w' = offset + w in fp32 at `cols`; offset == 0 compiled without the add (HAS_OFFSET: the weight as it
    is)."""
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w = w + offset
    return w


@triton.jit
def bound(n, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr):
    """n splat over a tile's columns, said to be a multiple of ALIGN: a column mask `cols < n` then keeps
    runs of ALIGN equal bits, which vector loads and stores need."""
    b = tl.full([BLOCK_N], n, tl.int32)
    if ALIGN > 1:
        b = tl.multiple_of(b, [ALIGN])
    return b


@triton.jit
def part_mask(lanes, cols, PART, N, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr):
    """The lanes of a tile that hold columns of this program's part (lanes < PART) and of the row
    (cols < N), with both bounds said to be multiples of ALIGN (`bound`)."""
    return (lanes < bound(PART, BLOCK_N, ALIGN)) & (cols < bound(N, BLOCK_N, ALIGN))


@triton.jit
def row_tile(tile, M, ROWS: tl.constexpr, INT64: tl.constexpr):
    """(the rows of row tile `tile`, int64 where INT64, and which of them are below M). The tile is widened
    before the multiply: a program id is int32, and past 2^31 rows its product wrapped."""
    if INT64:
        tile = tile.to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    return rows, rows < M


@triton.jit
def program_part(SPLIT: tl.constexpr):
    """(part, row group) of this program: program p owns part p % SPLIT of row group p // SPLIT's tiles."""
    pid = tl.program_id(0)
    return pid % SPLIT, pid // SPLIT


@triton.jit
def slot_row_stride(SPLIT: tl.constexpr):
    """Slots per row in the exchange buffer: whole 128-byte lines (16 int64), so the rows in flight
    spread their polling over many L2 lines instead of sharing a few."""
    return 16 * ((SPLIT + 15) // 16)


def slot_count(rows: int, split: int) -> int:
    return rows * 16 * -(-split // 16)


@triton.jit
def slot_flag(SLOTS, tile, rows, row_ok, part, ROWS: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """The flag this launch publishes in this program's exchange slots: the opposite of what the last
    launch over these rows left there (this program is the only one that writes them); under the
    interpreter's second phase, the flag the first phase wrote. A scalar for one-row tiles (`tile`
    is the row), else [ROWS] int64. Loaded before the row's reduction, so its round trip overlaps
    the loads of x."""
    if ROWS == 1:
        prev = tl.load(SLOTS + tl.cast(tile, tl.int64) * slot_row_stride(SPLIT) + part, volatile=True)
    else:
        prev = tl.load(SLOTS + rows * slot_row_stride(SPLIT) + part, mask=row_ok, other=0, volatile=True)
    if PHASE == 2:
        return prev >> 32
    return 1 - (prev >> 32)


@triton.jit
def _poll(idx, mask, flag, zero):
    """The slots at `idx` once every one under `mask` shows `flag`, read with relaxed gpu-scope atomics
    adding `zero` (int64 zeros of idx's shape). An atomic is issued once per slot, where a volatile
    load is issued by every warp holding a copy: with 8-16 warps per program the volatile poll
    measured 0.50-0.89 x copy against 0.91-0.97 with atomics, 0.98-0.99 without any wait
    (N = 65536, 16 parts). A nanosleep between volatile polls gained nothing (-4 % to +6 %)."""
    slots = tl.atomic_add(idx, zero, mask=mask, sem="relaxed", scope="gpu")
    done = tl.min((((slots >> 32) == flag) | ~mask).to(tl.int32))
    while done == 0:
        slots = tl.atomic_add(idx, zero, mask=mask, sem="relaxed", scope="gpu")
        done = tl.min((((slots >> 32) == flag) | ~mask).to(tl.int32))
    return slots


@triton.jit
def slot_word(flag, partial):
    """The int64 a program publishes in its exchange slot: `flag` in the high word, the fp32 bits of
    `partial` in the low one."""
    return (flag << 32) | (partial.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _low_float(slots):
    return (slots & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def exchange(SLOTS, tile, rows, row_ok, partial, part, flag, ROWS: tl.constexpr, SPLIT: tl.constexpr,
             PHASE: tl.constexpr):
    """The sum over a row's SPLIT programs of `partial` ([ROWS] fp32, this program's part of each row).

    Slot row * stride + part (int64) holds a partial sum: its fp32 bits in the low word and, in the
    high word, `flag`, which every launch flips (`slot_flag`). Each program publishes its partials
    with one relaxed atomic exchange (no fence, no counter: the slot is the message), then polls the
    row's SPLIT slots (`_poll`) until every one shows its flag, and sums them in one fixed
    order: every part of a row gets the same bits, the slots never need clearing, and a replayed
    CUDA graph flips them like an eager launch. The slots are kept per SPLIT value (then every launch
    flips all SPLIT slots of each row it covers, and a row's slots always agree). The wait relies on
    a row's programs running at once: the grid is either one wave or dispatched in index order with
    a row's programs adjacent.
    One-row tiles work on scalars and a 1-D (SPLIT,) poll: the [1, SPLIT] form cost ~80 registers
    per thread at 128 threads (ptxas -v), and registers bound the programs in flight."""
    if ROWS == 1:
        slot_row = SLOTS + tl.cast(tile, tl.int64) * slot_row_stride(SPLIT)
        mine = tl.sum(partial, axis=0)
        if PHASE != 2:
            tl.atomic_xchg(slot_row + part, slot_word(flag, mine), sem="relaxed", scope="gpu")
        total = partial
        if PHASE != 1:
            lanes = tl.arange(0, SPLIT)
            slots = _poll(slot_row + lanes, lanes < SPLIT, flag, tl.zeros([SPLIT], dtype=tl.int64))
            total = tl.zeros_like(partial) + tl.sum(_low_float(slots), axis=0)
    else:
        slot_rows = SLOTS + rows * slot_row_stride(SPLIT)
        if PHASE != 2:
            tl.atomic_xchg(slot_rows + part, slot_word(flag, partial), mask=row_ok, sem="relaxed", scope="gpu")
        total = partial
        if PHASE != 1:
            idx = slot_rows[:, None] + tl.arange(0, SPLIT)[None, :]
            slots = _poll(idx, row_ok[:, None] & (tl.arange(0, SPLIT) < SPLIT)[None, :], flag[:, None],
                          tl.zeros([ROWS, SPLIT], dtype=tl.int64))
            total = tl.sum(_low_float(slots), axis=1)
    return total


_RESIDENT: dict = {}  # (kernel, signature, device index) -> programs of it that fit on one SM at once


def resident_programs(kernel, args: tuple, consts: dict, num_warps: int, num_stages: int, device: torch.device,
                      key: tuple) -> int:
    """How many programs of this compiled kernel one SM holds at once, from its registers, shared
    memory and threads (NVIDIA; elsewhere and under the interpreter 32, i.e. no limit). A persistent
    grid whose split rows wait for each other must fit on the GPU in one wave: a grid sized from
    threads alone (2048 per SM) overshot what the registers allow at wide parts, and the programs
    that did not fit ran after the first wave had ended. `key`: what picks the compiled variant
    (the constants and the tensors' dtypes); compiled once per key (`warmup`, no launch)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip:
        return 32
    full = (id(kernel), key, num_warps, num_stages, device.index)
    hit = _RESIDENT.get(full)
    if hit is None:
        compiled = kernel.warmup(*args, grid=(1,), **consts, num_warps=num_warps, num_stages=num_stages)
        compiled._init_handles()  # loads the binary: n_regs is known from here
        props = torch.cuda.get_device_properties(device)
        regs_per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # allocated per warp, 256 at a time
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (num_warps * 32)
        smem = compiled.metadata.shared
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // smem if smem else 32
        hit = _RESIDENT[full] = max(1, min(by_regs, by_threads, by_smem, 32))
    return hit


_SHARED: dict = {}  # device index -> shared memory one block may take (bytes)


def shared_per_block(device: torch.device) -> int | None:
    """The shared memory one block may take on `device` (its opt-in maximum: 227 KiB on an H100 or H200,
    99 KiB on sm_120); None under the interpreter and off NVIDIA GPUs (no limit checked)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    hit = _SHARED.get(index)
    if hit is None:
        props = torch.cuda.get_device_properties(index)
        hit = _SHARED[index] = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    return hit


def raw_stream(device: torch.device) -> int:
    """The current stream's handle (the workspaces are kept per stream); 0 for CPU tensors."""
    return current_raw_stream(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" and current_raw_stream else 0
