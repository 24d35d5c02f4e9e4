"""`patch(model, fuse_residual=True)`: route a recognised pre-norm decoder layer's attention residual
add and the norm after it through the fused op (`RMSNorm.forward(x, residual)`, rms_norm with
`residual=`), so that h = residual + attention(...) is written once and normalized in the same kernel.

Recognised: a layer whose class's forward is, statement for statement, the pre-norm block Hugging
Face's Llama, Mistral, Qwen2/3 and Gemma (1) decoder layers share (checked on the source's syntax tree,
so a class that adds, drops or reorders anything is left alone):

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, <each other parameter by name>, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states

and whose post_attention_layernorm is a `cutile_norms.RMSNorm` (patch swapped it). The layer moves
to a subclass (`fused_class`) whose forward is that same source with the middle three statements
replaced by one call of the fused op, compiled in the class's own module with its own decorators
(transformers' keyword deprecations, and the gradient checkpointing its GradientCheckpointingLayer
puts around every subclass's forward), so it takes the same arguments and passes them on unchanged.
The last add stays: the norm after it is the next layer's. Where the attention output and the
residual stream differ in dtype at run time, it runs the original statements (the fused op's h takes
x's dtype, torch's add promotes). Gemma 3's layers (four norms, the add after a norm) and other shapes
are not fused. `copy.deepcopy` keeps the fusion; `torch.save(model)` pickles the subclass by reference
to this module (a process that patched the same class loads it; state_dict is unchanged).

Exactness: h is the same fp32 sum rounded once that torch's add gives; y is the norm of that h. Where
the fused kernel runs (dispatch.residual_add_kernel), y comes from that kernel instead of the norm
kernel `mode=None` picks: the same math, rounded once, so 16-bit y may differ in the last bit.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap

import torch

from .rmsnorm import RMSNorm

_TEMPLATE = [
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,  # the attention call, checked on its own
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
]


def _fusable_tree(cls) -> ast.Module | None:
    """The syntax tree of cls.forward's source (its decorators included) where its body is the template
    above, else None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # no source: a class built at run time, or one fused already
        return None
    fn = tree.body[0] if len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef) else None
    if fn is None:
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    params = [a.arg for a in fn.args.args]
    if (len(body) != len(_TEMPLATE) or params[:2] != ["self", "hidden_states"] or fn.args.vararg
            or fn.args.kwonlyargs or fn.args.kwarg is None):
        return None
    for statement, expected in zip(body, _TEMPLATE):
        if expected is not None and ast.unparse(statement) != expected:
            return None
    call = ("self.self_attn(hidden_states=hidden_states, " + "".join(f"{p}={p}, " for p in params[2:])
            + f"**{fn.args.kwarg.arg})")
    if ast.unparse(body[2]) not in (f"hidden_states, _ = {call}", f"hidden_states = {call}"):
        return None
    # statements 4-6 (the add, `residual = hidden_states`, the norm) become one call of the fused op
    fused = ast.parse(f"hidden_states, residual = {_HELPER}(self.post_attention_layernorm, hidden_states, "
                      f"residual)").body[0]
    fn.body = body[:3] + [fused] + body[6:]
    return ast.fix_missing_locations(tree)


def add_norm(norm, attn: torch.Tensor, residual: torch.Tensor):
    """(y, h) of the fused op: h = residual + attn, y = norm(h); the unfused statements where the two
    differ in dtype or shape (torch's add promotes; the fused op's h takes attn's dtype)."""
    if isinstance(norm, RMSNorm) and attn.dtype == residual.dtype and attn.shape == residual.shape:
        return norm(attn, residual=residual)
    h = residual + attn
    return norm(h), h


_HELPER = "_cutile_norms_add_norm"
_cutile_norms_add_norm = add_norm  # the name the fused forwards call it by
_FUSED: dict = {}  # original class -> its fused subclass (or None: not fusable)


def fused_class(cls):
    """A subclass of cls whose forward is cls's own source with the middle add fused, compiled in cls's
    module namespace so its decorators apply again (transformers' `deprecate_kwarg`; its
    GradientCheckpointingLayer wraps the new forward as it wraps every subclass's). Same __name__ (model
    code and device maps match layers by class name); pickled by reference to this module. None where
    cls.forward is not the template."""
    if cls not in _FUSED:
        tree = _fusable_tree(cls)
        raw = inspect.unwrap(cls.forward)
        if tree is None or getattr(raw, "__module__", None) not in sys.modules:
            _FUSED[cls] = None
        else:
            # the class's module's names (its decorators), under this module's name: the new forward's
            # only global, the helper, is found here by name (torch.compile looks globals up by module)
            namespace = dict(vars(sys.modules[raw.__module__]), __name__=__name__, **{_HELPER: add_norm})
            exec(compile(tree, f"<cutile_norms: {cls.__qualname__}.forward, residual add fused>", "exec"), namespace)
            qualname = "Fused_" + f"{cls.__module__}.{cls.__qualname__}".replace(".", "_")
            fused = type(cls.__name__, (cls,), {"forward": namespace[raw.__name__], "__module__": __name__,
                                                "__qualname__": qualname})
            globals()[qualname] = fused
            _FUSED[cls] = fused
    return _FUSED[cls]


def fuse_residual_adds(model: torch.nn.Module) -> list[tuple[str, str]]:
    """Move every recognised decoder layer of `model` to its fused class; [(name, class name)] of those.
    A layer is left alone where its forward is overridden on the instance, its post-attention norm is
    not a `cutile_norms.RMSNorm`, or that norm carries hooks (they would see the fused call's input and
    (y, h) output instead of h and y)."""
    fused = []
    for name, layer in model.named_modules():
        norm = getattr(layer, "post_attention_layernorm", None)
        if ("forward" in vars(layer) or not isinstance(norm, RMSNorm) or norm._forward_hooks
                or norm._forward_pre_hooks):
            continue
        cls = fused_class(type(layer))
        if cls is None:
            continue
        layer.__class__ = cls
        fused.append((name, type(layer).__name__))
    return fused
