"""Horizontal fusion of projections: linears that read one input with constant weights become one GEMM
over their weights concatenated (computed once by constant folding) and views of its result."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import nn

import tritondelegate as td
import tritondelegate.passes.fuse as fuse_module
from harness import Logits, assert_close, check_dynamic
from tritondelegate.decompose import decompose
from tritondelegate.models import demo_decoder
from tritondelegate.passes.fuse_projections import fuse_projections

RESIDENT = td.PropagateDeviceConfig(skip_h2d_for_constants=True)


def _lower(model, args, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        config = td.LowerConfig(propagate_device=RESIDENT, **config)
        return td.lower(torch.export.export(model, tuple(args)), config=config)


def _run(lowered, args):
    return lowered.load().load_method("forward")(*args)


def _fused(lowered) -> list[str]:
    """This pass's descriptions (other rewrites of ``fuse_patterns`` report there too)."""
    return [d for d in lowered.reports["forward"].fused if d.startswith("linear x")]


def _launches(lowered) -> int:
    return sum(len(d.plan.launches) for d in lowered.program.methods[0].delegates)


def _matmuls(lowered) -> int:
    return sum(1 for d in lowered.program.methods[0].delegates for launch in d.plan.launches
               if "matmul" in launch.kernel)


def _constants(lowered) -> dict[str, tuple]:
    return {c.name: tuple(c.shape) for c in lowered.program.constants}


def _nbytes(lowered) -> int:
    return sum(c.nbytes for c in lowered.program.constants)


def _unfused(monkeypatch):
    """Lower without this pass (everything else as usual), for a baseline."""
    monkeypatch.setattr(fuse_module, "fuse_projections", lambda ep, state: [])


class QKV(nn.Module):
    """Three projections of one input, odd sizes; their results are combined by views and pointwise ops."""

    def __init__(self, dim=24, outs=(40, 24, 24), bias=False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, n, bias=bias) for n in outs)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return (q[..., :24] * k).view(*x.shape[:-1], 4, 6).sum(-1) + v.view(*x.shape[:-1], 4, 6)[..., 0]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_qkv_becomes_one_gemm(dtype, bias):
    reference = QKV(bias=bias).eval()
    x32 = torch.randn(2, 5, 24)
    model, x = QKV(bias=bias).eval(), x32.to(dtype)
    model.load_state_dict(reference.state_dict())
    model.to(dtype)
    lowered = _lower(model, (x,))
    assert _fused(lowered) == ["linear x3 -> one GEMM: linear, linear_1, linear_2 (N = 40+24+24)"]
    assert _matmuls(lowered) == 1
    # Only the concatenated weight (and bias) is stored: the originals have no reader left.
    stored = _constants(lowered)
    assert not any(name.startswith(("q.", "k.", "v.")) for name in stored), stored
    assert sorted(stored.values()) == sorted([(88, 24)] + ([(88,)] if bias else []))
    with torch.no_grad():
        assert_close(_run(lowered, (x,)), reference(x32), dtype=dtype)


def test_fused_program_stores_no_more_bytes_and_launches_less(monkeypatch):
    model, x = QKV(bias=True).eval(), torch.randn(3, 24)
    fused = _lower(model, (x,))
    _unfused(monkeypatch)
    plain = _lower(model, (x,))
    assert _fused(plain) == []
    assert (_matmuls(fused), _matmuls(plain)) == (1, 3)
    # Fewer launches, though not two fewer: the unfused k GEMM also ran ``q * k`` in its epilogue.
    assert _launches(fused) < _launches(plain)
    assert _nbytes(fused) == _nbytes(plain)


class DecoderBlockish(nn.Module):
    """A linear whose result is also a method output, one read by a view before the others run, and a
    projection on a different input (not fused)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(24, 16), nn.Linear(24, 8), nn.Linear(24, 8)

    def forward(self, x, y):
        a = self.a(x)
        early = a.view(-1, 4, 4).transpose(1, 2).reshape(-1, 16)  # reads a before b and c exist
        b = self.b(x)
        return a, early + 1, b * self.c(y), b


def test_outputs_that_are_views_of_the_fused_result():
    model, args = DecoderBlockish().eval(), (torch.randn(3, 24), torch.randn(3, 24))
    lowered = _lower(model, args)
    assert _fused(lowered) == ["linear x2 -> one GEMM: linear, linear_1 (N = 16+8)"]
    results = _run(lowered, args)
    with torch.no_grad():
        expected = model(*args)
    assert len(results) == len(expected)
    for r, e in zip(results, expected):
        assert_close(r, e)


class NotFusable(nn.Module):
    """Linears that share no input, read a weight that is a method input or program state (read before
    its update), or mix bias and no bias: each on its own input, with one constant linear beside it."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(6, 12))
        self.b1 = nn.Parameter(torch.randn(8))
        self.register_buffer("w_state", torch.randn(8, 12))

    def forward(self, x, y, u, w):
        different_inputs = nn.functional.linear(x, self.w1) + nn.functional.linear(y, self.w1)
        input_weight = nn.functional.linear(u, w).sum(-1, keepdim=True) + nn.functional.linear(u, self.w2)[..., :1]
        state_weight = nn.functional.linear(x, self.w_state)
        self.w_state.mul_(0.5)
        z = x * 2
        mixed = nn.functional.linear(z, self.w1, self.b1) + nn.functional.linear(z, self.w1)
        return different_inputs, input_weight, state_weight, mixed


def test_what_is_not_fused():
    args = (torch.randn(3, 12), torch.randn(3, 12), torch.randn(3, 12), torch.randn(5, 12))
    model, eager = NotFusable(), NotFusable()
    eager.load_state_dict(model.state_dict())
    lowered = _lower(model, args)
    assert _fused(lowered) == []
    method = lowered.load().load_method("forward")
    for _ in range(2):  # the state weight changes between calls
        results = method(*args)
        with torch.no_grad():
            expected = eager(*args)
        for r, e in zip(results, expected):
            assert_close(r, e)


class Tied(nn.Module):
    """A weight that one group fuses and another linear reads too: both copies are stored, both right."""

    def __init__(self):
        super().__init__()
        self.p, self.q = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x, y):
        return self.p(x) * 2, self.q(x), nn.functional.linear(y, self.p.weight), self.p(x) + 1


def test_tied_and_repeated_weights():
    model, args = Tied().eval(), (torch.randn(2, 16), torch.randn(2, 16))
    lowered = _lower(model, args)
    # p(x) twice: the repeat is left as its own linear (it would store p's weight twice in the cat).
    assert _fused(lowered) == ["linear x2 -> one GEMM: linear, linear_1 (N = 16+8)"]
    assert set(_constants(lowered).values()) == {(24, 16), (16, 16)}
    with torch.no_grad():
        for r, e in zip(_run(lowered, args), model(*args)):
            assert_close(r, e)


def test_nothing_is_fused_without_constant_folding():
    model, x = QKV(), torch.randn(2, 24)
    lowered = _lower(model, (x,), fold_constants=False)
    assert _fused(lowered) == []
    assert _matmuls(lowered) == 3
    with torch.no_grad():
        assert_close(_run(lowered, (x,)), model(x))


def test_new_nodes_carry_values_and_provenance():
    ep = decompose(torch.export.export(QKV(bias=True), (torch.randn(2, 24),)))
    done = fuse_projections(ep, set())
    assert done == ["linear x3 -> one GEMM: linear, linear_1, linear_2 (N = 40+24+24)"]
    graph = ep.graph_module.graph
    graph.lint()
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    linears = [n for n in nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 1 and linears[0].meta["val"].shape == (2, 88)
    split = next(n for n in nodes if n.target == torch.ops.aten.split_with_sizes.default)
    assert [tuple(v.shape) for v in split.meta["val"]] == [(2, 40), (2, 24), (2, 24)]
    assert [u.meta["val"].stride() for u in split.users] == [(88, 1)] * 3
    for node in linears + [split] + [n for n in nodes if n.target is operator.getitem]:
        assert "nn_module_stack" in node.meta and "stack_trace" in node.meta


class Attention(nn.Module):
    """Q/K/V with bias into SDPA, over a dynamic sequence."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(24, 24), nn.Linear(24, 12), nn.Linear(24, 12)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, 12).transpose(1, 2)
        k = self.k(x).view(b, s, 1, 12).transpose(1, 2)
        v = self.v(x).view(b, s, 1, 12).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, 24)


def test_dynamic_sequence():
    model = Attention().eval()
    calls = [(torch.randn(1, s, 24),) for s in (1, 16, 7)]
    dims = ({1: torch.export.Dim("seq", max=16)},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered, _ = check_dynamic(model, calls, dims, example=(torch.randn(1, 7, 24),))
    assert _fused(lowered) == ["linear x3 -> one GEMM: linear, linear_1, linear_2 (N = 24+12+12)"]
    assert _matmuls(lowered) == 1


def test_demo_decoder(monkeypatch):
    # the projections alone: the rotary epilogue (test_rope_linear.py) would add its small pairs tables
    monkeypatch.setattr(fuse_module, "fuse_rope_linear", lambda ep, state: [])
    model, args = demo_decoder(seed=0, n_layers=2)
    fused = _lower(model, args)
    descriptions = _fused(fused)
    # Per layer Q/K/V; gate and up are fuse_glu.py's (one glu_linear), not this pass's.
    assert len(descriptions) == 2 and all(d.startswith("linear x3") for d in descriptions)
    fused_weights = ("q_proj", "k_proj", "v_proj", "ffn.gate", "ffn.up")
    assert not any(w in name for name in _constants(fused) for w in fused_weights), _constants(fused)
    with torch.no_grad():
        torch.testing.assert_close(_run(fused, args), model(*args), atol=1e-5, rtol=1e-5)
    _unfused(monkeypatch)
    plain = _lower(model, args)
    assert _launches(fused) <= _launches(plain) - 2 * 2  # Q/K/V: three GEMMs become one, per layer
    assert _nbytes(fused) <= _nbytes(plain)


def test_tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Logits(transformers.LlamaForCausalLM(config).eval())
    args = (torch.randint(0, 64, (2, 7)),)
    lowered = _lower(model, args)
    assert [d.split(" -> ")[0] + d[d.index(" (N ="):] for d in _fused(lowered)] == [
        "linear x3 (N = 32+16+16)",  # q, k, v; gate and up are combined by one mul: left apart
    ]
    with torch.no_grad():
        assert_close(_run(lowered, args), model(*args))

