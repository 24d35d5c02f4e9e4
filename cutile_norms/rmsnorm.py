"""The public RMSNorm: validation, the autograd Function, `rms_norm`, `RMSNorm` (`explain` in explain.py).

Kernels assume valid input; every check lives here. Contract:
  * x [..., N] in fp16/bf16/fp32 (any leading dims, M = prod of them, M = 0 gives an empty result);
    weight [N] in x's dtype or fp32, or None; eps a finite positive number; offset finite (Gemma: 1.0).
  * y = x * rsqrt(mean(x^2) + eps) * (offset + weight), math in fp32, y in x's dtype, contiguous.
  * Rows may be strided (x[:, :N] of a wider tensor is read in place); a last dim with stride != 1
    (e.g. a transposed view) is copied to contiguous first.
  * Autograd: differentiable in x and weight. The GPU kernels save rstd (fp32) for the backward,
    which runs the mode's backward kernel (`dispatch.backward_backend`; the persistent cuTile kernel
    for every cuTile mode; for mode=None the kernel backward_table.BACKWARD_TABLE names for the row's
    bytes, else the forward mode's); mode="torch" differentiates the reference's ops.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.autograd.forward_ad as _forward_ad

from . import dispatch
from ._experimental import experimental_enabled
from ._util import ints
from ._platform import device_info, fake_call, on_gpu, on_its_gpu, run_on_gpu, several_gpus, toolchain
from .distributed import is_dtensor, warn_if_gathered
from .reference import rms_norm_backward, rms_norm_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DEFAULT_EPS = torch.finfo(torch.float32).eps  # eps=None (torch.nn.RMSNorm's default), measured equal


# ================================================================================================
# Validation
# ================================================================================================
def validate(x, weight, eps, offset) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the normalized one), got a 0-d tensor")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dim, "
                             f"got {tuple(weight.shape)}")
        if weight.dtype != x.dtype and weight.dtype != torch.float32:
            raise TypeError(f"weight must be x's dtype ({x.dtype}) or float32, got {weight.dtype}")
        if weight.device != x.device:
            raise ValueError(f"x and weight must be on the same device, got {x.device} and {weight.device}")
        if is_dtensor(weight) != is_dtensor(x):
            raise TypeError("x and weight must both be DTensors or both plain tensors, got "
                            + " and ".join(type(t).__name__ for t in (x, weight)))
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (0 < eps < math.inf):  # also false for NaN
        raise ValueError(f"eps must be a finite positive number, got {eps}")
    if type(offset) is not float and (isinstance(offset, bool) or not isinstance(offset, numbers.Real)):
        raise TypeError(f"offset must be a real number, got {type(offset).__name__}")
    if not (-math.inf < offset < math.inf):
        raise ValueError(f"offset must be finite, got {offset}")
    if weight is None and offset != 0:
        raise ValueError(f"offset={offset} scales the weight (offset + w), but weight is None; "
                         f"pass a weight or offset=0")


def under_transform() -> bool:
    """Forward-mode AD (a dual level open) or a torch.func transform (grad, vmap, jvp, jacrev, a batched
    backward) is active: the kernels have no forward-mode or batching rule, so the reference's torch ops
    run (the tangents and batch dims carried through them), whatever the mode."""
    return _forward_ad._current_level >= 0 or _TRANSFORMS_ACTIVE()


def batched_grad(g: torch.Tensor | None) -> bool:
    """g is a grad batched by autograd's own vmap (jacobian(vectorize=True), grad(is_grads_batched=True)),
    which has no storage for a kernel to read."""
    return g is not None and _LEGACY_BATCHED(g)


# (torch internals, each read with a default where a torch version lacks it)
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_LEGACY_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", lambda t: False)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, N] with unit column stride, a view whenever torch can make one (x itself when it is one:
    inside a forward + backward every torch call costs ~4-5 us of host time, docs/design.md)."""
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1 and x2d.shape[-1] > 1:
        x2d = x2d.contiguous()
    return x2d


# ================================================================================================
# Autograd
# ================================================================================================
class _RMSNormFunction(torch.autograd.Function):
    """The eager autograd node over `forward_rows` and `backward_rows`, the implementation the custom ops
    below run too. Takes x in its own shape and gives y in it: x's rows are made inside, where no
    autograd node records the reshape (two view nodes per call otherwise, each a few µs of host time
    in a training step)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, mode, bwd_mode, dev, run=None):
        # run: the call plan's prepared launch, if any; bwd_mode: dispatch.Choice.backward_mode
        x2d = as_rows(x)
        y, rstd = forward_rows(x2d, weight, eps, offset, True, mode, dev, x.shape, run)
        ctx.save_for_backward(x2d, weight, rstd, x)
        ctx.eps, ctx.offset, ctx.bwd_mode, ctx.dev, ctx.x_shape = eps, offset, bwd_mode, dev, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd, x = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dw = weight is not None and ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # create_graph=True: the grads must carry a graph themselves
            return graph_backward(dy, x, weight, ctx.eps, ctx.offset, need_dx, need_dw) + (None,) * 6
        dx, dw = backward_rows(dy, x2d, weight, rstd, ctx.offset, ctx.bwd_mode, need_dx, need_dw, ctx.dev)
        if dx is not None and dx.shape != ctx.x_shape:
            dx = dx.view(ctx.x_shape)
        return dx, dw, None, None, None, None, None, None


# ================================================================================================
# The implementation both autograd paths run (eager: _RMSNormFunction and the call plans; compiled:
# the custom ops)
# ================================================================================================
def forward_rows(x2d, weight, eps, offset, store_rstd, mode, dev, out_shape, run=None):
    """(y in out_shape, rstd [M] fp32 or None) from the mode's kernel; `run` is a call plan's launch
    prepared for this signature (the backend's `launcher`), else the backend's forward decides."""
    if run is not None:
        return run(x2d, weight, eps, offset, out_shape)
    return dispatch.backend(mode).forward(x2d, weight, eps, offset, store_rstd, dev, out_shape=out_shape)


def backward_rows(dy, x2d, weight, rstd, offset, bwd_mode, need_dx, need_dw, dev, dh=None):
    """(dx [M, N] or None, dw [N] or None) from the backward kernel of `bwd_mode`; mode "torch" and
    empty x take the reference's closed form. `dh` (x's shape, the residual add's backward): added to
    dx inside the kernel, for a backend that reads it (BackwardBackend.adds_dh; the caller adds it
    after the others: residual._bwd_op)."""
    dy2d = grad_rows(dy, x2d)
    dh2d = grad_rows(dh, x2d) if dh is not None and need_dx else None
    if dh2d is not None and (bwd_mode == "torch" or not dispatch.backward_backend(bwd_mode).adds_dh):
        raise ValueError(f"mode {bwd_mode!r}'s backward does not read dh: add it to dx after the backward")
    if bwd_mode == "torch" or x2d.numel() == 0 or under_transform() or batched_grad(dy):  # (a batched backward)
        return rms_norm_backward(dy2d, x2d, weight, rstd, offset, need_dx=need_dx, need_dw=need_dw)
    if rstd.stride(0) != 1 and rstd.numel() > 1:  # the kernels read rstd at unit stride (the forward's is)
        rstd = rstd.contiguous()
    return dispatch.backward_backend(bwd_mode).backward(dy2d, x2d, _unit_stride(weight), rstd, offset,
                                                        need_dx, need_dw, dev, dh2d=dh2d)


def graph_backward(dy, x, weight, eps, offset, need_dx, need_dw):
    """(dx, dw) with their own graph, for create_graph=True (gradient penalties, Hessian-vector
    products): the reference's forward recomputed in torch ops from the saved inputs and differentiated
    with its graph kept. The kernels give first-order grads only; this recompute runs only when asked."""
    inputs = [t for t, need in ((x, need_dx), (weight, need_dw)) if need]
    if not inputs:
        return None, None
    with torch.enable_grad():
        y = rms_norm_reference(x, weight, eps, offset)[0]
        grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=True, allow_unused=True))
    return (next(grads) if need_dx else None), (next(grads) if need_dw else None)


def grad_rows(dy: torch.Tensor, x2d: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
    """dy as [M, N] rows with unit column stride in x's dtype (or its own: `keep_dtype`, for a kernel
    that reads any). Autograd hands out expanded grads (a row stride of 0 is read in place) and,
    rarely, transposed or other-dtype ones (copied)."""
    if dy.shape != x2d.shape:
        dy = dy.reshape(x2d.shape)
    if dy.dtype != x2d.dtype and not keep_dtype:
        dy = dy.to(x2d.dtype)
    if dy.stride(-1) != 1 and dy.shape[-1] > 1:
        dy = dy.contiguous()
    return dy


def _unit_stride(weight):
    return weight if weight is None or weight.stride(0) == 1 or weight.numel() <= 1 else weight.contiguous()


# ================================================================================================
# torch.library ops: what torch.compile sees
# ================================================================================================
# Under torch.compile, rms_norm is the op cutile_norms::rms_norm_fwd (its backward the op
# cutile_norms::rms_norm_bwd, wired by register_autograd): dynamo never traces the dispatch code or
# cuTile's launch, the fake impls give inductor the output shapes with M symbolic, and CUDA graphs
# (mode="reduce-overhead") capture the kernels' launches. Eager calls skip the op layer (the
# dispatcher's round trip through Python costs host time at batch 1) and reach the same `forward_rows`
# and `backward_rows` through _RMSNormFunction. The mode travels as a string ("" = None) and is resolved
# inside the op, per call, with the real M.
@torch.library.custom_op("cutile_norms::rms_norm_fwd", mutates_args=())
@on_its_gpu
def _fwd_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, mode: str,
            store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's shape and dtype, rstd fp32 of x's leading shape, or of x's leading shape + (0,) without
    store_rstd). rstd keeps x's leading dims so that a DTensor sharding of x on them shards it alike."""
    dev, M, choice = plan(x, mode or None, weight)
    if not store_rstd:
        no_rstd = x.new_empty(x.shape[:-1] + (0,), dtype=torch.float32)
    if choice.mode == "torch" or x.numel() == 0:
        y, rstd = rms_norm_reference(x, weight, eps, offset)
        return y.contiguous(), rstd.float().contiguous() if store_rstd else no_rstd
    y, rstd = forward_rows(as_rows(x), weight, eps, offset, store_rstd, choice.mode, dev, x.shape)
    return y, rstd.view(x.shape[:-1]) if store_rstd else no_rstd


@_fwd_op.register_fake
def _fwd_fake(x, weight, eps, offset, mode, store_rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1] if store_rstd else x.shape[:-1] + (0,), dtype=torch.float32))


@torch.library.custom_op("cutile_norms::rms_norm_bwd", mutates_args=())
@on_its_gpu
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
            mode: str, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's shape and dtype, dw [N] in the weight's dtype); an empty tensor for a grad not asked for."""
    dev, M, choice = plan(x, mode or None, weight)
    need_dw = need_dw and weight is not None
    bwd_mode = "torch" if choice.mode == "torch" else choice.backward_mode
    dx, dw = backward_rows(dy, as_rows(x), weight, rstd.reshape(-1), offset, bwd_mode, need_dx, need_dw, dev)
    return (dx.view(x.shape) if need_dx else x.new_empty(0),
            dw if need_dw else x.new_empty(0))


@_bwd_op.register_fake
def _bwd_fake(dy, x, weight, rstd, offset, mode, need_dx, need_dw):
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw and weight is not None else x.new_empty(0))


def _fwd_op_setup(ctx, inputs, output):
    x, weight, eps, offset, mode, store_rstd = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset, ctx.mode = eps, offset, mode


def _fwd_op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    need_dw = weight is not None and ctx.needs_input_grad[1]
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True, eager
        return graph_backward(dy, x, weight, ctx.eps, ctx.offset, need_dx, need_dw) + (None,) * 4
    dx, dw = torch.ops.cutile_norms.rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.mode, need_dx, need_dw)
    return dx if need_dx else None, dw if need_dw else None, None, None, None, None


_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup)


def _rms_norm_traced(x, weight, eps: float, offset: float, mode: str | None) -> torch.Tensor:
    """rms_norm as torch.compile traces it: the reference's ops for mode="torch" (inductor fuses
    them), else the op."""
    if mode == "torch":
        return rms_norm_reference(x, weight, eps, offset)[0]
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    return torch.ops.cutile_norms.rms_norm_fwd(x, weight, eps, offset, mode or "", grad)[0]


# ================================================================================================
# Public entry points
# ================================================================================================
def plan(x, mode, weight=None):
    """(device info, M, the dispatch choice) for rows of x under `mode`, with `weight` (its dtype: an fp32
    weight beside 16-bit x takes its own backward rows in mode=None's table)."""
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    fp32_weight = weight is not None and weight.dtype == torch.float32 and x.element_size() == 2
    dev, choice = _route(mode, x.device, x.dtype, M, N, fp32_weight, experimental_enabled())
    # a backend that does not take every row says why in `unsupported`: checked once per call signature
    # (x's 16-byte alignment is part of the call plans' key)
    backend = None if choice.mode == "torch" else dispatch.backend(choice.mode)
    if M and backend is not None and not backend.takes_every_row:
        why = backend.unsupported(as_rows(x), batch_invariant=mode is None)
        if why:  # the mode cannot take these rows: an error when asked for, another mode for mode=None
            if mode is not None:
                raise ValueError(why)
            choice = dispatch.instead_of(dev, toolchain(), choice.mode, why)
    return dev, M, choice


@functools.lru_cache(maxsize=8192)
def _route(mode, device, dtype, M, N, fp32_weight, _experimental_on):
    """(device info, the dispatch choice) for one call signature; cached so a call hashes plain
    values only (an uncached route cost ~10 us of Python per call on an H200 host)."""
    dev = device_info(device)
    return dev, dispatch.resolve(mode, dev, toolchain(), dtype, M, N, fp32_weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6, *,
             mode: str | None = None, offset: float = 0.0, residual: torch.Tensor | None = None,
             residual_dtype: torch.dtype | None = None):
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (offset + weight).

    eps=None: what torch's rms_norm does, torch.finfo(torch.float32).eps (its math type's epsilon,
    also for 16-bit x; its docs say x's dtype, its kernels use the math type's). mode: None (the
    measured heuristic; `explain()` says what it picks), "multi_wave_reload", "multi_wave_cached",
    "static_persistent" (cuTile), "tma_smem_cached" (CuTe DSL), "triton", or "torch" (the fp32
    reference). A mode that cannot run here raises and says why. Under torch.compile the call is one
    opaque op (see the torch.library ops above). With `residual`: the residual add fused in front,
    returning (y, h) with h = x + residual (cutile_norms.residual, add_rms_norm).
    """
    if residual is not None or residual_dtype is not None:
        if residual is None:
            raise ValueError("residual_dtype is the dtype of h = x + residual; it needs a residual")
        from .residual import add_rms_norm
        return add_rms_norm(x, residual, weight, eps, mode=mode, offset=offset, residual_dtype=residual_dtype)
    if eps is None:  # torch's rms_norm: the epsilon of its math type, fp32 for all three dtypes
        eps = TORCH_DEFAULT_EPS
    if torch.compiler.is_compiling():
        validate(x, weight, eps, offset)
        return _rms_norm_traced(x, weight, float(eps), float(offset), mode)
    if type(x) is not torch.Tensor and is_dtensor(x):  # the op on each shard (cutile_norms/distributed.py)
        validate(x, weight, eps, offset)
        dispatch.check_mode_name(mode)
        warn_if_gathered(x, weight)
        return _rms_norm_traced(x, weight, float(eps), float(offset), mode)
    if isinstance(x, torch.Tensor) and (weight is None or isinstance(weight, torch.Tensor)):
        return _planned(x, weight, eps, offset, mode)
    validate(x, weight, eps, offset)  # raises: x or the weight is not a tensor


def _planned(x: torch.Tensor, weight: torch.Tensor | None, eps, offset, mode: str | None) -> torch.Tensor:
    """An eager call through its call plan (made and validated on the signature's first call): x and the
    weight tensors (or None), eps resolved, not under torch.compile, x not a DTensor."""
    shapes_only = x.is_meta or under_transform()  # shapes only, or tangents and batch dims: the reference's ops
    if shapes_only or fake_call(x, weight):  # (fake: no memory to launch a kernel on; the op's fake rule)
        validate(x, weight, eps, offset)
        dispatch.check_mode_name(mode)
        if shapes_only:
            return rms_norm_reference(x, weight, float(eps), float(offset))[0].contiguous()
        return _rms_norm_traced(x, weight, float(eps), float(offset), mode)
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    if type(eps) is not float or type(offset) is not float:  # validated before it keys a plan: an unhashable
        validate(x, weight, eps, offset)  # one fails as a key, and True would key as 1
    if grad and x.is_inference():  # made under inference_mode: autograd cannot save it, a copy it can
        x = x.clone()
    key = (x.shape, x.stride(), x.dtype, x.device, eps, offset, mode, grad, x.data_ptr() & 15,
           None if weight is None else (type(weight), weight.shape, weight.stride(), weight.dtype, weight.device))
    call = _PLANS.get(key)
    if call is None:
        if x.is_cuda and several_gpus():  # made and run with x's GPU current (its backward: autograd's GPU thread)
            index = x.get_device()
            call = on_gpu(run_on_gpu(index, _call_plan, x, weight, eps, offset, mode, grad), index)
        else:
            call = _call_plan(x, weight, eps, offset, mode, grad)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = call
    return call(x, weight)


# Call plans: the call signature (shapes, strides, dtypes, devices, eps, offset, mode, autograd or
# not) -> a function of (x, weight) that runs the kernel with nothing left to decide. At batch 1 a call
# is host bound: validation and routing measured ~12 us of a 40 us call on an H100 host; a plan
# leaves them to the first call of a signature (bench/decode.py times calls). Tensors' values are never part of the key: only what was validated.
_PLANS: dict = {}
_MAX_PLANS = 4096  # a serving loop meets a few signatures per model; past this the dict starts over


def _call_plan(x, weight, eps, offset, mode, grad: bool):
    validate(x, weight, eps, offset)
    dev, M, choice = plan(x, mode, weight)
    eps, offset = float(eps), float(offset)
    if choice.mode == "torch" or x.numel() == 0:  # empty: the reference's ops give empty dx and zero dw
        return lambda x, w: rms_norm_reference(x, w, eps, offset)[0].contiguous()  # y contiguous, as documented
    backend = dispatch.backend(choice.mode)
    x2d = as_rows(x)
    shape, N, mode_name, bwd_mode = x.shape, x.shape[-1], choice.mode, choice.backward_mode
    w_dtype = None if weight is None else weight.dtype
    run = backend.launcher(M, N, x2d.stride(0), x.dtype, w_dtype, grad, dev)
    if grad:
        return lambda x, w: _RMSNormFunction.apply(x, w, eps, offset, mode_name, bwd_mode, dev, run)
    if run is None:
        return lambda x, w: forward_rows(as_rows(x), w, eps, offset, False, mode_name, dev, shape)[0]
    if x.dim() == 2 and x.stride(-1) == 1:  # (the plan's key holds x's shape and strides) rows as they are
        return lambda x, w: run(x, w, eps, offset, None)[0]
    if x.is_contiguous():  # a decode step's [batch, 1, hidden]: x itself, its rows read in place (backends.Runner)
        return lambda x, w: run(x, w, eps, offset, shape)[0]
    return lambda x, w: run(as_rows(x), w, eps, offset, shape)[0]  # forward_rows with its launch, one call less


class RMSNorm(torch.nn.Module):
    """Drop-in for torch.nn.RMSNorm (same `weight` parameter and state_dict), backed by rms_norm.

    The same constructor defaults as torch's: eps=None gives torch's result (the fp32 epsilon, see
    rms_norm).
    normalized_shape may name several trailing dims; they are normalized together. With offset != 0
    (Gemma's 1 + w), the weight initialises to 1 - offset so the initial scale is 1.
    """

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, *,
                 mode: str | None = None, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(ints("normalized_shape", normalized_shape))
        if not self.normalized_shape or any(d < 1 for d in self.normalized_shape):
            raise ValueError(f"normalized_shape must be positive dims, got {normalized_shape}")
        dispatch.check_mode_name(mode)
        if not elementwise_affine and offset != 0:
            raise ValueError("offset scales the weight; it needs elementwise_affine=True")
        self.eps, self.elementwise_affine, self.mode, self.offset = eps, elementwise_affine, mode, float(offset)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """y, or (y, h) with h = x + residual when given one (vLLM's and Liger's modules' form)."""
        k = len(self.normalized_shape)
        if x.shape[-k:] != self.normalized_shape:  # torch.Size is a tuple: no copy per call
            raise ValueError(f"expected x's trailing dims {self.normalized_shape}, got {tuple(x.shape)}")
        if k == 1 and residual is None and not torch.compiler.is_compiling() and type(x) is torch.Tensor:
            # a plain eager call (a decode step's): straight to its call plan, what rms_norm would reach
            # after its own checks (at batch 1 a call is host bound: bench/decode.py); the weight read
            # from _parameters where it is one, as Module.__getattr__ would
            params = self._parameters
            w = params["weight"] if "weight" in params else self.weight
            return _planned(x, w, TORCH_DEFAULT_EPS if self.eps is None else self.eps, self.offset, self.mode)
        if residual is not None:
            if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
                raise ValueError(f"residual must be a tensor of x's shape {tuple(x.shape)}, got "
                                 f"{tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual)}")
            w = None if self.weight is None else self.weight.reshape(-1)
            flat = (lambda t: t.reshape(*t.shape[:-k], -1)) if k > 1 else (lambda t: t)
            y, h = rms_norm(flat(x), w, self.eps, mode=self.mode, offset=self.offset, residual=flat(residual))
            return y.view(x.shape), h.view(x.shape)
        if k == 1:
            return rms_norm(x, self.weight, self.eps, mode=self.mode, offset=self.offset)
        flat = x.reshape(*x.shape[:-k], -1)
        w = None if self.weight is None else self.weight.reshape(-1)
        return rms_norm(flat, w, self.eps, mode=self.mode, offset=self.offset).view(x.shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"mode={self.mode!r}, offset={self.offset}")
