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

and whose post_attention_layernorm is a `cutile_norms.RMSNorm` (patch swapped it). The layer then gets
an instance-level forward doing the same with the middle add fused (the last add stays: the next
layer's first norm is in another module). Where the attention output and the residual stream differ in
dtype at run time, it runs the original statements (the fused op's h takes x's dtype, torch's add
promotes). Gemma 3's layers (four norms, the add after a norm) and other shapes are not fused.

Exactness: h is the same fp32 sum rounded once that torch's add gives; y is the norm of that h. With
the fused kernel opted in (cutile_norms.experimental), y comes from that kernel instead of the norm
kernel `mode=None` picks: the same math, rounded once, so 16-bit y may differ in the last bit.
"""
from __future__ import annotations

import ast
import inspect
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


def _pre_norm_parameters(cls) -> tuple[list[str], dict] | None:
    """(the forward's parameters after hidden_states, their defaults) where cls.forward is the
    template above, else None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
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
    others = params[2:]
    call = ("self.self_attn(hidden_states=hidden_states, " + "".join(f"{p}={p}, " for p in others)
            + f"**{fn.args.kwarg.arg})")
    if ast.unparse(body[2]) not in (f"hidden_states, _ = {call}", f"hidden_states = {call}"):
        return None
    signature = inspect.signature(cls.forward)
    defaults = {p: signature.parameters[p].default for p in others
                if signature.parameters[p].default is not inspect.Parameter.empty}
    return others, defaults


def _fused_forward(layer, others: list[str], defaults: dict):
    def forward(hidden_states, *args, **kwargs):
        if len(args) > len(others):
            raise TypeError(f"forward() takes {len(others) + 1} positional arguments but {len(args) + 1} were given")
        call = {**defaults, **dict(zip(others, args)), **kwargs}
        attn = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **call)
        attn = attn[0] if isinstance(attn, tuple) else attn
        if attn.dtype != hidden_states.dtype or attn.shape != hidden_states.shape:
            h = hidden_states + attn  # the original statements
            y = layer.post_attention_layernorm(h)
        else:
            y, h = layer.post_attention_layernorm(attn, residual=hidden_states)
        return h + layer.mlp(y)
    return forward


def fuse_residual_adds(model: torch.nn.Module) -> list[tuple[str, str]]:
    """Give every recognised decoder layer of `model` the fused forward; [(name, class name)] of those."""
    fused = []
    for name, layer in model.named_modules():
        if "forward" in vars(layer) or not isinstance(getattr(layer, "post_attention_layernorm", None), RMSNorm):
            continue
        found = _pre_norm_parameters(type(layer))
        if found is None:
            continue
        layer.forward = _fused_forward(layer, *found)
        fused.append((name, type(layer).__name__))
    return fused
