"""cutile_norms.patch on the CPU (mode=None runs the fp32 torch reference here).

Local classes written from Hugging Face's descriptions (Llama/Qwen-style: fp32 math, cast to the input dtype,
then times the weight; Gemma: zero-initialised weight, fp32 math times (1 + w)) and torch.nn.RMSNorm, in toy
models shaped like Llama, Qwen3 (q_norm/k_norm on head_dim) and Gemma. Each check patches a deep copy and
compares outputs, the input's grad and every parameter's grad against the unpatched model, with fresh random
inputs and random non-trivial weights. When transformers is installed, tiny randomly initialised
LlamaForCausalLM / Qwen3ForCausalLM / GemmaForCausalLM get the same check (no download).
"""
from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch

import cutile_norms as cn
from tests.conftest import SAME_MATH_FP32, SAME_MATH_FP32_GRAD

FP32_OUT, FP32_GRAD = SAME_MATH_FP32, SAME_MATH_FP32_GRAD  # tests/conftest.py says why


# ================================================================================================
# Local mirrors of the Hugging Face norms
# ================================================================================================
class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Qwen3RMSNorm(LlamaRMSNorm):
    pass


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class FooRMSNorm(torch.nn.Module):
    """RMSNorm-named but with a bias: fits no known pattern."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.bias = torch.nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


# ================================================================================================
# Toy decoder models: embedding -> blocks (norm, attention, residual, norm, MLP, residual) -> norm -> lm head
# ================================================================================================
class Attention(torch.nn.Module):
    def __init__(self, hidden, heads, norm_cls=None):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.v_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        # Qwen3: RMSNorm over head_dim of q and k, before attention
        self.q_norm = norm_cls(self.head_dim) if norm_cls else None
        self.k_norm = norm_cls(self.head_dim) if norm_cls else None

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, norm_cls, head_norm_cls=None):
        super().__init__()
        self.input_layernorm = norm_cls(hidden)
        self.self_attn = Attention(hidden, heads, head_norm_cls)
        self.post_attention_layernorm = norm_cls(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.SiLU(),
                                       torch.nn.Linear(2 * hidden, hidden))

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class ToyDecoder(torch.nn.Module):
    def __init__(self, norm_cls, head_norm_cls=None, hidden=64, heads=4, layers=2, vocab=128):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden, heads, norm_cls, head_norm_cls) for _ in range(layers))
        self.norm = norm_cls(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids=None, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def llama_toy():
    return ToyDecoder(LlamaRMSNorm)


def qwen3_toy():
    return ToyDecoder(Qwen3RMSNorm, head_norm_cls=Qwen3RMSNorm)


def gemma_toy():
    return ToyDecoder(GemmaRMSNorm)


def torch_toy(eps=None):
    return ToyDecoder(lambda n: torch.nn.RMSNorm(n, eps=eps), head_norm_cls=lambda n: torch.nn.RMSNorm(n, eps=eps))


def randomise_norm_weights(model):
    """Non-trivial weights: around 1 for Llama-style, around 0 for Gemma's zero-centred (1 + w)."""
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(module).__name__.lower().endswith("rmsnorm") and weight is not None:
                if "gemma" in type(module).__name__.lower():
                    weight.copy_(0.1 * torch.randn_like(weight))
                else:
                    weight.copy_(1.0 + 0.5 * torch.randn_like(weight))
    return model


def norm_names(model):
    return sorted(name for name, m in model.named_modules() if type(m).__name__.lower().endswith("rmsnorm"))


# ================================================================================================
# Comparison
# ================================================================================================
def assert_same_outputs_and_grads(reference, patched, make_input, what, call=lambda model, x: model(x)):
    """Same output, input grad and every parameter grad (by name) from one fresh random input."""
    x = make_input()
    x_ref = x.detach().clone().requires_grad_(True)
    x_new = x.detach().clone().requires_grad_(True)
    y_ref, y_new = call(reference, x_ref), call(patched, x_new)
    assert torch.isfinite(y_ref).all() and torch.isfinite(y_new).all(), f"{what}: non-finite output"
    torch.testing.assert_close(y_new, y_ref, **FP32_OUT, msg=lambda m: f"{what} output: {m}")
    # a random upstream grad, so every output element matters to the backward
    dy = torch.randn_like(y_ref)
    (y_ref * dy).sum().backward()
    (y_new * dy).sum().backward()
    assert torch.isfinite(x_new.grad).all(), f"{what}: non-finite input grad"
    torch.testing.assert_close(x_new.grad, x_ref.grad, **FP32_GRAD, msg=lambda m: f"{what} input grad: {m}")
    ref_params, new_params = dict(reference.named_parameters()), dict(patched.named_parameters())
    assert ref_params.keys() == new_params.keys()
    for name, p_ref in ref_params.items():
        g_ref, g_new = p_ref.grad, new_params[name].grad
        assert (g_ref is None) == (g_new is None), f"{what}: grad of {name} present on one side only"
        if g_ref is not None:
            assert torch.isfinite(g_new).all(), f"{what}: non-finite grad of {name}"
            torch.testing.assert_close(g_new, g_ref, **FP32_GRAD, msg=lambda m, n=name: f"{what} grad {n}: {m}")


def patch_copy(model, **kwargs):
    """(deep copy patched, what patch returned); asserts the structural contract on the way."""
    patched = copy.deepcopy(model)
    params_before = dict(patched.named_parameters())
    keys_before = list(patched.state_dict())
    replaced = cn.patch(patched, **kwargs)
    assert list(patched.state_dict()) == keys_before
    for name, p in patched.named_parameters():
        assert p is params_before[name], f"{name} is a new Parameter object"
    for name, cls in replaced:
        if not cls.endswith("(residual add fused)"):
            assert isinstance(patched.get_submodule(name), cn.RMSNorm)
    return patched, replaced


# ================================================================================================
# Single modules
# ================================================================================================
@pytest.mark.parametrize("norm_cls, offset", [(LlamaRMSNorm, 0.0), (Qwen3RMSNorm, 0.0), (GemmaRMSNorm, 1.0)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.1])
def test_hf_style_norm_matches(seed, norm_cls, offset, eps):
    hidden = 96
    model = randomise_norm_weights(torch.nn.Sequential(norm_cls(hidden, eps=eps)))
    patched, replaced = patch_copy(model)
    assert replaced == [("0", norm_cls.__name__)]
    new = patched[0]
    assert new.offset == offset and new.eps == eps and new.normalized_shape == (hidden,)
    assert new.weight.device == model[0].weight.device and new.weight.dtype == torch.float32
    assert_same_outputs_and_grads(model, patched, lambda: 3 * torch.randn(4, 7, hidden),
                                  f"{norm_cls.__name__} eps={eps} [seed {seed}]")


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(80,), (6, 16)])
def test_torch_rmsnorm_float_eps_matches(seed, affine, shape):
    model = torch.nn.Sequential(torch.nn.RMSNorm(shape, eps=1e-5, elementwise_affine=affine))
    if affine:
        with torch.no_grad():
            model[0].weight.copy_(1.0 + 0.5 * torch.randn(shape))
    patched, replaced = patch_copy(model)
    assert replaced == [("0", "RMSNorm")]
    assert patched[0].eps == 1e-5 and patched[0].normalized_shape == shape and patched[0].offset == 0.0
    assert (patched[0].weight is None) == (not affine)
    assert_same_outputs_and_grads(model, patched, lambda: torch.randn(5, *shape),
                                  f"nn.RMSNorm{shape} affine={affine} [seed {seed}]")


def test_torch_rmsnorm_eps_none_is_passed_through(seed):
    model = torch.nn.Sequential(torch.nn.RMSNorm(64))  # eps=None: finfo(torch.float32).eps, whatever the dtype
    assert model[0].eps is None
    with torch.no_grad():
        model[0].weight.copy_(1.0 + 0.5 * torch.randn(64))
    patched, replaced = patch_copy(model)
    assert replaced == [("0", "RMSNorm")]
    assert patched[0].eps is None
    # small rows, so eps (finfo(fp32).eps ~ 1.2e-7) is not negligible next to mean(x^2)
    assert_same_outputs_and_grads(model, patched, lambda: 1e-3 * torch.randn(8, 64), f"eps=None [seed {seed}]")


class UnitOffsetRMSNorm(torch.nn.Module):
    """A LitGPT-style norm: the (1 + w) scale chosen by an attribute (its source holds "1 + self.weight"
    either way), over a dim of its own."""

    def __init__(self, size, dim=-1, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size) if add_unit_offset else torch.ones(size))
        self.eps, self.dim, self.add_unit_offset = eps, dim, add_unit_offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x_normed = x * torch.rsqrt(torch.mean(x * x, dim=self.dim, keepdim=True) + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


class ScaledInputRMSNorm(GemmaRMSNorm):
    """The weight applied before the norm: norm(x * (1 + w)), which no offset gives."""

    def forward(self, x):
        return self._norm(x.float() * (1.0 + self.weight.float())).type_as(x)


class SlightlyScaledRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        return 1.015 * super().forward(hidden_states)


class OtherEpsRMSNorm(LlamaRMSNorm):
    """eps hard-coded in forward, not the attribute's."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + 1e-2)


class MeanFreeRMSNorm(LlamaRMSNorm):
    """A layer norm without bias under an RMSNorm name: the mean subtracted first."""

    def forward(self, hidden_states):
        return super().forward(hidden_states - hidden_states.mean(-1, keepdim=True))


class CudaOnlyRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        if not hidden_states.is_cuda:
            raise RuntimeError("this kernel needs a CUDA tensor")
        return super().forward(hidden_states)


@pytest.mark.parametrize("unit", [False, True])
def test_offset_is_what_the_forward_computes(seed, unit):
    """The offset comes from running the module's forward on a probe, not from its source or name: an
    attribute that chooses the scale is followed, and a class built without source is read the same."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), UnitOffsetRMSNorm(64, add_unit_offset=unit))
    with torch.no_grad():
        model[1].weight.copy_(float(not unit) + 0.3 * torch.randn(64))
    rng = torch.get_rng_state()
    patched, replaced = patch_copy(model)
    assert torch.equal(torch.get_rng_state(), rng), "the probe drew from the global RNG"
    assert replaced == [("1", "UnitOffsetRMSNorm")] and patched[1].offset == float(unit)
    assert_same_outputs_and_grads(model, patched, lambda: torch.randn(8, 64), f"unit offset {unit} [seed {seed}]")
    ns = {"torch": torch}  # a class without source (inspect.getsource raises on it)
    exec("class ExecRMSNorm(torch.nn.Module):\n"
         "    def __init__(self, d):\n"
         "        super().__init__()\n"
         "        self.eps, self.weight = 1e-6, torch.nn.Parameter(torch.zeros(d))\n"
         "    def forward(self, x):\n"
         "        xf = x.float()\n"
         "        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)\n"
         "        return (y * (1.0 + self.weight.float())).type_as(x)\n", ns)
    built = torch.nn.Sequential(ns["ExecRMSNorm"](16))
    assert cn.patch(built) == [("0", "ExecRMSNorm")] and built[0].offset == 1.0
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: calls.append(1))
    try:
        with torch.device("meta"):  # the probe's rows are made on the CPU whatever the default device
            assert cn.patch(torch.nn.Sequential(LlamaRMSNorm(16))) == [("0", "LlamaRMSNorm")]
    finally:
        handle.remove()
    assert not calls, "the probe ran global forward hooks"


@pytest.mark.parametrize("module, message", [
    (UnitOffsetRMSNorm(16, dim=0), "computes neither"),
    (ScaledInputRMSNorm(16), "computes neither"),
    (SlightlyScaledRMSNorm(16), "computes neither"),
    (OtherEpsRMSNorm(16), "computes neither"),
    (MeanFreeRMSNorm(16), "computes neither"),
    (CudaOnlyRMSNorm(16), "failed on a probe input.*needs a CUDA tensor"),
])
def test_a_forward_computing_something_else_is_refused(module, message):
    with pytest.raises(ValueError, match=message):
        cn.patch(torch.nn.Sequential(module))
    assert cn.patch(torch.nn.Sequential(module), strict=False) == []


# ================================================================================================
# Toy models
# ================================================================================================
@pytest.mark.parametrize("build, norms", [(llama_toy, 2 * 2 + 1), (qwen3_toy, 2 * 4 + 1), (gemma_toy, 2 * 2 + 1),
                                           (lambda: torch_toy(1e-6), 2 * 4 + 1), (torch_toy, 2 * 4 + 1)],
                         ids=["llama", "qwen3", "gemma", "torch_nn", "torch_nn_eps_none"])
def test_toy_model_matches(seed, build, norms):
    model = randomise_norm_weights(build())
    expected_names = norm_names(model)
    assert len(expected_names) == norms
    patched, replaced = patch_copy(model)
    assert sorted(name for name, _ in replaced) == expected_names
    assert all(type(patched.get_submodule(n)) is cn.RMSNorm for n in expected_names)
    assert_same_outputs_and_grads(model, patched, lambda: torch.randn(2, 9, 64), f"toy {norms} norms [seed {seed}]",
                                  call=lambda m, embeds: m(inputs_embeds=embeds))
    ids = torch.randint(0, 128, (2, 9))  # the token path too
    with torch.no_grad():
        torch.testing.assert_close(patched(ids), model(ids), **FP32_OUT)


def test_optimizer_state_and_tied_weights_survive(seed):
    model = randomise_norm_weights(llama_toy())
    model.layers[1].input_layernorm.weight = model.layers[0].input_layernorm.weight  # tied
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 5))).square().mean().backward()
    optimizer.step()
    tied = model.layers[0].input_layernorm.weight
    cn.patch(model)
    assert model.layers[0].input_layernorm.weight is tied and model.layers[1].input_layernorm.weight is tied
    assert tied in optimizer.state
    assert all(p in optimizer.state for p in model.parameters())


def test_shared_module_swapped_everywhere():
    shared = LlamaRMSNorm(32)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(torch.nn.Linear(32, 32), shared)})
    replaced = cn.patch(model)
    assert sorted(replaced) == [("a", "LlamaRMSNorm"), ("b.1", "LlamaRMSNorm")]
    assert model["a"] is model["b"][1] and isinstance(model["a"], cn.RMSNorm)
    assert model["a"].weight is shared.weight


def test_mode_training_flag_and_requires_grad_carry_over():
    model = torch.nn.Sequential(LlamaRMSNorm(16), torch.nn.RMSNorm(16, eps=1e-6))
    model.eval()
    model[0].weight.requires_grad_(False)
    cn.patch(model, mode="torch")
    assert all(isinstance(m, cn.RMSNorm) and m.mode == "torch" and not m.training for m in model)
    assert model[0].weight.requires_grad is False and model[1].weight.requires_grad is True


def test_already_patched_and_nothing_to_patch():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), cn.RMSNorm(8))
    kept = model[2]
    assert cn.patch(model) == []
    assert model[2] is kept
    patched = llama_toy()
    assert len(cn.patch(patched)) == 5
    assert cn.patch(patched) == []  # idempotent


# ================================================================================================
# Refusals
# ================================================================================================
def test_unrecognised_rmsnorm_raises_with_strict_and_is_skipped_without():
    model = torch.nn.Sequential(LlamaRMSNorm(16), torch.nn.Sequential(FooRMSNorm(16)))
    before = model[0]
    with pytest.raises(ValueError, match=r"1\.0 \(FooRMSNorm\).*expected a Hugging Face-style RMSNorm"):
        cn.patch(model)
    assert model[0] is before  # all-or-nothing: the raise left the model untouched
    replaced = cn.patch(model, strict=False)
    assert replaced == [("0", "LlamaRMSNorm")]
    assert type(model[1][0]) is FooRMSNorm


class NoEpsRMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.weight


class GatedRmsNorm(LlamaRMSNorm):
    def forward(self, hidden_states, gate):
        return super().forward(hidden_states) * gate


class WrappedForwardRMSNorm(LlamaRMSNorm):
    """A forward behind a generic (*args, **kwargs) wrapper, as hub-kernel decorators may leave it."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_generic_wrapper_forward_is_accepted():
    model = torch.nn.Sequential(WrappedForwardRMSNorm(8))
    assert cn.patch(model) == [("0", "WrappedForwardRMSNorm")]


class MatrixWeightRMSNorm(LlamaRMSNorm):
    def __init__(self, dim):
        super().__init__(dim)
        self.weight = torch.nn.Parameter(torch.ones(dim, dim))


class OverriddenTorchNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("module, message", [
    (NoEpsRMSNorm(8), "neither `variance_epsilon` nor `eps`"),
    (GatedRmsNorm(8), "takes other inputs"),
    (MatrixWeightRMSNorm(8), r"parameters are \{'weight': \(8, 8\)\}"),
    (OverriddenTorchNorm(8), "overrides forward"),
])
def test_each_unfitting_shape_is_named(module, message):
    with pytest.raises(ValueError, match=message):
        cn.patch(torch.nn.Sequential(module))
    assert cn.patch(torch.nn.Sequential(module), strict=False) == []


def test_hooked_module_is_refused():
    model = torch.nn.Sequential(LlamaRMSNorm(8))
    model[0].register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="_forward_hooks"):
        cn.patch(model)


def test_root_module_is_refused():
    with pytest.raises(ValueError, match="wrap it in a container or use cutile_norms.RMSNorm"):
        cn.patch(LlamaRMSNorm(8))
    with pytest.raises(ValueError, match="wrap it"):
        cn.patch(torch.nn.RMSNorm(8))
    assert cn.patch(cn.RMSNorm(8)) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode"):
        cn.patch(torch.nn.Linear(2, 2), mode="nope")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cn.patch(object())


# ================================================================================================
# Hugging Face models (only when transformers is installed; nothing is downloaded)
# ================================================================================================
def _tiny_hf_model(family):
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "attn_implementation": "eager"}
    if family == "llama":
        config, model_cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "qwen3":
        config, model_cls = transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(head_dim=16, sliding_window=16, **common)
        model_cls = transformers.Gemma3ForCausalLM
    else:
        config, model_cls = transformers.GemmaConfig(head_dim=16, **common), transformers.GemmaForCausalLM
    return model_cls(config).float().eval()


@pytest.mark.parametrize("family, norms", [("llama", 2 * 2 + 1), ("qwen3", 2 * 4 + 1), ("gemma", 2 * 2 + 1),
                                           ("gemma3", 2 * 6 + 1)])
def test_hf_model_matches(seed, family, norms):
    model = randomise_norm_weights(_tiny_hf_model(family))
    patched, replaced = patch_copy(model)
    assert len(replaced) == norms and sorted(n for n, _ in replaced) == norm_names(model)
    if family.startswith("gemma"):
        assert all(patched.get_submodule(n).offset == 1.0 for n, _ in replaced)
    else:
        assert all(patched.get_submodule(n).offset == 0.0 for n, _ in replaced)

    assert_same_outputs_and_grads(model, patched, lambda: torch.randn(2, 9, 64), f"{family} [seed {seed}]",
                                  call=lambda m, embeds: m(inputs_embeds=embeds).logits)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, **FP32_OUT)


@pytest.fixture
def add_calls(monkeypatch):
    """How many times the fused residual add op ran (cutile_norms.residual.add_rms_norm, counted)."""
    from cutile_norms import residual

    calls = []
    real = residual.add_rms_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(residual, "add_rms_norm", counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_hf_fuse_residual_matches_and_runs_the_fused_op(seed, family, add_calls):
    """patch(fuse_residual=True) against the unpatched model: the same outputs and grads, every decoder
    layer listed as fused, the fused op run once per layer per forward."""
    model = randomise_norm_weights(_tiny_hf_model(family))
    patched, replaced = patch_copy(model, fuse_residual=True)
    fused = [n for n, cls in replaced if cls.endswith("(residual add fused)")]
    assert fused == [f"model.layers.{i}" for i in range(2)], replaced
    assert_same_outputs_and_grads(model, patched, lambda: torch.randn(2, 9, 64), f"{family} fused [seed {seed}]",
                                  call=lambda m, embeds: m(inputs_embeds=embeds).logits)
    assert len(add_calls) == 2  # one forward of two layers (the reference model never calls it)


def test_hf_fuse_residual_keeps_checkpointing_copies_and_the_cache(seed, add_calls):
    """The fused layers stay what the model expects: gradient checkpointing still wraps them (the
    same number of checkpointed calls, the same grads), a deep copy runs its own weights, torch.save
    works, and the KV cache passed under transformers' deprecated keyword still fills."""
    transformers = pytest.importorskip("transformers")
    model = randomise_norm_weights(_tiny_hf_model("llama"))
    ids = torch.randint(0, 128, (2, 9))
    counts, grads = [], []
    for fuse in (False, True):
        m = copy.deepcopy(model)
        m.gradient_checkpointing_enable()
        m.train()
        cn.patch(m, fuse_residual=fuse)
        calls = []
        for layer in m.model.layers:
            real = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = (lambda real: lambda *a, **k: (calls.append(1), real(*a, **k))[1])(real)
        m(input_ids=ids, labels=ids).loss.backward()
        counts.append(len(calls))
        grads.append(m.model.layers[0].post_attention_layernorm.weight.grad)
    assert counts == [2, 2], counts
    torch.testing.assert_close(grads[1], grads[0], **FP32_GRAD)
    patched, _ = patch_copy(model, fuse_residual=True)
    twin = copy.deepcopy(patched)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        x = torch.ones(1, 3, 64)
        pos = torch.arange(3)[None]
        rope = twin.model.rotary_emb(x, pos)
        assert torch.equal(twin.model.layers[0](x, position_ids=pos, position_embeddings=rope), x)  # zero weights
        assert any(p.abs().sum() > 0 for p in patched.parameters()), "the copy shares its weights with the original"
    torch.save(patched, io.BytesIO())
    cache = transformers.DynamicCache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(1, 5, 64)
        pos = torch.arange(5)[None]
        patched.model.layers[0](x, position_ids=pos, position_embeddings=patched.model.rotary_emb(x, pos),
                                past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 5


def test_hf_fuse_residual_under_torch_compile(seed):
    """torch.compile(fullgraph=True) of a fused-patched model: the graph holds the fused op, logits match."""
    model = randomise_norm_weights(_tiny_hf_model("qwen3"))
    patched, _ = patch_copy(model, fuse_residual=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm
    compiled = torch.compile(patched, backend=backend, fullgraph=True)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, **FP32_OUT)
    assert sum(g.count("cutile_norms.add_rms_norm_fwd") for g in graphs) == 2, "the fused op is not in the graph"


def test_hf_fuse_residual_leaves_other_layer_shapes_alone(add_calls):
    """Gemma 3's layers (four norms, the add after a norm) and a subclass whose forward adds a
    statement are not fused; the norms are still swapped."""
    model = _tiny_hf_model("gemma3")
    patched, replaced = patch_copy(model, fuse_residual=True)
    assert not [n for n, cls in replaced if cls.endswith("(residual add fused)")] and replaced
    transformers = pytest.importorskip("transformers")
    base = transformers.models.llama.modeling_llama.LlamaDecoderLayer

    class ScaledLayer(base):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            hidden_states = hidden_states * 0.5
            return super().forward(hidden_states, attention_mask, position_ids, cache, use_cache,
                                   position_embeddings, **kwargs)
    model = _tiny_hf_model("llama")
    model.model.layers[0].__class__ = ScaledLayer
    patched, replaced = patch_copy(model, fuse_residual=True)
    assert [n for n, cls in replaced if cls.endswith("(residual add fused)")] == ["model.layers.1"]


GENERATE_CASES = [pytest.param(f, "cpu", "triton", id=f"{f}-cpu")
                  for f in ("llama", "qwen3", "gemma3")] + \
                 [pytest.param(f, "cuda", None, marks=pytest.mark.gpu, id=f"{f}-cuda") for f in ("llama", "qwen3", "gemma3")]


@pytest.mark.parametrize("fuse", [False, True], ids=["", "fused"])
@pytest.mark.parametrize("family, device, mode", GENERATE_CASES)
def test_hf_generate_greedy_tokens_match(seed, family, device, mode, fuse):
    """model.generate() of a randomly initialised fp32 model, patched against unpatched: the same greedy
    tokens (fp32 norms agree to rounding; a logit tie would be the only way to differ); with
    fuse_residual, the decode steps run the fused add (a KV cache, one new token a step)."""
    model = randomise_norm_weights(_tiny_hf_model(family)).to(device)
    patched, replaced = patch_copy(model, mode=mode, fuse_residual=fuse)
    assert replaced
    ids = torch.randint(0, 128, (2, 5), device=device)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, **kw)
        got = patched.generate(ids, **kw)
    assert torch.equal(got, expected), f"{family}: greedy tokens differ [seed {seed}]"


def test_eps_values_are_real_numbers():
    # an eps of 0 or NaN cannot be a real norm's: refused rather than passed to the kernels
    for bad in (0.0, math.nan, -1e-6):
        norm = LlamaRMSNorm(8)
        norm.variance_epsilon = bad
        with pytest.raises(ValueError, match="variance_epsilon"):
            cn.patch(torch.nn.Sequential(norm))
