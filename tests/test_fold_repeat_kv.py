import warnings

import pytest
import torch

import tritondelegate as td
from harness import Fn
from tritondelegate.decompose import decompose
from tritondelegate.models import demo_decoder
from tritondelegate.passes.fold_repeat_kv import fold_repeat_kv

aten = torch.ops.aten


def repeat_kv(x, rep):  # transformers' repeat_kv
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)


def attention(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)


def _lower(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(torch.export.export(model, args))


def test_repeat_kv_becomes_enable_gqa_and_matches_eager():
    q, k, v = torch.randn(2, 6, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.randn(9, 9)
    ep = decompose(torch.export.export(Fn(attention), (q, k, v, mask)))
    assert fold_repeat_kv(ep.graph_module)
    (sdpa,) = [n for n in ep.graph_module.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert sdpa.kwargs["enable_gqa"] is True
    assert [a.op for a in sdpa.args[1:3]] == ["placeholder", "placeholder"]  # k and v themselves
    assert not [n for n in ep.graph_module.graph.nodes if n.target in (aten.expand.default, aten.clone.default)]
    lowered = _lower(Fn(attention), (q, k, v, mask))
    assert [launch.kernel for launch in lowered.program.methods[0].delegates[0].plan.launches] == ["attention"]
    out = lowered.load(devices="simulated").load_method()(q, k, v, mask)
    torch.testing.assert_close(out, attention(q, k, v, mask), atol=1e-4, rtol=1e-4)


def test_one_key_value_head_repeats_as_a_view_and_becomes_enable_gqa_too():
    """Multi-query attention (Gemma-2B, Gemma 3 1B, Falcon-7B: one key/value head): the repeat is an
    expand and a view, with no clone between them."""
    def mqa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)

    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 1, 9, 16), torch.randn(2, 1, 9, 16)
    ep = decompose(torch.export.export(Fn(mqa), (q, k, v)))
    assert not [n for n in ep.graph_module.graph.nodes if n.target == aten.clone.default]
    assert fold_repeat_kv(ep.graph_module)
    (sdpa,) = [n for n in ep.graph_module.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert sdpa.kwargs["enable_gqa"] is True and [a.op for a in sdpa.args[1:3]] == ["placeholder", "placeholder"]
    lowered = _lower(Fn(mqa), (q, k, v))
    out = lowered.load(devices="simulated").load_method()(q, k, v)
    torch.testing.assert_close(out, mqa(q, k, v), atol=1e-4, rtol=1e-4)


def test_other_repeats_are_left_alone():
    def not_gqa(q, k, v):  # only the key is repeated: no GQA call expresses this
        return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), torch.cat([v] * 3, dim=1))

    q, k, v = torch.randn(1, 6, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    ep = decompose(torch.export.export(Fn(not_gqa), (q, k, v)))
    assert not fold_repeat_kv(ep.graph_module)


@pytest.mark.parametrize("attention_kind", ["sdpa"])
def test_decoder_launches_drop_by_two_copies_per_layer(attention_kind):
    model, args = demo_decoder(attention=attention_kind)
    lowered = _lower(model, args)
    kernels = [launch.op for launch in lowered.program.methods[0].delegates[0].plan.launches]
    assert not [op for op in kernels if op.startswith("clone")]
    with torch.no_grad():
        out = lowered.load(devices="simulated").load_method()(*args)
        assert (out - model(*args)).abs().max().item() < 1e-3
