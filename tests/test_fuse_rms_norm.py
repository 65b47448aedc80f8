"""passes/fuse_rms_norm.py: an RMSNorm written out (pow/mean/add/rsqrt/mul) becomes one aten.rms_norm.

End to end through the public API on the simulated device, against eager: our RMSNorm in each float
dtype, the demo decoder, transformers' Llama and Gemma; and the norms that must stay as written (an
intermediate read elsewhere, another dim, no keepdim), and a dynamic sequence length.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import Fn, Logits, assert_close
from tritondelegate.decompose import decompose
from tritondelegate.models import RMSNorm, demo_decoder
from tritondelegate.passes import fuse as fuse_module
from tritondelegate.passes.fuse_rms_norm import fuse_rms_norm

aten = torch.ops.aten
CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _lower(model, args, dynamic_shapes=None):
    ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(ep, config=CONFIG)


def _launches(lowered) -> int:
    return sum(len(d.plan.launches) for d in lowered.program.methods[0].delegates)


def _run(lowered, *args):
    return lowered.load().load_method("forward")(*args)


def _check(model, args, dtype=None):
    """Lower, run, compare with eager; returns the lowered program."""
    lowered = _lower(model, args)
    out = _run(lowered, *args)
    with torch.no_grad():
        expected = model(*args)
    for actual, reference in zip(*(o if isinstance(o, (tuple, list)) else [o] for o in (out, expected))):
        assert actual.dtype == reference.dtype
        assert_close(actual, reference, dtype)
    return lowered


def _ops(ep) -> list:
    return [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 33), (torch.float16, 24), (torch.bfloat16, 33)])
def test_our_rmsnorm(dtype, dim):
    model = RMSNorm(dim, 1e-6).to(dtype)
    x = torch.randn(2, 3, dim, dtype=dtype)
    lowered = _check(model, (x,))
    # the fp16/bf16 model casts x to fp32 twice: dedupe merges the two casts first
    (fused,) = [f for f in lowered.reports["forward"].fused if not f.startswith("repeated computation")]
    assert fused.startswith("rms_norm: ") and "pow" in fused and "rsqrt" in fused
    assert _launches(lowered) == 1


def test_rewritten_graph():
    """One rms_norm node, no cast added, the final node's stack trace kept, the graph valid."""
    ep = decompose(torch.export.export(RMSNorm(24, 1e-5).half(), (torch.randn(3, 24).half(),)))
    final = list(ep.graph_module.graph.nodes)[-2]
    done = fuse_rms_norm(ep)
    assert len(done) == 1 and done[0].startswith(f"rms_norm: {final.name} (")
    assert _ops(ep) == [aten.rms_norm.default]
    (node,) = [n for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    assert node.args[1:] == ([24], node.args[2], 1e-5) and node.args[2].op == "placeholder"
    assert node.meta["val"].dtype == torch.float16 and node.meta.get("stack_trace") == final.meta.get("stack_trace")
    ep.graph_module.graph.lint()
    x = torch.randn(3, 24).half()
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).half() * ep.state_dict["weight"]
    assert_close(ep.module()(x), expected)


def test_without_weight():
    model = Fn(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    lowered = _check(model, (torch.randn(5, 17),))
    assert len(lowered.reports["forward"].fused) == 1 and _launches(lowered) == 1


def test_llama_mixed_dtypes_keeps_the_rounding():
    """bf16 x with an fp32 weight: Llama rounds to bf16 before the weight, the result is fp32 (exact
    only with that rounding): the norm up to the cast is fused, the weight's mul stays a node of its
    own, which runs as the norm kernel's epilogue (on the result rounded to bf16): one launch."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = LlamaRMSNorm(24).eval()
    with torch.no_grad():
        model.weight.add_(0.1 * torch.randn(24))
    x = torch.randn(2, 3, 24, dtype=torch.bfloat16)
    ep = decompose(torch.export.export(model, (x,)))
    (done,) = fuse_rms_norm(ep)
    assert aten.rms_norm.default in _ops(ep) and aten.mul.Tensor in _ops(ep)
    assert ep.module()(x).dtype == torch.float32
    lowered = _check(model, (x,), torch.bfloat16)  # a bf16 rounding: one bf16 ulp either way
    assert _launches(lowered) == 1


def test_gemma_norm_fp16():
    """Gemma: x * rsqrt(...) * (1 + w) in fp32, cast back at the end: one rms_norm returning fp16."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    model = GemmaRMSNorm(24).half().eval()
    with torch.no_grad():
        model.weight.copy_(0.5 * torch.randn(24))
    lowered = _check(model, (torch.randn(2, 3, 24, dtype=torch.float16),))
    assert len(lowered.reports["forward"].fused) == 1 and _launches(lowered) == 1


def test_demo_decoder(monkeypatch):
    model, args = demo_decoder(n_layers=1)
    lowered = _check(model, args)
    norms = 3  # two per layer, one at the end
    assert len([f for f in lowered.reports["forward"].fused if f.startswith("rms_norm")]) == norms
    monkeypatch.setattr(fuse_module, "fuse_rms_norm", lambda ep, *a: [])
    unfused = _lower(model, args)
    # Written out, a norm is 2 launches (the mean with the square as its prologue, kernels/fuse_reduce.py;
    # the chain that scales x); fused, one rms_norm that runs as the prologue of the matmuls reading it
    # (kernels/fusion.py): no launch of its own.
    assert _launches(unfused) - _launches(lowered) == 2 * norms


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**kw, head_dim=8))
        with torch.no_grad():  # Gemma initializes its norm weights to 0 (a scale of 1 + w)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(0.2 * torch.randn_like(p))
    return Logits(model.eval())


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_hf_models(kind):
    model = _hf(kind)
    lowered = _check(model, (torch.randint(0, 64, (2, 5)),))
    fused = [f for f in lowered.reports["forward"].fused if f.startswith("rms_norm")]
    assert len(fused) == 3, fused  # two per layer, one at the end
    ep = decompose(torch.export.export(model, (torch.randint(0, 64, (2, 5)),)))
    fuse_rms_norm(ep)
    assert aten.rsqrt.default not in _ops(ep) and aten.pow.Tensor_Scalar not in _ops(ep)


def test_intermediate_read_elsewhere_is_kept():
    """The normalized x before the weight is also returned: the norm stays as written."""
    weight = torch.randn(24)

    def fn(x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * weight, normed

    lowered = _check(Fn(fn), (torch.randn(3, 24),))
    assert lowered.reports["forward"].fused == []


def test_variance_read_elsewhere_is_kept():
    weight = torch.randn(24)

    def fn(x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-6) * weight, variance

    lowered = _check(Fn(fn), (torch.randn(3, 24),))
    assert lowered.reports["forward"].fused == []


@pytest.mark.parametrize("case", ["other_dim", "no_keepdim", "cube"])
def test_not_a_last_dim_rmsnorm(case):
    weight = torch.randn(24)
    fns = {
        "other_dim": lambda x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * weight,
        "no_keepdim": lambda x: x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6)[..., None] * weight,
        "cube": lambda x: x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6) * weight,
    }
    x = torch.rand(2, 4, 24) + 0.5
    lowered = _check(Fn(fns[case]), (x,))
    assert lowered.reports["forward"].fused == []


def test_weight_not_1d_stays_a_mul():
    """A [4, D] scale is no rms_norm weight: the norm is fused without weight, the mul stays."""
    weight = torch.randn(4, 24)
    model = Fn(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)
    x = torch.randn(2, 4, 24)
    ep = decompose(torch.export.export(model, (x,)))
    (done,) = fuse_rms_norm(ep)
    (norm,) = [n for n in ep.graph_module.graph.nodes if n.target is aten.rms_norm.default]
    assert norm.args[2] is None and _ops(ep) == [aten.rms_norm.default, aten.mul.Tensor]
    _check(model, (x,))


def test_dynamic_seq():
    model = RMSNorm(24, 1e-6)
    seq = Dim("seq", max=16)
    lowered = _lower(model, (torch.randn(2, 8, 24),), dynamic_shapes=({1: seq},))
    assert len(lowered.reports["forward"].fused) == 1
    method = lowered.load().load_method("forward")
    for n in (1, 16, 7):
        x = torch.randn(2, n, 24)
        with torch.no_grad():
            assert_close(method(x), model(x))
