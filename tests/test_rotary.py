"""Rotary embeddings: the ``tritondelegate::rotary`` op (ops.py), its kernel (kernels/rotary.py) and the
rewrite of the written-out pattern into it (passes/fuse_rotary.py), through the public API."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
import tritondelegate.passes.fuse as fuse
import tritondelegate.passes.fuse_rotary as fuse_rotary
from harness import FLOAT_DTYPES, Fn, Logits, assert_close, check_dynamic, check_model, export_decomposed
from tritondelegate import models
from tritondelegate.kernels import registry
from tritondelegate.ops import rotary_reference
from tritondelegate.errors import ProgramError
from tritondelegate.runtime.host_ops import resolve_op

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
ROTARY = torch.ops.tritondelegate.rotary.default
PAIR = torch.ops.tritondelegate.rotary_pair.default


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def written_out(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Three(torch.nn.Module):
    """``fn(x, cos, sin)`` as a module with named inputs (for dynamic_shapes by name)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, cos, sin):
        return self.fn(x, cos, sin)


def _lower(model, args, partitioner=None, dynamic_shapes=None):
    ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(ep, partitioner=partitioner or td.TritonPartitioner(), config=CONFIG)


def _run(lowered, args):
    return lowered.load().load_method("forward")(*args)


def _rotaries(lowered) -> int:
    return sum(f.startswith("rotary embedding") for f in lowered.reports["forward"].fused)


def _pairs(lowered) -> int:
    return sum(f.startswith("rotary pair") for f in lowered.reports["forward"].fused)


def _paired_launches(lowered) -> list[bool]:
    """PAIR of every rotary launch, in order."""
    return [launch.constexprs["PAIR"].value for m in lowered.program.methods for d in m.delegates
            for launch in d.plan.launches if launch.kernel == "rotary"]


def _launches(lowered) -> int:
    return sum(lowered.reports["forward"].launches.values())


def _kernels(lowered) -> list[str]:
    return [launch.kernel for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]


# --- the op ---------------------------------------------------------------------------------------
def test_op_reference_is_the_written_out_pattern_bit_for_bit():
    torch.manual_seed(0)
    for dtype in FLOAT_DTYPES:
        x, cos, sin = torch.randn(2, 3, 5, 8).to(dtype), torch.randn(5, 8).to(dtype), torch.randn(5, 8).to(dtype)
        assert torch.equal(ROTARY(x, cos, sin), written_out(x, cos, sin))
    # type promotion as the pattern's: an fp16 x with fp32 cos/sin gives fp32
    x = torch.randn(4, 6).half()
    assert ROTARY(x, torch.randn(6), torch.randn(6)).dtype == torch.float32


def test_op_fake_shapes_are_symbolic():
    model = Three(lambda x, cos, sin: ROTARY(x, cos, sin))
    args = (torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    seq = Dim("seq", max=16)
    ep = torch.export.export(model, args, dynamic_shapes={"x": {2: seq}, "cos": {0: seq}, "sin": {0: seq}})
    (node,) = [n for n in ep.graph.nodes if n.target is ROTARY]
    assert not isinstance(node.meta["val"].shape[2], int) and node.meta["val"].shape[3] == 8


# --- the kernel, on the op itself -----------------------------------------------------------------
# (x shape, cos/sin shape): odd sizes, D = 2 and odd halves, broadcasts of every kind, ranks 1 to 5
SHAPES = [
    ((1, 3, 5, 8), (5, 8)),  # [seq, D] against [b, heads, seq, D]
    ((2, 3, 7, 6), (2, 1, 7, 6)),  # [b, 1, seq, D]: h = 3
    ((3, 17, 10), (17, 10)),
    ((5, 2), (5, 2)),  # D = 2
    ((14,), (14,)),
    ((2, 3, 1, 5, 4), (1, 5, 4)),
    ((2, 4, 9, 16), (9, 1)),  # cos/sin broadcast along D too
    ((33, 130), (130,)),  # rows of a half that needs two column blocks (h = 65 > 64 ... < 128)
    ((3, 2, 300), (2, 300)),  # h = 150: two BLOCK_H blocks of 128
]


def _rotary_model():
    return Fn(lambda x, cos, sin: ROTARY(x, cos, sin))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_kernel_against_eager(dtype):
    torch.manual_seed(0)
    for x_shape, cs_shape in SHAPES:
        args32 = (torch.randn(x_shape), torch.randn(cs_shape), torch.randn(cs_shape))
        args = tuple(a.to(dtype) for a in args32)
        (out,), plan = check_model(_rotary_model(), args, dtype=dtype, reference_args=(_rotary_model(), args32))
        assert [launch.kernel for launch in plan.launches] == ["rotary"]
        assert out.dtype == dtype


def test_kernel_mixed_dtypes():
    """fp16 x with fp32 cos/sin: the result is fp32, as the pattern's."""
    torch.manual_seed(0)
    x, cos, sin = torch.randn(2, 3, 4, 8), torch.randn(4, 8), torch.randn(4, 8)
    (out,), _ = check_model(_rotary_model(), (x.half(), cos, sin), dtype=torch.float16,
                            reference_args=(_rotary_model(), (x, cos, sin)))
    assert out.dtype == torch.float32


def test_kernel_reads_a_transposed_x_in_place():
    """x = a projection's [b, seq, heads, D] transposed to [b, heads, seq, D]: no copy before the kernel."""
    torch.manual_seed(0)
    model = Fn(lambda x, cos, sin: ROTARY(x.transpose(1, 2), cos, sin))
    args = (torch.randn(2, 7, 3, 10), torch.randn(7, 10), torch.randn(7, 10))
    _, plan = check_model(model, args)
    assert [launch.kernel for launch in plan.launches] == ["rotary"]
    # a non-contiguous last dim and broadcast cos/sin with their own strides
    model = Fn(lambda x, cos, sin: ROTARY(x.transpose(-1, -2), cos.t(), sin))
    args = (torch.randn(3, 8, 5), torch.randn(8, 5), torch.randn(5, 8))
    _, plan = check_model(model, args)
    assert [launch.kernel for launch in plan.launches] == ["rotary"]


def test_support_refuses_an_odd_last_dim():
    model = Fn(lambda x, cos, sin: x * cos)
    ep = torch.export.export(model, (torch.randn(3, 5), torch.randn(5), torch.randn(5)))
    x, cos, sin = [n for n in ep.graph.nodes if n.op == "placeholder"]
    with ep.graph.inserting_after(sin):
        node = ep.graph.call_function(ROTARY, (x, cos, sin))
    node.meta["val"] = x.meta["val"]
    assert "even" in registry.OPS[ROTARY].support(node)


def test_support_refuses_a_pair_of_other_last_dims():
    model = Fn(lambda q, k, cos, sin: q * cos)
    ep = torch.export.export(model, (torch.randn(3, 8), torch.randn(3, 6), torch.randn(8), torch.randn(8)))
    q, k, cos, sin = [n for n in ep.graph.nodes if n.op == "placeholder"]
    with ep.graph.inserting_after(sin):
        node = ep.graph.call_function(PAIR, (q, k, cos, sin))
    node.meta["val"] = (q.meta["val"], k.meta["val"])
    assert "differ in their last dim" in registry.OPS[PAIR].support(node)
    node.meta["val"] = (q.meta["val"], q.meta["val"])  # k's result not of k's shape
    assert registry.OPS[PAIR].support(node).startswith("k: the result's shape")


# --- the rewrite ----------------------------------------------------------------------------------
def _without_rotary_pass(monkeypatch):
    monkeypatch.setattr(fuse, "fuse_rotary", lambda ep, *a: [])


def _without_rope_epilogue(monkeypatch):
    """The model-level tests here are about the rotary kernel; the projection's rotary epilogue
    (``passes/fuse_rope_linear.py``, tested in test_rope_linear.py) would take its place."""
    monkeypatch.setattr(fuse, "fuse_rope_linear", lambda ep, *a: [])


def test_written_out_pattern_becomes_one_launch():
    torch.manual_seed(0)
    args = (torch.randn(1, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(written_out), args)
    assert _rotaries(lowered) == 1 and _launches(lowered) == 1
    assert _kernels(lowered) == ["rotary"]
    assert_close(_run(lowered, args), written_out(*args))


def test_operands_in_either_order_and_dims_written_out():
    """cos * x, sin * rotate_half(x), the add reversed, slices with dim D - 1 and explicit ends."""

    def swapped(x, cos, sin):
        r = torch.cat((-x[:, :, 4:8], x[:, :, 0:4]), dim=2)
        return (sin * r) + (cos * x)

    torch.manual_seed(0)
    args = (torch.randn(2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(swapped), args)
    assert _rotaries(lowered) == 1 and _launches(lowered) == 1
    assert_close(_run(lowered, args), swapped(*args))


def test_a_view_written_twice_is_one_x():
    """``k.transpose(1, 2)`` multiplied and, written again, rotated: one rotary over the transposed view
    (no copy), and the second transpose is gone."""

    def twice(k, cos, sin):
        return k.transpose(1, 2) * cos + rotate_half(k.transpose(1, 2)) * sin

    torch.manual_seed(0)
    args = (torch.randn(1, 5, 2, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(twice), args)
    assert _rotaries(lowered) == 1 and _kernels(lowered) == ["rotary"]
    assert_close(_run(lowered, args), twice(*args))


def test_a_cat_that_is_also_returned_is_not_rewritten():
    def also_returned(x, cos, sin):
        r = rotate_half(x)
        return x * cos + r * sin, r

    torch.manual_seed(0)
    args = (torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(also_returned), args)
    assert _rotaries(lowered) == 0
    for got, expected in zip(_run(lowered, args), also_returned(*args)):
        assert_close(got, expected)


def test_not_a_rotation_is_not_rewritten():
    """The halves in the other order (x[..., :h] negated) is not rotate_half."""

    def other(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., :h], x[..., h:]), dim=-1) * sin

    args = (torch.randn(2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(other), args)
    assert _rotaries(lowered) == 0
    assert_close(_run(lowered, args), other(*args))


def _without_pairs(monkeypatch):
    monkeypatch.setattr(fuse_rotary, "pair_rotaries", lambda ep: [])


def test_demo_decoder_every_rotary_fused(monkeypatch):
    """q and k of each layer: one rotary launch per layer (a pair); without the rewrite eight (four per
    tensor)."""
    _without_rope_epilogue(monkeypatch)
    model, args = models.demo_decoder(n_layers=2, seed=0)
    lowered = _lower(model, args)
    assert _rotaries(lowered) == 4 and _pairs(lowered) == 2
    assert _paired_launches(lowered) == [True, True] and not lowered.reports["forward"].nodes.host
    with torch.no_grad():
        expected = model(*args)
    assert_close(_run(lowered, args), expected)
    _without_rotary_pass(monkeypatch)
    assert _launches(_lower(model, args)) - _launches(lowered) == 7 * 2


def test_hf_llama_every_rotary_fused(monkeypatch):
    transformers = pytest.importorskip("transformers")
    _without_rope_epilogue(monkeypatch)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Logits(transformers.LlamaForCausalLM(config).eval())
    args = (torch.randint(0, 64, (2, 7)),)
    lowered = _lower(model, args)  # 4 query heads, 2 key heads: the pair's k has its own rows
    assert _rotaries(lowered) == 4 and _pairs(lowered) == 2
    assert _paired_launches(lowered) == [True, True] and not lowered.reports["forward"].nodes.host
    with torch.no_grad():
        expected = model(*args)
    assert_close(_run(lowered, args), expected)
    _without_rotary_pass(monkeypatch)
    assert _launches(_lower(model, args)) - _launches(lowered) == 7 * 2


def test_dynamic_sequence_length():
    """One program for seq 1..16: [b, heads, seq, D] against [seq, D] cos/sin, at 1, 16 and 7."""
    torch.manual_seed(0)
    seq = Dim("seq", max=16)

    def call(n):
        return (torch.randn(1, 3, n, 8), torch.randn(n, 8), torch.randn(n, 8))

    lowered, method = check_dynamic(Three(written_out), [call(n) for n in (1, 16, 7)],
                                    {"x": {2: seq}, "cos": {0: seq}, "sin": {0: seq}}, example=call(5))
    assert _rotaries(lowered) == 1 and _launches(lowered) == 1


def test_dynamic_sequence_demo_decoder(monkeypatch):
    _without_rope_epilogue(monkeypatch)
    model, _ = models.demo_decoder(n_layers=1, max_seq_len=32, seed=0)
    calls = [(torch.randint(0, model.cfg.vocab_size, (1, n)),) for n in (1, 16, 7)]
    lowered, _ = check_dynamic(model, calls, {"input_ids": {1: Dim("seq", max=16)}}, example=(calls[2][0],))
    assert _rotaries(lowered) == 2 and _paired_launches(lowered) == [True]


# --- pairs: q and k over the same cos and sin in one launch ---------------------------------------
def both(q, k, cos, sin):
    return written_out(q, cos, sin), written_out(k, cos, sin)


class Four(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return both(q, k, cos, sin)


def test_pair_op_reference_and_fake():
    torch.manual_seed(0)
    q, k, cos, sin = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    assert all(torch.equal(a, b) for a, b in zip(PAIR(q, k, cos, sin), both(q, k, cos, sin)))
    seq = Dim("seq", max=16)
    ep = torch.export.export(Fn(lambda q, k, c, s: PAIR(q, k, c, s)), (q, k, cos, sin),
                             dynamic_shapes={"args": ({2: seq}, {2: seq}, {0: seq}, {0: seq})})
    (node,) = [n for n in ep.graph.nodes if n.target is PAIR]
    assert [tuple(v.shape[i] for i in (1, 3)) for v in node.meta["val"]] == [(4, 8), (2, 8)]
    assert not isinstance(node.meta["val"][1].shape[2], int)


# (q shape, k shape, cos/sin shape, k as a projection's [b, seq, heads, D] transposed): GQA head counts,
# odd rows, a half over two column blocks, [b, 1, seq, D] tables
PAIR_SHAPES = [
    ((2, 4, 7, 8), (2, 2, 7, 8), (7, 8), False),
    ((1, 3, 5, 6), (1, 1, 5, 6), (1, 1, 5, 6), True),
    ((1, 2, 9, 300), (1, 1, 9, 300), (1, 1, 9, 300), False),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_pair_kernel_against_eager(dtype):
    torch.manual_seed(0)
    for q_shape, k_shape, cs_shape, transposed in PAIR_SHAPES:
        if transposed:
            model = Fn(lambda q, k, c, s: PAIR(q, k.transpose(1, 2), c, s))
            k_shape = (k_shape[0], k_shape[2], k_shape[1], k_shape[3])
        else:
            model = Fn(lambda q, k, c, s: PAIR(q, k, c, s))
        args = (torch.randn(q_shape), torch.randn(k_shape), torch.randn(cs_shape), torch.randn(cs_shape))
        args = tuple(a.to(dtype) for a in args)  # judged against fp32 math on the same (rounded) values
        outs, plan = check_model(model, args, dtype=dtype, reference_args=(model, [a.float() for a in args]))
        assert [launch.kernel for launch in plan.launches] == ["rotary"]
        assert plan.launches[0].constexprs["PAIR"].value is True
        assert [o.dtype for o in outs] == [dtype, dtype]


def test_written_out_q_and_k_become_one_launch(monkeypatch):
    torch.manual_seed(0)
    for dtype in FLOAT_DTYPES:
        args = (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
        args = tuple(a.to(dtype) for a in args)
        lowered = _lower(Four(), args)
        assert _rotaries(lowered) == 2 and _pairs(lowered) == 1 and _launches(lowered) == 1
        for got, expected in zip(_run(lowered, args), both(*(a.float() for a in args))):
            assert_close(got, expected, dtype=dtype)
    _without_pairs(monkeypatch)
    unpaired = _lower(Four(), args)
    assert _pairs(unpaired) == 0 and _paired_launches(unpaired) == [False, False]


def test_pair_traffic_reads_each_input_once():
    """The pair's traffic row: q, k, cos and sin read once (cos and sin shared), q and k written once;
    three FLOPs per output element."""
    args = (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Four(), args)
    (launch,) = [launch for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]
    assert launch.bytes_read == (4 * 5 * 8 + 2 * 5 * 8 + 2 * 5 * 8) * 4
    assert launch.bytes_written == (4 * 5 * 8 + 2 * 5 * 8) * 4
    assert launch.flops == 3 * (4 + 2) * 5 * 8


def test_a_paired_result_returned_and_read_twice_is_kept():
    """q's rotation is a method output and read twice more, k's read by a later op: nothing is lost."""

    def reused(q, k, cos, sin):
        rq, rk = both(q, k, cos, sin)
        return rq, rq * 2.0, rk + rq.sum(), torch.tanh(rq)

    torch.manual_seed(0)
    args = (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(reused), args)
    assert _pairs(lowered) == 1 and _paired_launches(lowered) == [True]
    for got, expected in zip(_run(lowered, args), reused(*args)):
        assert_close(got, expected)


def test_tables_as_equal_views_pair_and_the_spare_views_go():
    """``cos.unsqueeze(0)`` written for q and again for k: one pair over q's views, k's views erased."""

    def views(q, k, cos, sin):
        return written_out(q, cos.unsqueeze(0), sin.unsqueeze(0)), written_out(k, cos.unsqueeze(0), sin.unsqueeze(0))

    torch.manual_seed(0)
    args = (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    ep = export_decomposed(Fn(views), args)
    done = fuse_rotary.fuse_rotary(ep)
    assert [d.split(" of ")[0].split(":")[0] for d in done] == ["rotary embedding"] * 2 + ["rotary pair"]
    ep.graph_module.recompile()
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.unsqueeze.default) == 2 and targets.count(PAIR) == 1
    for got, expected in zip(ep.module()(*args), views(*args)):
        assert torch.equal(got, expected)


def test_what_does_not_pair_stays_single():
    """Other tables, or a k that reads q's rotation: two single launches, the values unchanged."""

    def other_tables(q, k, cos, sin):
        return written_out(q, cos, sin), written_out(k, sin, cos)

    def dependent(q, k, cos, sin):
        rq = written_out(q, cos, sin)
        return rq, written_out(k + rq, cos, sin)

    torch.manual_seed(0)
    args = (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    for fn in (other_tables, dependent):
        lowered = _lower(Fn(fn), args)
        assert _rotaries(lowered) == 2 and _pairs(lowered) == 0 and _paired_launches(lowered) == [False, False]
        for got, expected in zip(_run(lowered, args), fn(*args)):
            assert_close(got, expected)


def test_pair_placed_after_its_later_input():
    """k computed after q's rotation (q's result read only after it): the pair goes at k's place."""

    def late_k(q, cos, sin):
        rq = written_out(q, cos, sin)
        k = torch.relu(q) * 3.0
        return written_out(k, cos, sin) + rq

    torch.manual_seed(0)
    args = (torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(late_k), args)
    assert _pairs(lowered) == 1
    assert_close(_run(lowered, args), late_k(*args))


def test_pair_dynamic_sequence_length():
    """One program for seq 1..16: q [1, 4, seq, 8] and k [1, 2, seq, 8] against [seq, 8] tables."""
    torch.manual_seed(0)
    seq = Dim("seq", max=16)

    def call(n):
        return (torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(n, 8), torch.randn(n, 8))

    dims = {"q": {2: seq}, "k": {2: seq}, "cos": {0: seq}, "sin": {0: seq}}
    lowered, _ = check_dynamic(Four(), [call(n) for n in (1, 16, 7)], dims, example=call(5))
    assert _pairs(lowered) == 1 and _launches(lowered) == 1


# --- on the host ----------------------------------------------------------------------------------
def test_host_fallback_runs_the_reference(tmp_path):
    """A partitioner that may not claim the op leaves it on the host; the runtime runs it there, from
    memory and from a program file."""
    torch.manual_seed(0)
    args = (torch.randn(1, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    ops = [op for op in registry.OPS if op is not ROTARY]
    lowered = _lower(Fn(written_out), args, partitioner=td.TritonPartitioner(ops=ops))
    assert _rotaries(lowered) == 1
    host = lowered.reports["forward"].nodes.host
    assert [op for _, op, _ in host] == ["tritondelegate.rotary.default"], host
    assert torch.equal(_run(lowered, args), written_out(*args))
    lowered.save(tmp_path / "rotary.tdp")
    method = td.load(str(tmp_path / "rotary.tdp")).load_method("forward")
    assert torch.equal(method(*args), written_out(*args))


def test_host_fallback_runs_the_pair(tmp_path):
    """rotary_pair (two results) on the host, from memory and from a program file: exactly eager's."""
    torch.manual_seed(0)
    args = (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    ops = [op for op in registry.OPS if op is not PAIR]
    lowered = _lower(Four(), args, partitioner=td.TritonPartitioner(ops=ops))
    assert _pairs(lowered) == 1
    assert [op for _, op, _ in lowered.reports["forward"].nodes.host] == ["tritondelegate.rotary_pair.default"]
    lowered.save(tmp_path / "pair.tdp")
    for method in (lowered.load().load_method("forward"), td.load(str(tmp_path / "pair.tdp")).load_method("forward")):
        assert all(torch.equal(a, b) for a, b in zip(method(*args), both(*args)))


def test_resolve_op():
    op = resolve_op("tritondelegate::rotary")
    x, cos, sin = torch.randn(2, 6), torch.randn(6), torch.randn(6)
    assert torch.equal(op(x, cos, sin), rotary_reference(x, cos, sin))
    assert resolve_op("tritondelegate::rotary.default") is op
    pair = resolve_op("tritondelegate::rotary_pair")
    assert all(torch.equal(a, rotary_reference(t, cos, sin)) for a, t in zip(pair(x, 2 * x, cos, sin), (x, 2 * x)))
    with pytest.raises(ProgramError, match="tritondelegate/ops.py"):
        resolve_op("tritondelegate::nope")
    with pytest.raises(ProgramError, match="not an ATen operator"):
        resolve_op("other::rotary")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cast_of_the_result_is_stored_by_the_rotary(dtype, monkeypatch):
    # OLMo's and Cohere's form: q and k of the model's dtype times fp32 tables (an fp32 result), cast
    # back: the rotary launch stores the cast's dtype; no launch of its own for either cast.
    _without_rope_epilogue(monkeypatch)
    torch.manual_seed(0)

    def olmo(q, k, cos, sin):
        return written_out(q, cos, sin).to(q.dtype), written_out(k, cos, sin).to(k.dtype)

    args = (torch.randn(1, 4, 5, 8, dtype=dtype), torch.randn(1, 2, 5, 8, dtype=dtype), torch.randn(5, 8), torch.randn(5, 8))
    lowered = _lower(Fn(olmo), args)
    assert _kernels(lowered) == ["rotary"]
    assert sum("the cast of its result" in f for f in lowered.reports["forward"].fused) == 2
    for got, want in zip(_run(lowered, args), olmo(*args)):
        assert got.dtype == dtype
        assert_close(got, want)
