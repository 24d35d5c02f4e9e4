"""The residual add fused with RMSNorm: `add_rms_norm` (differentiable; what `rms_norm(..., residual=r)`
and `RMSNorm.forward(x, residual)` call) and `add_rms_norm_` (in place, for serving).

Contract:
  * x [..., N] in fp16/bf16/fp32; residual of x's shape, fp16/bf16/fp32, on x's device; weight, eps,
    offset and mode as for `rms_norm`.
  * h = x + residual, summed in fp32 and rounded once to residual_dtype (default: x's dtype);
    y = rms_norm(h) of h as stored (the value the next layer reads), in x's dtype. With residual_dtype
    x's dtype, h equals the unfused `h = x + residual` bit for bit, and y is `rms_norm(h, ...)` within
    its rounding (a fused kernel sums the squares in its own order, so a 16-bit y may differ from the
    norm kernel's in the last bit).
  * add_rms_norm returns (y, h), both contiguous in x's shape, differentiable in x, residual and the
    weight: the grad into h is the norm's backward on h plus the grad h receives from later uses,
    and dx and dresidual are that grad in x's and the residual's dtype; to second order too
    (create_graph=True runs the norm's closed-form backward in torch ops).
  * add_rms_norm_(x, residual, ...) writes h into residual and y into x (FlashInfer's and vLLM's
    fused_add_rmsnorm): h takes the residual's dtype; no autograd; x and residual must share no element.
  * Kernels (dispatch.residual_add_kernel / residual_backward decide): the fused forward (mode None:
    Triton's for rows of up to 32768 elements (16384 beside an fp32 weight where cuTile runs),
    cuTile's split form past that; a mode named: its own
    DSL's, the CuTe DSL one for "tma_smem_cached", cuTile's from rows of 3 KiB) reads x and r once and
    writes h and y once;
    elsewhere one torch.add writes h and the norm kernel `mode` resolves to runs on it.
    The backward reads dy, h and dh once and writes one grad: Triton's fused kernel (mode None: rows
    of up to 2 KiB, or up to 8192 elements without cuTile; mode "triton": up to 8192), else the norm's
    backward kernel for h with dh added inside (the cuTile and CuTe DSL kernels); Triton's norm backward,
    torch's, and every kernel under CUTILE_NORMS_FUSED=0 add dh after.
"""
from __future__ import annotations

import torch

from . import dispatch
from ._platform import fake_call, on_its_gpu, toolchain
from .distributed import is_dtensor, warn_if_gathered
from .reference import add_rms_norm_reference, rms_norm_backward
from .rmsnorm import (DTYPES, TORCH_DEFAULT_EPS, as_rows, backward_rows, batched_grad, forward_rows, grad_rows, plan,
                      under_transform, validate)
from .triton.add_rmsnorm_bwd_config import tensors_take_tma


def validate_residual(x, residual, residual_dtype) -> None:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype not in DTYPES:
        raise TypeError(f"residual must be float16, bfloat16 or float32, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"x and residual must be on the same device, got {x.device} and {residual.device}")
    if residual_dtype is not None and residual_dtype not in DTYPES:
        raise TypeError(f"residual_dtype must be None, float16, bfloat16 or float32, got {residual_dtype}")


def _sum_into(h, x, r) -> None:
    """h <- x + r, summed in fp32 and rounded once to h's dtype. torch.add rounds to the operands'
    promoted dtype first: right when that is fp32 or h's own dtype, twice rounded otherwise."""
    promoted = torch.promote_types(x.dtype, r.dtype)
    if promoted in (torch.float32, h.dtype):
        torch.add(x, r, out=h)
    elif h.dtype == torch.float32:  # 16-bit operands into an fp32 h: widen x exactly, then one fp32 add
        h.copy_(x)
        h.add_(r)
    else:  # bf16 operands into an fp16 h or the reverse
        torch.add(x.float(), r, out=h)


def _weight_for(weight, h_dtype):
    """The weight as the norm kernels take it for rows of h_dtype (its own dtype or fp32): a 16-bit
    weight of x's dtype with an fp32 h is widened (N elements, exact)."""
    if weight is None or weight.dtype in (h_dtype, torch.float32):
        return weight
    return weight.float()


def _fused_forward(x, residual, h, weight, mode, norm_mode, dev) -> tuple[str | None, str]:
    """dispatch.residual_add_kernel for these tensors: (the fused forward kernel or None, why)."""
    widest = max(x.element_size(), residual.element_size(), h.element_size())

    def cute_refusal():
        from .cute.add_rmsnorm_fwd import unsupported

        return unsupported(as_rows(x), as_rows(residual), h.dtype, batch_invariant=mode is None)

    fp32_weight = weight is not None and weight.dtype == torch.float32
    return dispatch.residual_add_kernel(mode, norm_mode, x.shape[-1], widest, dev, toolchain(), cute_refusal,
                                        fp32_weight)


def _add_norm(x, residual, weight, eps, offset, mode, h_dtype, store_rstd, in_place=False):
    """(y, h, rstd [M] fp32 or None) in x's shape; in place: y written into x, h into residual."""
    if in_place:
        h = residual
    else:
        h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    if x.numel() == 0:  # the reference's shapes (rstd of x's leading shape), nothing to compute
        y, _, rstd = add_rms_norm_reference(x, residual, weight, eps, offset, h_dtype)
        return (x if in_place else y.contiguous()), h, rstd.float()
    dev, M, choice = plan(h, mode, weight)
    kernel, _ = _fused_forward(x, residual, h, weight, mode, choice.mode, dev)
    if kernel is not None and (not in_place or (x.is_contiguous() and residual.is_contiguous())):
        out = ((x.view(M, -1), residual.view(M, -1)) if in_place else
               (torch.empty(M, x.shape[-1], dtype=x.dtype, device=x.device), h.view(M, -1)))
        y2d, _, rstd = dispatch.load(kernel)(as_rows(x), as_rows(residual), weight, eps, offset, h_dtype, store_rstd,
                                             out=out)
        return (x if in_place else y2d.view(x.shape)), h, rstd
    if choice.mode == "torch":
        y, h_ref, rstd = add_rms_norm_reference(x, residual, weight, eps, offset, h_dtype)
        h.copy_(h_ref)
        rstd = rstd.reshape(-1).float()
    else:
        if in_place:
            residual.add_(x)  # summed in fp32 (16-bit operands in torch's fp32 opmath), rounded once
        else:
            _sum_into(h, x, residual)
        # a 16-bit h under another x dtype: the norm runs on h widened to fp32, so y is rounded once, to x's
        # dtype (never to h's first: an fp32 x keeps fp32 precision, an fp16 h under bf16 x never overflows)
        rows = h if h.dtype in (x.dtype, torch.float32) else h.float()
        y, rstd = forward_rows(as_rows(rows), _weight_for(weight, rows.dtype), eps, offset, store_rstd, choice.mode,
                               dev, h.shape)
    if in_place:
        x.copy_(y)
        return x, h, rstd
    return (y if y.dtype == x.dtype else y.to(x.dtype)), h, rstd


# ================================================================================================
# torch.library ops: the one path in eager and under torch.compile (M symbolic in the fake impls)
# ================================================================================================
@torch.library.custom_op("cutile_norms::add_rms_norm_fwd", mutates_args=())
@on_its_gpu
def _fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
            mode: str, h_dtype: torch.dtype, store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in x's shape and dtype, h in x's shape and h_dtype, rstd [M] fp32 or an empty tensor)."""
    y, h, rstd = _add_norm(x, residual, weight, eps, offset, mode or None, h_dtype, store_rstd)
    if store_rstd and rstd is not None:  # x's leading shape, as rms_norm_fwd's (DTensor shards it alike)
        return y, h, rstd.reshape(x.shape[:-1])
    return y, h, x.new_empty(x.shape[:-1] + (0,), dtype=torch.float32)


@_fwd_op.register_fake
def _fwd_fake(x, residual, weight, eps, offset, mode, h_dtype, store_rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=h_dtype, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1] if store_rstd else x.shape[:-1] + (0,), dtype=torch.float32))


def grad_dtype(dy_dtype: torch.dtype, h_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the grad into h: h's, or fp32 where y's grad comes in another dtype (an fp32 x over
    a 16-bit h keeps its precision; x's and the residual's grads are cast from it once)."""
    return h_dtype if dy_dtype == h_dtype else torch.float32


@torch.library.custom_op("cutile_norms::add_rms_norm_bwd", mutates_args=())
@on_its_gpu
def _bwd_op(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
            rstd: torch.Tensor, offset: float, mode: str, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the grad into h in grad_dtype(dy, h), dw in the weight's dtype or an empty tensor): the norm's
    backward on h plus dh, in one kernel (Triton's fused one, or the mode's backward kernel reading dh)
    or the mode's backward kernel then an add (dispatch.residual_backward). The autograd formula hands
    the first to x and the residual."""
    need_dw = need_dw and weight is not None
    g_dtype = grad_dtype(dy.dtype, h.dtype)
    if h.numel() == 0:
        return torch.zeros_like(h, dtype=g_dtype), torch.zeros_like(weight) if need_dw else h.new_empty(0)
    dev, M, choice = plan(h, mode or None, weight)
    h2d = as_rows(h)
    dy2d, dh2d = grad_rows(dy, h2d, keep_dtype=True), None if dh is None else grad_rows(dh, h2d, keep_dtype=True)
    how, bwd_mode, _ = dispatch.residual_backward(mode or None, choice, h.shape[-1], h.element_size(), dev,
                                                  toolchain(), has_dh=dh is not None,
                                                  by_tma=tensors_take_tma(dy2d, dh2d, h2d, g_dtype))
    if how == dispatch.BWD_FUSED:
        g2d, dw = dispatch.load(dispatch.FUSED_ADD_BWD_KERNEL)(
            dy2d, dh2d, h2d, weight, rstd.reshape(-1).contiguous(), offset, need_dw, 2 * max(dev.sm_count, 1), g_dtype,
            dev)  # 2 per SM: the register kernel's measured grid
        return g2d.view(h.shape), dw if need_dw else h.new_empty(0)
    rows = h if g_dtype == h.dtype else h.float()  # dy in another dtype: the norm's backward in fp32
    inside = how == dispatch.BWD_DH_INSIDE
    # (dy2d, dh2d: the rows made above, so that a strided grad is not copied a second time)
    g2d, dw = backward_rows(dy2d, as_rows(rows), _weight_for(weight, rows.dtype), rstd.reshape(-1), offset, bwd_mode,
                            True, need_dw, dev, dh=dh2d if inside else None)
    g = g2d.view(h.shape)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if dh is not None and not inside:
        g = g.add_(dh)  # in g's dtype, summed in fp32
    return g, dw if need_dw else h.new_empty(0)


@_bwd_op.register_fake
def _bwd_fake(dy, dh, h, weight, rstd, offset, mode, need_dw):
    return (torch.empty_like(h, dtype=grad_dtype(dy.dtype, h.dtype), memory_format=torch.contiguous_format),
            weight.new_empty(weight.shape) if need_dw and weight is not None else h.new_empty(0))


def _setup(ctx, inputs, output):
    x, residual, weight, eps, offset, mode, h_dtype, store_rstd = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.eps, ctx.offset, ctx.mode, ctx.x_dtype, ctx.r_dtype = eps, offset, mode, x.dtype, residual.dtype
    ctx.set_materialize_grads(False)  # an unused h (or y) gives None: no add of zeros


def _backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    need_dx, need_dr = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_dw = weight is not None and ctx.needs_input_grad[2]
    if dy is None:  # y unused: the grad into h is dh alone, none for the weight (as autograd of x + r alone)
        return (None if dh is None or not need_dx else dh.to(ctx.x_dtype),
                None if dh is None or not need_dr else dh.to(ctx.r_dtype), None, None, None, None, None, None)
    if ((torch.is_grad_enabled() and not torch.compiler.is_compiling()) or under_transform() or batched_grad(dy)
            or batched_grad(dh)):
        # create_graph=True (second order), or a batched backward: the norm's closed-form backward in torch
        # ops, rstd recomputed
        # from h, all of it differentiable; h is this op's saved output, so differentiating the result
        # reaches x and the residual through this op once more. (Not autograd of the reference on h: a
        # grad for the weight would then run back through this op's node, which also takes the weight.)
        N = h.shape[-1]
        h2d = h.reshape(-1, N)
        rstd_graph = torch.rsqrt(h2d.float().square().mean(dim=-1) + ctx.eps)
        # on h in fp32 (a 16-bit h is widened exactly), so the grad is rounded once, to grad_dtype, as the
        # first-order path rounds it
        g2d, dw = rms_norm_backward(dy.reshape(-1, N), h2d.float(), weight, rstd_graph, ctx.offset, need_dw=need_dw)
        g = g2d.reshape(h.shape).to(grad_dtype(dy.dtype, h.dtype))
        if dh is not None:
            g = g + dh.to(g.dtype)
    else:
        g, dw = torch.ops.cutile_norms.add_rms_norm_bwd(dy, dh, h, weight, rstd, ctx.offset, ctx.mode, need_dw)
    # h = x + residual: both take the grad into h (the same tensor where the dtypes agree, as autograd's
    # own add does; the op's outputs may not alias, this formula's may)
    return (g.to(ctx.x_dtype) if need_dx else None, g.to(ctx.r_dtype) if need_dr else None,
            dw if need_dw else None, None, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("cutile_norms::add_rms_norm_", mutates_args=("x", "residual"))
@on_its_gpu
def _in_place_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                 mode: str) -> None:
    _add_norm(x, residual, weight, eps, offset, mode or None, residual.dtype, False, in_place=True)


# ================================================================================================
# Public entry points
# ================================================================================================
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float | None = 1e-6, *, mode: str | None = None, offset: float = 0.0,
                 residual_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (in residual_dtype, default x's), y = rms_norm(h) * (offset + weight)
    in x's dtype. See the module docstring; `explain(x, w, residual=r)` says which kernels run."""
    if eps is None:
        eps = TORCH_DEFAULT_EPS
    validate(x, weight, eps, offset)
    validate_residual(x, residual, residual_dtype)
    dispatch.check_mode_name(mode)  # (the op's fake rule and the reference's branch would not)
    h_dtype = residual_dtype or x.dtype
    if is_dtensor(x) and not torch.compiler.is_compiling():  # (dynamo does not trace a warning)
        warn_if_gathered(x, weight)
    if mode == "torch" or x.is_meta or under_transform():
        # the reference's ops: autograd (also of higher order, forward mode and torch.func) through them
        y, h, _ = add_rms_norm_reference(x, residual, weight, eps, offset, h_dtype)
        return y.contiguous(), h.contiguous()
    grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                        or (weight is not None and weight.requires_grad))
    y, h, _ = torch.ops.cutile_norms.add_rms_norm_fwd(x, residual, weight, float(eps), float(offset), mode or "",
                                                      h_dtype, grad)
    return y, h


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                  eps: float | None = 1e-6, *, mode: str | None = None, offset: float = 0.0) -> None:
    """In place: residual <- x + residual (in the residual's dtype), x <- rms_norm(residual) *
    (offset + weight). No autograd; CUDA-graph safe (no host sync; the fused kernel allocates nothing
    but rstd, the unfused path a y it copies into x). x and residual must share no element, and the weight
    must lie apart from both (checked before anything is written)."""
    if eps is None:
        eps = TORCH_DEFAULT_EPS
    validate(x, weight, eps, offset)
    validate_residual(x, residual, None)
    dispatch.check_mode_name(mode)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                    or (weight is not None and weight.requires_grad)):
        raise RuntimeError("add_rms_norm_ writes x and residual in place and has no autograd; "
                           "use rms_norm(x, weight, residual=residual) to differentiate")
    if is_dtensor(x) or is_dtensor(residual):
        # DTensor writes an in-place op's first argument where it lies, but would redistribute the residual
        # into a temporary copy (h lost): both must already sit where the rule computes them
        if not (is_dtensor(x) and is_dtensor(residual) and x.placements == residual.placements
                and x.device_mesh == residual.device_mesh):
            raise ValueError("add_rms_norm_ on DTensors needs x and residual with the same mesh and placements")
        if any(getattr(p, "dim", None) in (-1, x.ndim - 1) for p in x.placements):
            raise ValueError(f"add_rms_norm_ cannot write x sharded on its normalized dim ({tuple(x.placements)}) "
                             f"in place; shard it on a leading dim")
        warn_if_gathered(x, weight)
    else:  # (meta and fake tensors have no addresses to compare)
        _check_in_place(x, residual, weight, addresses=not (x.is_meta or fake_call(x, residual, weight)))
    torch.ops.cutile_norms.add_rms_norm_(x, residual, weight, float(eps), float(offset), mode or "")


def _check_in_place(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, addresses: bool) -> None:
    """add_rms_norm_'s memory rules, checked before anything is written: x and residual each write every
    element once (no expanded or self-overlapping rows), share no element, and the weight lies apart
    from both (a kernel would read it after h or y had overwritten it)."""
    if not x.numel():
        return
    for name, t in (("x", x), ("residual", residual)):
        if _self_overlapping(t):
            raise ValueError(f"add_rms_norm_ writes {name} in place, and its elements share memory (an expanded "
                             f"or self-overlapping view, strides {tuple(t.stride())}); pass a tensor of its own")
    if _share_elements(x, residual, addresses):
        raise ValueError("add_rms_norm_ needs x and residual in separate memory (they share elements, or are "
                         "views of one buffer this check cannot tell apart: rows at different strides)")
    if weight is not None and (_share_elements(weight, x, addresses) or _share_elements(weight, residual, addresses)):
        raise ValueError("add_rms_norm_ needs the weight apart from x and residual, which it writes")


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of t may lie at one address: its dims by stride, each stride must pass the
    span of the dims inside it (exact for expanded views and rows closer than their length)."""
    if t.is_contiguous():  # (the common case, without the sort: ~1 us of host time a tensor)
        return False
    span = 0
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if st <= span:
            return True
        span += (n - 1) * st
    return False


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(storage offset, rows, row stride, N) of t as rows of its last dim with unit column stride, rows
    apart; None where t is no such view."""
    N = t.shape[-1] if t.dim() else 1
    if (t.dim() and N > 1 and t.stride(-1) != 1) or _self_overlapping(t):
        return None
    try:
        r = t.view(-1, N)
    except RuntimeError:
        return None
    return r.storage_offset(), r.shape[0], r.stride(0) if r.shape[0] > 1 else N, N


def _share_elements(a: torch.Tensor, b: torch.Tensor, addresses: bool = True) -> bool:
    """Whether a and b have an element in common: exact for rows of one dtype at one row stride (e.g. two
    column ranges of one buffer), else whether their byte ranges intersect (conservative). `addresses`
    False (meta and fake tensors, which have none): storages told apart by identity, spans by offset."""
    storage = (lambda t: t.untyped_storage().data_ptr()) if addresses else (lambda t: t.untyped_storage()._cdata)
    if not a.numel() or not b.numel() or storage(a) != storage(b):
        return False
    ra, rb = _rows(a), _rows(b)
    if ra is not None and rb is not None and a.dtype == b.dtype and (ra[2] == rb[2] or 1 in (ra[1], rb[1])):
        (oa, ma, sa, na), (ob, mb, sb, nb) = ra, rb
        s = sa if ma > 1 else sb  # (one row: any stride is its own)
        # a's row i holds oa + i s + [0, na), b's row k ob + k s + [0, nb): they meet where some
        # d = (i - k) s, -(mb - 1) <= i - k <= ma - 1, has -na < d + oa - ob < nb
        lo, hi = -(mb - 1), ma - 1
        for r in {min(max((ob - oa) // s + e, lo), hi) for e in (0, 1)}:
            if -na < r * s + oa - ob < nb:
                return True
        return False
    def span(t):
        start = t.data_ptr() if addresses else t.storage_offset() * t.element_size()
        return start, start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def describe(x: torch.Tensor, residual: torch.Tensor, residual_dtype, mode: str | None,
             weight: torch.Tensor | None = None) -> str:
    """explain()'s line for the add: fused or not, and why."""
    h = torch.empty(x.shape, dtype=residual_dtype or x.dtype, device=x.device)
    dev, M, choice = plan(h, mode, weight)
    kernel, why = _fused_forward(x, residual, h, weight, mode, choice.mode, dev)
    fwd = (f"residual add: fused into the norm ({kernel}: {why})" if kernel else
           f"residual add: torch.add into h, then the norm kernel on h ({why})")
    h_bytes = (residual_dtype or x.dtype).itemsize
    how, bwd_mode, why_bwd = dispatch.residual_backward(  # (dy in x's dtype, dh in h's, both contiguous)
        mode, choice, x.shape[-1], h_bytes, dev, toolchain(), by_tma=x.dtype == h.dtype)
    bwd = {dispatch.BWD_FUSED: f"residual backward: fused, dh added inside ({dispatch.FUSED_ADD_BWD_KERNEL}: "
                               f"{why_bwd})",
           dispatch.BWD_DH_INSIDE: f"residual backward: fused, dh added inside the norm's backward ({why_bwd})",
           dispatch.BWD_DH_AFTER: f"residual backward: the norm's backward on h, then dh added ({why_bwd})"}[how]
    if how == dispatch.BWD_DH_INSIDE:  # the config that launch runs, with dh (it can differ from the norm's)
        bwd += "; " + dispatch.backward_backend(bwd_mode).describe(
            M, x.shape[-1], h.dtype, dev, weight.dtype if weight is not None else None, has_dh=True)
    return fwd + "\n" + bwd
