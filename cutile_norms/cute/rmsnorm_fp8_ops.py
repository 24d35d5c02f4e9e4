"""The FP8 kernel's device operations (rmsnorm_fp8_kernel.py): the inline PTX whose bits the contract fixes
(the NaN-propagating max, IEEE reciprocal and scale, the saturating conversion, the stores), and the group
amax's transposed shuffle reduction, written once over the lane operations it is given, so that a test
runs the same code over simulated lanes.
"""
from __future__ import annotations

import struct

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from ._device import inline_asm


def f32_hex(v: float) -> str:
    """A PTX fp32 literal (0fXXXXXXXX) of v."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def asm_f32(asm: str, constraints: str, *args, loc=None, ip=None) -> Float32:
    return inline_asm(Float32, asm, constraints, [Float32(a) for a in args], loc=loc, ip=ip)


@dsl_user_op
def max_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max(a, b), NaN if either is NaN (max.NaN: one instruction)."""
    return asm_f32("max.NaN.f32 $0, $1, $2;", "=f,f,f", a, b, loc=loc, ip=ip)


@dsl_user_op
def max_abs_nan(acc: Float32, v: Float32, *, loc=None, ip=None) -> Float32:
    """max(acc, |v|), NaN if either is NaN."""
    return asm_f32("{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", "=f,f,f", acc, v, loc=loc, ip=ip)


@dsl_user_op
def rcp_rn(a: Float32, *, loc=None, ip=None) -> Float32:
    """1 / a correctly rounded (rcp.rn: the bits of IEEE division 1 / a), whatever the compiler's
    fast-math choices."""
    return asm_f32("rcp.rn.f32 $0, $1;", "=f,f", a, loc=loc, ip=ip)


def scale_asm(top: float, min_amax: float, has_ub: bool, ue8m0: bool) -> str:
    """PTX of s = scale(amax = $1, ub = $2): reference.fp8_scale op for op."""
    lines = ["{ .reg .f32 a; .reg .pred p; .reg .b32 b, e, m;",
             "min.f32 a, $1, $2;" if has_ub else "mov.f32 a, $1;",
             f"max.f32 a, a, {f32_hex(min_amax)};",
             f"div.rn.f32 a, a, {f32_hex(top)};"]
    if ue8m0:  # 2^ceil(log2 s): the exponent, plus one unless the mantissa is zero
        lines += ["mov.b32 b, a;", "bfe.u32 e, b, 23, 8;", "and.b32 m, b, 8388607;", "setp.ne.u32 p, m, 0;",
                  "selp.u32 m, 1, 0, p;", "add.u32 e, e, m;", "shl.b32 b, e, 23;", "mov.b32 a, b;"]
    lines += ["setp.nan.f32 p, $1, $1;", "selp.f32 $0, 0f7FC00000, a, p; }"]
    return " ".join(lines)


@dsl_user_op
def opaque_b32(a: Int32, *, loc=None, ip=None) -> Int32:
    """a, through a move the compiler may not move out of a loop (volatile)."""
    return inline_asm(Int32, "mov.b32 $0, $1;", "=r,r", [Int32(a)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def select_eq(a: Int32, b: Int32, x, y, *, loc=None, ip=None):
    """x if a == b else y (fp32 or int32 x and y)."""
    f32 = isinstance(x, Float32) or isinstance(x, float)
    t, c = (Float32, "f") if f32 else (Int32, "r")
    asm = f"{{ .reg .pred p; setp.eq.s32 p, $1, $2; selp.{'f32' if f32 else 'b32'} $0, $3, $4, p; }}"
    return inline_asm(t, asm, f"={c},r,r,{c},{c}", [Int32(a), Int32(b), t(x), t(y)], loc=loc, ip=ip)


@dsl_user_op
def fp8x4(a: Float32, b: Float32, c: Float32, d: Float32, e4m3: cutlass.Constexpr[bool], *, loc=None,
          ip=None) -> Int32:
    """Four fp32 rounded to nearest even and saturated (cvt.rn.satfinite: NaN stays NaN) to e4m3 or
    e5m2, packed in memory order (a at the lowest byte)."""
    fmt = "e4m3x2" if e4m3 else "e5m2x2"
    asm = (f"{{ .reg .b16 lo, hi; cvt.rn.satfinite.{fmt}.f32 lo, $2, $1; cvt.rn.satfinite.{fmt}.f32 hi, $4, $3; "
           "mov.b32 $0, {lo, hi}; }")
    return inline_asm(Int32, asm, "=r,f,f,f,f", [Float32(v) for v in (a, b, c, d)], loc=loc, ip=ip)


@dsl_user_op
def store_words(addr: Int64, w0: Int32, w1, *, loc=None, ip=None):
    """One store of one (w1 None) or two 32-bit words at a global address (8-byte aligned for two)."""
    if w1 is None:
        asm, cons, words = "st.global.b32 [$0], $1;", "l,r", [w0]
    else:
        asm, cons, words = "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", [w0, w1]
    inline_asm(None, asm, cons, [Int64(addr)] + [Int32(v) for v in words], side_effects=True, loc=loc, ip=ip)


def transposed_plan(V: int, L: int) -> tuple[list[int], list[int]]:
    """Where a transposed reduction of V values over L lanes (a power of two, V <= L) leaves each value
    (trace-time Python; `RMSNormFp8TmaSmem._group_reciprocals` runs it). At each butterfly level
    (offsets L/2 ... 1) a lane's list of slots is halved: the lane whose offset bit is 0 keeps the
    first half, its partner the second, and each shuffle carries the half the other keeps; an odd
    list's last slot is reduced by both. One slot is left per lane. Returns (held, source): held[p] the
    slot lane p holds at the end, source[v] the first lane holding slot v (every slot is held: each
    level gives each half of the lanes at most as many slots as it has lanes). Read off the reduction
    itself, run for each lane with the slot numbers as the tags."""
    assert V <= L, (V, L)
    held = [transposed_reduce([0] * V, list(range(V)), L, lambda o, p=p: (p // o) % 2,
                              lambda h, a, b: a if h == 0 else b, lambda v, o: v, max)[1] for p in range(L)]
    source = [held.index(v) for v in range(V)]
    return held, source


def transposed_reduce(vals: list, cols: list, L: int, high, select, shuffle, op):
    """The transposed reduction of `transposed_plan` over a group of L lanes: `vals` the lane's V values
    (V <= L), `cols` a tag of each (their columns), carried along without shuffles. Returns the lane's
    one value left, op-reduced over the group's lanes, and its tag. The lane's operations come as
    functions (the kernel's instructions, or a test's simulation of the lanes): high(o) the lane's bit
    o (0 or 1), select(c, a, b) a where c is 0 else b, shuffle(v, o) lane ^ o's v."""
    o = L // 2
    while o:
        h = high(o)
        half = len(vals) // 2
        kept, kept_cols = [], []
        for u in range(half):  # the lane keeps slot u (h = 0) or u + half, and sends its partner the other
            lo, hi = vals[u], vals[u + half]
            kept.append(op(select(h, lo, hi), shuffle(select(h, hi, lo), o)))
            kept_cols.append(select(h, cols[u], cols[u + half]))
        if len(vals) % 2:  # the odd slot: reduced by both lanes
            kept.append(op(vals[-1], shuffle(vals[-1], o)))
            kept_cols.append(cols[-1])
        vals, cols = kept, kept_cols
        o //= 2
    return vals[0], cols[0]
