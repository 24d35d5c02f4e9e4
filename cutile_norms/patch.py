"""`patch(model)`: swap every RMSNorm-like submodule of a model for `cutile_norms.RMSNorm`, in place.

    replaced = cutile_norms.patch(model)          # [("model.layers.0.input_layernorm", "LlamaRMSNorm"), ...]

Contract:
  * Modules are recognised by structure; nothing here imports transformers. Three kinds are replaced:
      - `torch.nn.RMSNorm` (or a subclass that keeps its forward): normalized_shape, eps and
        elementwise_affine carry over (eps=None stays None: torch's rms_norm then uses
        finfo(torch.float32).eps for every dtype, and so does cutile_norms).
      - Hugging Face-style norms (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm incl. q_norm/k_norm,
        GemmaRMSNorm, Gemma3RMSNorm, ...): the class name ends in "RMSNorm" (any case), the module's only
        parameter is a 1-D `weight` Parameter, it has no buffers and no children, it holds a real eps in
        `variance_epsilon` (Llama/Mistral/Qwen) or `eps` (Gemma), and forward takes one input.
      - What such a module computes is checked by running its own forward once, at patch time, on a probe
        (random fp32 rows [2, 3, N] on the weight's device, the CPU for a meta weight, one row at an rms of
        sqrt(eps) and one off a zero mean, and a random weight around 0 in place of its own): its output
        must be x * rsqrt(mean(x^2) + eps) * w (offset=0.0) or Gemma's x * rsqrt(mean(x^2) + eps) * (1 + w)
        (offset=1.0), to 1e-4 of the output's scale (fp32 forwards agree to ~1e-6). A forward that
        computes anything else (a scale chosen by an attribute, another dim, another eps, a mean
        subtracted, the weight applied before the norm, a 16-bit computation), or fails on the probe, is
        unrecognised: the class name and structure alone never decide.
  * Any other module whose class name ends in "RMSNorm"/"RmsNorm", and any torch.nn.RMSNorm subclass that
    overrides forward, is unrecognised: strict=True (default) raises ValueError naming it and what was
    expected; strict=False skips it (it is not in the returned list). A module carrying forward hooks or an
    instance-level forward (e.g. accelerate's offload hooks) is unrecognised too: swapping it would drop them.
  * Existing `cutile_norms.RMSNorm` modules are left alone. The root module itself cannot be swapped in place:
    an RMSNorm-like root raises ValueError (wrap it in a container, or build cutile_norms.RMSNorm directly).
  * Weights are kept, not copied: the replacement holds the original Parameter object (same device, dtype,
    requires_grad), so optimizer state, tied references and state_dict keys are unchanged. The replacement's
    training flag matches the original's.
  * All-or-nothing: every module is classified and every replacement built before the model is touched, so a
    raise leaves the model as it was.
  * Returns [(qualified module name, original class name)], one entry per place a module was swapped in (a
    module shared under two names is swapped for one replacement, listed under both names).
  * fuse_residual=True (opt in): a decoder layer whose forward is Hugging Face's pre-norm block (Llama,
    Mistral, Qwen2/3, Gemma) runs its attention residual add fused into the norm after it; the layer
    keeps its parameters and moves to a subclass of its class (same name) whose forward is its own
    source with the add fused (cutile_norms/fuse_residual.py says what is recognised and what is not).
    Listed as (layer name, class name + " (residual add fused)").

Numerics: cutile_norms.RMSNorm computes x * rsqrt(mean(x^2) + eps) * (offset + w) in fp32 and rounds once to
x's dtype. HF's Llama-style norm rounds the normalized x to the input dtype before multiplying by the weight
(two roundings), so 16-bit outputs may differ from the original in the last bit; fp32 results agree to fp32
rounding. HF's Llama-style norm also returns fp32 when the weight is fp32 and x is 16-bit; the replacement
returns x's dtype. A weight must be in x's dtype or fp32 at call time (see `rms_norm`).
"""
from __future__ import annotations

import copy
import inspect
import math
import numbers

import torch

from ._platform import is_fake, real_tensors
from .dispatch import check_mode_name
from .fuse_residual import fuse_residual_adds
from .rmsnorm import RMSNorm

_HF_EPS_ATTRIBUTES = ("variance_epsilon", "eps")
_TORCH_RMSNORM = getattr(torch.nn, "RMSNorm", None)  # torch >= 2.4


class _Unrecognised(Exception):
    """Why an RMSNorm-named module does not fit a known pattern (turned into the ValueError message)."""


def patch(model: torch.nn.Module, *, mode: str | None = None, strict: bool = True,
          fuse_residual: bool = False) -> list[tuple[str, str]]:
    """Replace every RMSNorm-like submodule of `model` with `cutile_norms.RMSNorm(mode=mode)`, in place,
    keeping the weight Parameter objects. Returns [(qualified name, original class name)] of what was
    replaced. strict=False skips RMSNorm-named modules of an unknown shape instead of raising.
    fuse_residual=True (opt in): recognised pre-norm decoder layers also run their attention residual
    add fused into the norm after it (cutile_norms/fuse_residual.py), each listed as (name, class name
    + " (residual add fused)"). See the module docstring for the recognition rules."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_mode_name(mode)  # even when there is nothing to patch

    # Phase 1: classify everything and build every replacement; nothing in the model changes yet.
    replacement_for: dict[int, torch.nn.Module] = {}  # id(original) -> its replacement (shared modules: one)
    swaps: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, RMSNorm):
            continue
        try:
            spec = _recognise(module)
        except _Unrecognised as why:
            if strict:
                raise ValueError(f"cannot patch {_describe(name, module)}: {why} "
                                 f"(pass strict=False to skip modules like this one)") from None
            continue
        if spec is None:
            continue
        if name == "":
            raise ValueError(f"the model itself is an RMSNorm ({type(module).__name__}); patch() swaps submodules "
                             f"in their parent, so wrap it in a container or use cutile_norms.RMSNorm directly")
        if id(module) not in replacement_for:
            replacement_for[id(module)] = _build(module, mode=mode, **spec)
        swaps.append((name, module, replacement_for[id(module)]))

    # Phase 2: swap them in.
    for name, original, replacement in swaps:
        parent_name, _, child_name = name.rpartition(".")
        # setattr on the parent routes a Module value into its _modules, which is also how ModuleList,
        # Sequential and ModuleDict hold their children (under "0", "1", ... or their keys).
        setattr(model.get_submodule(parent_name), child_name, replacement)
    replaced = [(name, type(original).__name__) for name, original, _ in swaps]
    if fuse_residual:
        replaced += [(name, f"{cls} (residual add fused)") for name, cls in fuse_residual_adds(model)]
    return replaced


def _recognise(module: torch.nn.Module) -> dict | None:
    """The replacement's constructor arguments, None for a module that is not an RMSNorm at all, or
    _Unrecognised for an RMSNorm-named module (or torch.nn.RMSNorm subclass) that fits no known pattern."""
    cls = type(module)
    is_torch_rmsnorm = _TORCH_RMSNORM is not None and isinstance(module, _TORCH_RMSNORM)
    if not is_torch_rmsnorm and not cls.__name__.lower().endswith("rmsnorm"):
        return None
    _refuse_if_hooked(module)
    if is_torch_rmsnorm:
        if cls.forward is not _TORCH_RMSNORM.forward:
            raise _Unrecognised("a torch.nn.RMSNorm subclass that overrides forward; expected torch.nn.RMSNorm's own")
        return {"normalized_shape": tuple(module.normalized_shape), "eps": module.eps,
                "elementwise_affine": module.weight is not None, "offset": 0.0}
    return _recognise_hf_style(module)


def _refuse_if_hooked(module: torch.nn.Module) -> None:
    # A swapped-in module would not carry these, so the model would silently behave differently.
    if "forward" in vars(module):
        raise _Unrecognised("its forward is overridden on the instance (e.g. by accelerate hooks), "
                            "which the replacement would drop")
    hooks = [kind for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
             if getattr(module, kind, None)]
    if hooks:
        raise _Unrecognised(f"it has {', '.join(hooks)} registered, which the replacement would drop")


def _recognise_hf_style(module: torch.nn.Module) -> dict:
    expected = ("expected a Hugging Face-style RMSNorm: a 1-D `weight` Parameter as its only parameter, no "
                "buffers or submodules, a real eps in `variance_epsilon` or `eps`, and forward(hidden_states)")
    params = dict(module.named_parameters())
    weight = params.get("weight")
    if list(params) != ["weight"] or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        raise _Unrecognised(f"its parameters are {shapes or 'none'}; {expected}")
    buffers = [k for k, _ in module.named_buffers()]
    children = [k for k, _ in module.named_children()]
    if buffers or children:
        raise _Unrecognised(f"it has buffers {buffers} / submodules {children}; {expected}")
    eps_attribute = next((a for a in _HF_EPS_ATTRIBUTES if hasattr(module, a)), None)
    eps = getattr(module, eps_attribute, None) if eps_attribute else None
    if eps is None or isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < eps < math.inf):
        where = f"`{eps_attribute}` is {eps!r}" if eps_attribute else "it has neither `variance_epsilon` nor `eps`"
        raise _Unrecognised(f"{where}; {expected}")
    if not _takes_one_input(type(module).forward):
        raise _Unrecognised(f"forward{_signature(type(module).forward)} takes other inputs; {expected}")
    return {"normalized_shape": (weight.shape[0],), "eps": float(eps), "elementwise_affine": True,
            "offset": _probed_offset(module, weight.shape[0], float(eps))}


def _takes_one_input(forward) -> bool:
    """forward(self, x): at most one required input, and room for it positionally. A generic wrapper's
    (self, *args, **kwargs) passes, so a decorated forward is not refused on its signature alone."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # drop self
    except (TypeError, ValueError):
        return True  # no signature to read (a C-level forward): do not refuse on that alone
    kind = inspect.Parameter
    required = [p for p in params if p.default is kind.empty and p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD)]
    if required:
        return len(required) == 1 and required[0].kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
    return any(p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD, kind.VAR_POSITIONAL) for p in params)


def _signature(forward) -> str:
    try:
        return str(inspect.signature(forward))
    except (TypeError, ValueError):
        return "(...)"


def _probed_offset(module: torch.nn.Module, N: int, eps: float) -> float:
    """0.0 or 1.0: the offset with which cutile_norms.RMSNorm computes what `module`'s own forward does on a
    probe (the module docstring says which), else _Unrecognised. The probe's rows are random, one at an
    rms of sqrt(eps) (where eps is half the sum: a forward's own eps shows) and one off a zero mean (a
    mean subtracted shows); its weight is random, held by a shallow copy of the module in place of the
    module's own, whose class forward is called (no hooks run), so the module and the RNG are left as
    they are. fp32 throughout: the forms agree to 1e-4 of the output's scale, and differ by far more."""
    with real_tensors():  # (inside a FakeTensorMode too: the probe's values are compared)
        return _probe(module, N, eps, torch.device("cpu") if module.weight.device.type == "meta"
                      or is_fake(module.weight) else module.weight.device)


def _probe(module: torch.nn.Module, N: int, eps: float, dev: torch.device) -> float:
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, 3, N, generator=gen, device="cpu")
        x[0, 1] *= math.sqrt(eps)
        x[1, 0] += 3.0
        w = 0.5 * torch.randn(N, generator=gen, device="cpu")
        x, w = x.to(dev), w.to(dev)
        probe = copy.copy(module)
        probe.__dict__["_parameters"] = {"weight": torch.nn.Parameter(w, requires_grad=False)}
        with torch.no_grad():
            y = type(module).forward(probe, x)
    except Exception as e:  # noqa: BLE001 (any failure: the module is not one this check can vouch for)
        raise _Unrecognised(f"its forward failed on a probe input of fp32 rows [2, 3, {N}] on {dev} "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise _Unrecognised(f"its forward on fp32 rows [2, 3, {N}] returned "
                            f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    x64 = x.double()
    xhat = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    for offset in (0.0, 1.0):
        expected = xhat * (offset + w.double())
        if ((y.double() - expected).abs() <= 1e-4 * (expected.abs() + expected.abs().mean())).all():
            return offset
    raise _Unrecognised("its forward on a probe input computes neither x * rsqrt(mean(x^2) + eps) * w nor "
                        "x * rsqrt(mean(x^2) + eps) * (1 + w) over the last dim (eps its own)")


def _build(original: torch.nn.Module, *, normalized_shape, eps, elementwise_affine, offset, mode) -> RMSNorm:
    # Built on the meta device (no allocation, no init work), then handed the original Parameter itself.
    replacement = RMSNorm(normalized_shape, eps, elementwise_affine, mode=mode, offset=offset, device="meta")
    if elementwise_affine:
        replacement.weight = original.weight
    replacement.train(original.training)
    return replacement


def _describe(name: str, module: torch.nn.Module) -> str:
    return f"{name or '<the model itself>'} ({type(module).__name__})"
