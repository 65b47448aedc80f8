"""Weight-only quantization of MoE fused expert weights (``td.quantize_linears`` in quantize.py), eager only.

transformers' experts modules (``MixtralExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``GptOssExperts``
with its weights stored [E, in, out] and its biases, ``NemotronHExperts`` with ``up_proj`` and no gate)
keep their forward; their 3-D ``gate_up_proj`` / ``up_proj`` / ``down_proj`` become int8 / uint8 buffers,
dequantized on each access by :func:`~tritondelegate.quantize.dequantize_rows` (the rows helpers that
``QuantizedLinear`` uses too).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import tritondelegate as td
from tritondelegate.quantize import QuantizedExperts, dequantize_rows, quantize_rows, quantized_experts_class
from tritondelegate.ops import pack_nibbles, unpack_nibbles

transformers = pytest.importorskip("transformers")

FORMS = [  # (group_size, zero_point, bits)
    (None, False, 8), (16, False, 8), (None, True, 8), (16, True, 8), (None, False, 4), (16, True, 4)]
FORM_IDS = ["int8_row", "int8_group16", "uint8_zero", "uint8_zero_group16", "int4_row", "uint4_zero_group16"]
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
IDS = (torch.arange(11) * 7 % 97).unsqueeze(0)


# --- quantize_rows / dequantize_rows ----------------------------------------------------------------
@pytest.mark.parametrize("group_size,zero_point,bits", FORMS, ids=FORM_IDS)
def test_rows_round_trip_a_3d_weight_within_half_a_step(group_size, zero_point, bits):
    torch.manual_seed(0)
    w = torch.randn(3, 10, 48)
    q, zero, scale = quantize_rows(w, group_size, zero_point, bits)
    groups = 1 if group_size is None else 48 // group_size
    assert q.dtype == (torch.uint8 if zero_point or bits == 4 else torch.int8)
    assert q.shape == (3, 10, 48 if bits == 8 else 24)
    assert scale.shape == (3, 10, groups) and scale.dtype == w.dtype
    assert zero is None if not zero_point else (zero.shape == (3, 10, groups))
    got = dequantize_rows(q, zero, scale, bits, 48)
    assert got.shape == w.shape and got.dtype == w.dtype
    step = scale.repeat_interleave(48 // groups, dim=-1)
    assert ((got - w).abs() <= step / 2 * 1.001 + 1e-7).all()
    torch.testing.assert_close(dequantize_rows(q, zero, scale, bits), got, rtol=0, atol=0)  # k by default


def test_rows_refuse_what_they_cannot_quantize():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rows(torch.randn(2, 4, 48), group_size=32)
    with pytest.raises(ValueError, match="bits"):
        quantize_rows(torch.randn(2, 4, 47), bits=4)


@pytest.mark.parametrize("zero_point,bits", [(True, 8), (False, 4)], ids=["uint8_zero", "int4_symmetric"])
def test_dequantize_rows_is_one_op_with_the_written_out_arithmetic(zero_point, bits):
    """Exported, one ``tritondelegate::dequant_weight``; its value bit for bit
    ``(q.to(dt).view(*R, groups, G) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)`` then ``.view(*R, K)``
    (4 bits symmetric: ``- 8``), the form ``lower()`` recognizes in models quantized otherwise."""
    q, zero, scale = quantize_rows(torch.randn(4, 6, 32, dtype=torch.bfloat16), 16, zero_point, bits)

    class Dequant(nn.Module):
        def forward(self, q, scale):
            return dequantize_rows(q, zero, scale, bits, 32)

    ops = [n.target.__name__ for n in torch.export.export(Dequant(), (q, scale)).graph.nodes
           if n.op == "call_function" and "assert" not in n.target.__name__]
    assert ops == ["dequant_weight.default"], ops
    w = (unpack_nibbles(q) if bits == 4 else q).to(torch.bfloat16).view(4, 6, 2, 16)
    w = w - (zero.unsqueeze(-1) if zero_point else 8)
    assert torch.equal(Dequant()(q, scale), (w * scale.unsqueeze(-1)).view(4, 6, 32))
    with pytest.raises(ValueError, match="holds 32 columns, not 48"):
        dequantize_rows(q, zero, scale, bits, 48)


@pytest.mark.parametrize("group_size,zero_point,bits", [(None, False, 8), (16, True, 4)], ids=["int8_row", "uint4"])
def test_quantized_linear_is_unchanged(group_size, zero_point, bits):
    """Its buffers and weight bit for bit as the arithmetic it had before the rows helpers."""
    torch.manual_seed(1)
    linear = nn.Linear(48, 24)
    quantized = td.QuantizedLinear(linear, group_size=group_size, zero_point=zero_point, bits=bits)
    w, top = linear.weight.detach(), 2 ** bits - 1
    g = w.reshape(24, -1, group_size or 48)
    if zero_point:
        low, high = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        scale = ((high - low) / top).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.round(-low / scale)
        q = torch.clamp(torch.round(g / scale) + zero, 0, top)
        torch.testing.assert_close(quantized.zero, zero[..., 0], rtol=0, atol=0)
    else:
        scale = (g.abs().amax(-1, keepdim=True) / (top // 2)).clamp(min=torch.finfo(torch.float32).tiny)
        q, zero = torch.clamp(torch.round(g / scale), -(top // 2), top // 2) + (8 if bits == 4 else 0), None
        assert quantized.zero is None and "zero" not in dict(quantized.named_buffers())
    q = q.reshape(24, 48)
    q = pack_nibbles(q.to(torch.uint8)) if bits == 4 else q.to(torch.uint8 if zero_point else torch.int8)
    assert [name for name, _ in quantized.named_buffers()] == ["zero"] * zero_point + ["qweight", "scale"]
    torch.testing.assert_close(quantized.qweight, q, rtol=0, atol=0)
    torch.testing.assert_close(quantized.scale, scale[..., 0], rtol=0, atol=0)
    wq = q if bits == 8 else torch.stack([q & 15, q >> 4], -1).flatten(-2)
    wq = wq.float().view(24, -1, group_size or 48) - (zero if zero_point else 8 if bits == 4 else 0)
    torch.testing.assert_close(quantized.weight, (wq * scale).view(24, 48), rtol=0, atol=0)


# --- transformers MoE models --------------------------------------------------------------------------
def _model(name: str, seed: int) -> nn.Module:
    """A tiny transformers MoE causal LM, 2 layers of 4 experts (2 per token), in eval."""
    torch.manual_seed(seed)
    if name == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4)
        return transformers.MixtralForCausalLM(config).eval()
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=80, num_experts=4, head_dim=12)
        return transformers.Qwen3MoeForCausalLM(config).eval()
    if name == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**COMMON, num_experts=4)).eval()
    config = transformers.GptOssConfig(**COMMON, num_local_experts=4, head_dim=12, sliding_window=8)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # GPT-OSS initializes its expert biases to zero: make them count
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return model


def _moe(name: str, seed: int = 0) -> nn.Module:
    """The model, its expert weights drawn larger than transformers' init (std 0.02) so that they weigh
    on the logits."""
    model = _model(name, seed)
    with torch.no_grad():
        for experts in _experts(model):
            for weight in ("gate_up_proj", "down_proj"):
                getattr(experts, weight).normal_(0, 0.15)
    return model


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def _experts(model) -> list[nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


MODELS = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]
SHAPES = {"gate_up_proj": (4, 160, 48), "down_proj": (4, 48, 80)}  # [E, out, K] (as stored quantized)
NOT_EXPERTS = ("*.self_attn.*", "lm_head")  # the linears: quantize the experts alone


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("group_size,zero_point,bits,tolerance", [(None, False, 8, 0.04), (16, True, 4, 0.5)],
                         ids=["int8_row", "uint4_group16"])
def test_moe_model_experts_quantized(name, group_size, zero_point, bits, tolerance):
    """Integer buffers in place of the expert weights; the weights they compute within half a step of
    the float ones, along K (dim -1, or -2 where ``is_transposed``); the model's logits those of the float
    model with those weights, and close to the float model's (4 bits: a routing choice may flip)."""
    model = _moe(name)
    floats = [{w: getattr(experts, w).detach().clone() for w in SHAPES} for experts in _experts(model)]
    expected = _logits(model)
    td.quantize_linears(model, group_size=group_size, zero_point=zero_point, bits=bits, skip=NOT_EXPERTS)
    reference = _moe(name)  # the float model with the quantized weights
    for experts, float_weights, float_experts in zip(_experts(model), floats, _experts(reference)):
        assert isinstance(experts, QuantizedExperts) and type(experts) is quantized_experts_class(experts._float_class)
        assert experts.is_transposed == (name == "gpt_oss")
        assert not [p for p, _ in experts.named_parameters() if not p.endswith("_bias")]
        for weight, (e, out, k) in SHAPES.items():
            q, zero, scale = (getattr(experts, f"{weight}_{part}") for part in ("qweight", "zero", "scale"))
            assert q.dtype == (torch.uint8 if zero_point or bits == 4 else torch.int8)
            assert q.shape == (e, out, k * bits // 8)
            assert scale.shape == (e, out, 1 if group_size is None else k // group_size)
            assert zero is None if not zero_point else zero.shape == scale.shape
            w = getattr(experts, weight)
            assert w.dtype == torch.float32 and w.shape == float_weights[weight].shape
            step = scale.repeat_interleave(k // scale.shape[-1], dim=-1)
            if experts.is_transposed:
                step = step.transpose(-2, -1)
            assert ((w - float_weights[weight]).abs() <= step / 2 * 1.001 + 1e-7).all()
            with torch.no_grad():
                getattr(float_experts, weight).copy_(w)
    got = _logits(model)
    torch.testing.assert_close(got, _logits(reference), rtol=1e-5, atol=1e-6)
    assert 0 < _relative_error(got, expected) < tolerance


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_quantized_experts_round_trip_state_dict_deepcopy_and_pickle(name):
    model = td.quantize_linears(_moe(name), group_size=16, zero_point=True)
    expected = _logits(model)
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.down_proj_qweight"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.down_proj" not in state
    fresh = td.quantize_linears(_moe(name, seed=5), group_size=16, zero_point=True)
    assert not torch.equal(_logits(fresh), expected)
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(fresh), expected, rtol=0, atol=0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(_experts(other)[0]) is type(_experts(model)[0])
        torch.testing.assert_close(_logits(other), expected, rtol=0, atol=0)
    assert "gate_up_proj: 8 bits [4, 160, 48], group=16, zero_point=True" in repr(_experts(model)[0])


def test_skip_keeps_an_experts_module_or_one_weight_float():
    model = _moe("mixtral")
    expected = _logits(model)
    float_class = type(_experts(model)[0])
    td.quantize_linears(model, skip=("model.layers.0.mlp.experts", "*.1.mlp.experts.down_proj"))
    first, second = _experts(model)
    assert type(first) is float_class and sorted(dict(first.named_parameters())) == ["down_proj", "gate_up_proj"]
    assert isinstance(second, QuantizedExperts) and list(second._quantized_bits) == ["gate_up_proj"]
    assert isinstance(second.down_proj, nn.Parameter) and "down_proj" in dict(second.named_parameters())
    assert second.gate_up_proj_qweight.dtype == torch.int8
    assert 0 < _relative_error(_logits(model), expected) < 0.04


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_a_group_size_that_does_not_divide_k_leaves_that_weight_float(name):
    """group 24 divides gate_up's K (48 = hidden) but not down's (80 = intermediate), at dim -1 or -2."""
    model = td.quantize_linears(_moe(name), group_size=24)
    for experts in _experts(model):
        assert list(experts._quantized_bits) == ["gate_up_proj"] and experts.gate_up_proj_scale.shape == (4, 160, 2)
        assert isinstance(experts.down_proj, nn.Parameter)
    assert _logits(model).isfinite().all()


@pytest.mark.parametrize("name,bits", [("olmoe", 8), ("gpt_oss", 4)])
def test_export_keeps_the_expert_weights_integers(name, bits):
    """Exported, the expert weights are int8 / uint8 buffers that the dequantization reads, no parameters."""
    model = td.quantize_linears(_moe(name), bits=bits, group_size=16)
    ep = torch.export.export(Logits(model), (IDS,))
    params = ep.graph_signature.inputs_to_parameters.values()
    assert not [p for p in params if "experts" in p and not p.endswith("_bias")], params
    buffers = {node: target for node, target in ep.graph_signature.inputs_to_buffers.items() if "experts" in target}
    assert sorted(t.split(".")[-1] for t in buffers.values()) == sorted(
        ["down_proj_qweight", "down_proj_scale", "gate_up_proj_qweight", "gate_up_proj_scale"] * 2)
    aten = torch.ops.aten  # the only reader of q: the dequantization op
    readers = {torch.ops.tritondelegate.dequant_weight.default}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and buffers.get(node.name, "").endswith("_qweight"):
            assert ep.state_dict[buffers[node.name]].dtype == (torch.uint8 if bits == 4 else torch.int8)
            targets = {user.target for user in node.users} - {aten._assert_tensor_metadata.default}
            assert targets and targets <= readers, targets
    torch.testing.assert_close(ep.module()(IDS), _logits(model), rtol=1e-5, atol=1e-5)


def test_experts_without_a_gate_quantize_up_proj():
    """NemotronH's experts: ``up_proj`` and ``down_proj``, no gate (``has_gate=False``)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = transformers.NemotronHConfig(hidden_size=48, n_routed_experts=4, moe_intermediate_size=80,
                                          num_experts_per_tok=2, mlp_hidden_act="relu2")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = NemotronHExperts(config)
    with torch.no_grad():
        experts.up_proj.normal_(0, 0.1), experts.down_proj.normal_(0, 0.1)
    x, index, weights = torch.randn(7, 48), torch.randint(0, 4, (7, 2)), torch.rand(7, 2)
    with torch.no_grad():
        expected = experts(x, index, weights)
    holder = td.quantize_linears(nn.ModuleDict({"experts": experts}))
    assert holder["experts"] is experts and experts._quantized_bits == {"up_proj": 8, "down_proj": 8}
    assert experts.up_proj_qweight.shape == (4, 80, 48) and not list(experts.parameters())
    with torch.no_grad():
        assert 0 < _relative_error(experts(x, index, weights), expected) < 0.02


class _Router(torch.nn.Linear):
    """A linear subclass with a forward of its own (as Llama 4's router, which returns two values)."""

    def forward(self, x):
        scores = super().forward(x)
        return scores, scores.argmax(-1)


def test_a_linear_subclass_with_its_own_forward_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), _Router(32, 4))
    td.quantize_linears(model)
    assert isinstance(model[0], td.QuantizedLinear) and type(model[1]) is _Router
    scores, index = model(torch.randn(3, 32))
    assert scores.shape == (3, 4) and index.shape == (3,)


def test_llama4_experts_run_through_bmm_stay_quantized():
    """Llama 4's experts hold [E, in, out] weights without declaring ``is_transposed`` and run every
    expert through ``bmm``: quantized along ``in``, and the lowered program keeps every integer byte."""
    from harness import lower_resident

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**{**COMMON, "intermediate_size_mlp": 64}, head_dim=12,
                                           num_local_experts=4,
                                           interleave_moe_layer_step=1, no_rope_layer_interval=2)
    model = transformers.Llama4ForCausalLM(config).eval()
    td.quantize_linears(model, bits=4, group_size=16, skip=NOT_EXPERTS)
    experts = [layer.feed_forward.experts for layer in model.model.layers]
    for e in experts:
        assert isinstance(e, QuantizedExperts) and list(e._quantized_bits) == ["gate_up_proj", "down_proj"]
        assert e.gate_up_proj_qweight.shape == (4, 160, 24) and e.down_proj_qweight.shape == (4, 48, 40)
        assert e.gate_up_proj.shape == (4, 48, 160)  # as the module reads it: [E, in, out]
    want = sum(b.nbytes for b in model.buffers() if b.dtype == torch.uint8)
    lowered = lower_resident(Logits(model), (IDS,))
    assert sum(c.nbytes for c in lowered.program.constants if c.dtype == "uint8") == want
    assert not lowered.reports["forward"].nodes.host
    with torch.no_grad():
        torch.testing.assert_close(lowered.load().load_method("forward")(IDS), _logits(model), rtol=1e-4, atol=1e-4)
