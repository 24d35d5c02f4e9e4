"""DTensor: sharding rules for the ops, so tensor-, sequence- and data-parallel inputs run the kernels
on their local shards (eager and under torch.compile alike).

Why `register_sharding` on the custom ops (and not a gather around them, or DTensor's op-strategy API):
a row's norm needs only that row, so any sharding of x's leading dims maps to the same sharding of y,
h and rstd with the weight replicated; the rule is a short list of (outputs, inputs) placements that
DTensor matches and redistributes to, and it is the same list whichever way the op is reached. The
weight's grad from a shard is that shard's rows' sum: `Partial` on every mesh dim that shards the
rows, which DTensor (and FSDP2) reduce when asked. What no rule here offers:
  * the normalized (last) dim sharded: DTensor gathers it (redistributes to Replicate) before the op,
    an all-gather per call; `warn_if_gathered` says so once per process, naming the placement;
  * a `Partial` x: reduced first (the norm is not linear).
Both are DTensor's own redistributions, with these rules choosing the target.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch

_warned: set = set()
_registered = False


def is_dtensor(t) -> bool:
    """Without importing DTensor (0.5 s): a DTensor exists only once its module is imported."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def replicated_like(t: torch.Tensor, x) -> torch.Tensor:
    """t as a tensor replicated over x's mesh where x is a DTensor (and t is not one yet), else t: what a
    caller returns beside x's outputs without sending t through an op (rms_norm_fp8's given scale)."""
    if not is_dtensor(x) or is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)


def warn_if_gathered(x, weight) -> None:
    """One warning per (placements) where DTensor will gather x's last dim or a sharded weight per call."""
    from torch.distributed.tensor import Replicate, Shard

    gathered = [p for p in x.placements if isinstance(p, Shard) and p.dim in (-1, x.ndim - 1)]
    if is_dtensor(weight):
        gathered += [p for p in weight.placements if not isinstance(p, Replicate)]
    key = (tuple(x.placements), tuple(weight.placements) if is_dtensor(weight) else None)
    if gathered and key not in _warned:
        _warned.add(key)
        warnings.warn(f"cutile_norms: x placements {tuple(x.placements)}, weight placements "
                      f"{tuple(weight.placements) if is_dtensor(weight) else None}: the normalized dim and "
                      f"the weight must not be sharded for the kernels, so DTensor gathers them (an "
                      f"all-gather per call). Shard x on a leading dim and replicate the weight to avoid it.",
                      stacklevel=3)


def _row_shardings(args: tuple, row_inputs: int, row_outputs: int, weight_at: int,
                   weight_grad_out: int | None = None) -> list:
    """(outputs, inputs) placements for an op whose tensor args before `row_inputs` hold rows (x's
    leading dims) but the weight at `weight_at`: everything replicated; or, for each leading dim d, the
    row tensors and every output Shard(d), the weight Replicate, the weight's grad output (if any)
    Partial. None for non-tensor and absent (None) args."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    ndim = args[0].ndim

    def inputs(row, weight):
        return [None if (i >= row_inputs or a is None) else weight if i == weight_at else row
                for i, a in enumerate(args)]
    out = [([Replicate()] * row_outputs, inputs(Replicate(), Replicate()))]
    for d in range(ndim - 1):
        outs = [Shard(d)] * row_outputs
        if weight_grad_out is not None:
            outs[weight_grad_out] = Partial()
        out.append((outs, inputs(Shard(d), Replicate())))
    return out


def register() -> None:
    """The ops' sharding rules, once (run when torch.distributed.tensor is imported, or at once if it is)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.cutile_norms

    @register_sharding(ops.rms_norm_fwd.default)
    def _fwd_rule(*args):  # (x, weight, eps, offset, mode, store_rstd) -> (y, rstd)
        return _row_shardings(args, 2, 2, 1)

    @register_sharding(ops.rms_norm_bwd.default)
    def _bwd_rule(*args):  # (dy, x, weight, rstd, offset, mode, need_dx, need_dw) -> (dx, dw)
        need_dx, need_dw = args[6], args[7] and args[2] is not None
        rules = _row_shardings(args, 4, 2, 2, weight_grad_out=1 if need_dw else None)
        if not need_dx:  # dx is then an empty 1-D tensor: replicated
            rules = [([Replicate()] + outs[1:], ins) for outs, ins in rules]
        if not need_dw:
            rules = [(outs[:1] + [Replicate()], ins) for outs, ins in rules]
        return rules

    @register_sharding(ops.add_rms_norm_fwd.default)
    def _add_fwd_rule(*args):  # (x, residual, weight, eps, offset, mode, h_dtype, store_rstd) -> (y, h, rstd)
        return _row_shardings(args, 3, 3, 2)

    @register_sharding(ops.add_rms_norm_bwd.default)
    def _add_bwd_rule(*args):  # (dy, dh, h, weight, rstd, offset, mode, need_dw) -> (grad into h, dw)
        need_dw = args[7] and args[3] is not None
        rules = _row_shardings(args, 5, 2, 3, weight_grad_out=1 if need_dw else None)
        if not need_dw:
            rules = [(outs[:1] + [Replicate()], ins) for outs, ins in rules]
        return rules

    @register_sharding(ops.add_rms_norm_.default)
    def _add_in_place_rule(*args):  # (x, residual, weight, eps, offset, mode) -> ()
        return _row_shardings(args, 3, 0, 2)

    @register_sharding(ops.rms_norm_fp8.default)
    def _fp8_rule(*args):  # (x, residual, weight, eps, offset, mode, out_dtype, h_dtype, scale, ...) -> (q, s, h)
        given_scale, has_residual = args[8] is not None, args[1] is not None
        rules = []
        for outs, ins in _row_shardings(args, 3, 3, 2):
            if given_scale:  # a per-tensor scale in (replicated); out an empty 1-D tensor (rms_norm_fp8 returns the
                # given scale itself)
                outs[1] = Replicate()
                ins[8] = Replicate()
            if not has_residual:  # h is then an empty 1-D tensor
                outs[2] = Replicate()
            rules.append((outs, ins))
        return rules


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs `register` right after torch.distributed.tensor is first imported, so the rules exist before
    any DTensor reaches an op (eager or compiled) without cutile_norms importing DTensor itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.distributed.tensor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                _register_or_warn()
            spec.loader.exec_module = exec_then_register
        return spec


def _register_or_warn() -> None:
    """`register`, never failing the import it runs in: without the rules DTensor calls raise instead."""
    try:
        register()
    except Exception as exc:  # noqa: BLE001 -- a torch without register_sharding (< 2.5), or a changed API
        warnings.warn(f"cutile_norms: the DTensor sharding rules could not be registered ({type(exc).__name__}: "
                      f"{exc}); DTensor inputs will raise", stacklevel=2)


def install() -> None:
    if "torch.distributed.tensor" in sys.modules:
        _register_or_warn()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
