"""Pointwise chain fusion (kernels/fusion.py): which launches merge, and that fused chains compute what
eager does (fp16/bf16 against an fp32 reference)."""

import warnings

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import (FLOAT_DTYPES, Buffered, Fn, check_dynamic, check_low, check_model, check_state_updates,
                     plan_launches)
from tritondelegate.kernels import fusion
from tritondelegate.kernels.refs import LaunchRecord, TRef
from tritondelegate.kernels.elementwise import PointwiseOp
from tritondelegate.models import FeedForward, DecoderConfig, RMSNorm, demo_decoder
from tritondelegate.plan import Launch


def kernels(plan):
    return [launch.kernel for launch in plan.launches]


def chain_ops(launch):
    c = {k: v.value for k, v in launch.constexprs.items()}
    return [c[f"OP{i}"] for i in range(c["NOPS"])]


def chains(plan):
    return [chain_ops(launch) for launch in plan.launches if launch.kernel == "pointwise_chain"]


def epilogue_ops(launch):
    """The ops of a matmul launch's epilogue ([] without one)."""
    c = {k: v.value for k, v in launch.constexprs.items()}
    return [c[f"EOP{i}"] for i in range(c.get("EPILOGUE", 0))] if launch.kernel == "matmul" else []


# --- what fuses -----------------------------------------------------------------------------------
def test_rmsnorm_tail_is_one_launch():
    # pow -> mean -> add(eps) -> rsqrt -> mul(x, .) -> mul(., weight): rsqrt is [..., 1], broadcast by
    # its consumer; the four ops after the reduction run as one launch (pow is the reduction's prologue,
    # fuse_reduce.py; the chain broadcasts the mean, so it is no epilogue).
    _, plan = check_model(RMSNorm(33, 1e-5), (torch.randn(2, 5, 33),))
    assert kernels(plan) == ["reduce", "pointwise_chain"]
    assert chains(plan) == [["add", "rsqrt", "mul", "mul"]]
    assert [launch.op for launch in plan.launches] == ["pow_1+mean", "add+rsqrt+mul+mul_1"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_tail_dtypes(dtype):
    # In fp16/bf16 the upcasts and the cast back are copies: the cast back adds no op to the chain.
    torch.manual_seed(0)
    _, plan = check_low(RMSNorm(33, 1e-5), (torch.randn(2, 5, 33),), dtype)
    if dtype == torch.float32:
        assert chains(plan) == [["add", "rsqrt", "mul", "mul"]]
    else:  # x.float() twice: fused into pow, the reduction's prologue, and into the mul; add+rsqrt of the
        # [..., 1] mean is the reduction's epilogue (fuse_reduce.py)
        assert kernels(plan) == ["reduce", "pointwise_chain"]
        assert chains(plan) == [["copy", "mul", "mul"]]
        assert plan.launches[0].op == "_to_copy+pow_1+mean+add+rsqrt"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_times_up_fuses_across_a_matmul(dtype):
    # down(silu(gate(x)) * up(x)): silu is launched before up's matmul and fused into the mul after it;
    # that chain then runs in gate's matmul epilogue (test_epilogue.py), after up's matmul.
    ffn = FeedForward(DecoderConfig(dim=40, hidden_dim=72))
    _, plan = check_low(ffn, (torch.randn(3, 7, 40),), dtype)
    assert [(launch.kernel, launch.op) for launch in plan.launches] == [
        ("matmul", "linear_1"), ("matmul", "linear+silu+mul"), ("matmul", "linear_2")]


def test_value_read_twice_is_not_fused():
    x = torch.randn(17, 33)
    _, plan = check_model(Fn(lambda x: (lambda y: y.sin() + y.cos())(x.exp())), (x,))
    # exp's result feeds sin and cos: it is stored once; sin (read once) fuses into the add.
    assert [(launch.kernel, launch.op) for launch in plan.launches] == [
        ("pointwise", "exp"), ("pointwise", "cos"), ("pointwise_chain", "sin+add")]


@pytest.mark.parametrize("outputs", [lambda y: (y, y * 2), lambda y: (y.view(-1), y * 2), lambda y: (y * 2, y.t())])
def test_delegate_output_is_not_fused_away(outputs):
    x = torch.randn(17, 33)
    results, plan = check_model(Fn(lambda x: outputs(x.exp())), (x,))
    assert "exp" in [launch.op for launch in plan.launches]
    assert "pointwise_chain" not in kernels(plan)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_broadcasting_operands(dtype):
    # The consumer's other operand broadcasts (w over rows), and the running value does (a column
    # recomputed for every element of the row).
    x, w, col = torch.randn(17, 33), torch.randn(33), torch.randn(17, 1)
    fn = Fn(lambda x, w, col: ((x.exp() * w - 1.0), torch.sigmoid(col + 0.5) * x))
    _, plan = check_low(fn, (x, w, col), dtype)
    assert kernels(plan) == ["pointwise_chain", "pointwise_chain"]
    assert chains(plan) == [["exp", "mul", "sub"], ["add", "sigmoid", "mul"]]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_running_value_as_second_operand(dtype):
    # c - r, c / r, 2 ** r, 1 - r: the running value is the right operand (SWAP); r * c needs no swap.
    x, y = torch.randn(17, 33), torch.randn(17, 33)
    fn = Fn(lambda x, y: (y - x.sin(), y / (x.abs() + 1), 2.0 ** x.cos(), 1.0 - x.tanh(), y * x.exp()))
    _, plan = check_low(fn, (x, y), dtype)
    swaps = [(chain_ops(launch)[-1], launch.constexprs[f"SWAP{len(chain_ops(launch)) - 1}"].value)
             for launch in plan.launches]
    assert swaps == [("sub", True), ("div", True), ("pow", True), ("sub", True), ("mul", False)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scalar_operands_and_chain_limit(dtype):
    # Five ops with scalar operands: the first four fuse (MAX_CHAIN), the fifth is launched alone.
    x = torch.randn(5, 129)
    _, plan = check_low(Fn(lambda x: ((((x * 3) + 2) / 4) - 0.5) * 1.5), (x,), dtype)
    assert kernels(plan) == ["pointwise_chain", "pointwise"]
    assert chains(plan) == [["mul", "add", "div", "sub"]]
    c = {k: v.value for k, v in plan.launches[0].constexprs.items()}
    assert [c[f"IS_SCALAR{k}"] for k in range(5)] == [False, True, True, True, True]


def test_strided_producer_operands():
    # A transpose and a slice feed the producer; the chain walks them in place.
    a, b = torch.randn(33, 17), torch.randn(17, 40)
    _, plan = check_model(Fn(lambda a, b: (a.t() * b[:, 3:36]).relu() + 1), (a, b))
    assert chains(plan) == [["mul", "relu", "add"]]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_consumer_reading_through_a_reshape(dtype):
    # positions.float()[:, None] * inv_freq: the cast's result read as [T, 1] by the product; a sum
    # read as [2, 2, 6] (its broadcast operand b viewed so too); a tanh of a difference read as [24]
    pos, inv = torch.arange(7) * 3, torch.randn(5).to(dtype)
    _, plan = check_model(Fn(lambda pos, inv: pos.to(inv.dtype)[:, None] * inv), (pos, inv), dtype=dtype)
    assert chains(plan) == [["copy", "mul"]], chains(plan)
    assert kernels(plan) == ["pointwise_chain"]
    a, b, c, d = torch.randn(4, 6), torch.randn(6), torch.randn(2, 1, 6), torch.randn(4, 6)
    _, plan = check_low(Fn(lambda a, b, c, d: ((a + b).view(2, 2, 6) * c, (a - d).tanh().reshape(24) * 2)),
                        (a, b, c, d), dtype)
    assert chains(plan) == [["add", "mul"], ["sub", "tanh", "mul"]]


def test_a_reshape_an_operand_cannot_follow_is_not_fused():
    # (a + bt) with bt a transpose, (a + w) with w broadcast over rows: viewed as [24] their walks
    # have no strides; two launches each
    a, b, w = torch.randn(4, 6), torch.randn(6, 4), torch.randn(6)
    for fn in (lambda a, b, w: (a + b.t()).reshape(24) * 2, lambda a, b, w: (a + w).reshape(24) * 2):
        _, plan = check_model(Fn(fn), (a, b, w))
        assert kernels(plan) == ["pointwise", "pointwise"]
    # a transposed read of the sum is a permutation: the operands are read transposed too, one launch
    _, plan = check_model(Fn(lambda a, b, w: (a + b.t()).t() * 2), (a, b, w))
    assert chains(plan) == [["add", "mul"]] and len(plan.launches) == 1


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_consumer_reading_through_a_permutation(dtype):
    """ConvNeXt's block tail: ``x + (y * gamma).permute(0, 3, 1, 2)``, y channels-last; the scale's
    operands are read in the residual's order, one launch."""
    y, gamma, x = torch.randn(2, 3, 5, 8), torch.randn(8), torch.randn(2, 8, 3, 5)
    _, plan = check_low(Fn(lambda y, gamma, x: x + (y * gamma).permute(0, 3, 1, 2)), (y, gamma, x), dtype)
    assert chains(plan) == [["mul", "add"]] and len(plan.launches) == 1


class PermutedTail(torch.nn.Module):
    def forward(self, y, gamma, x):
        return x + (y * gamma).permute(0, 3, 1, 2)


def test_a_consumer_reading_through_a_permutation_of_dynamic_sizes():
    batch, rows = Dim("batch", max=4), Dim("rows", min=2, max=9)
    calls = [(torch.randn(n, r, 5, 8), torch.randn(8), torch.randn(n, 8, r, 5)) for n, r in ((2, 3), (1, 9), (4, 2))]
    lowered, _ = check_dynamic(PermutedTail(), calls, {"y": {0: batch, 1: rows}, "gamma": None,
                                                       "x": {0: batch, 2: rows}})
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise_chain"]


def test_a_clone_of_a_temporary_is_the_temporary():
    # (x * 2).clone() + 1: the clone launches nothing, and the chain fuses across it
    x = torch.randn(5, 7)
    _, plan = check_model(Fn(lambda x: (x * 2).clone() + 1), (x,))
    assert chains(plan) == [["mul", "add"]] and len(plan.launches) == 1
    # a clone of a delegate input copies (fused into its consumer); a clone of a transposed temporary
    # reads the temporary's operands transposed (one launch with it)
    _, plan = check_model(Fn(lambda x: (x.clone() * 3, (x * 2).t().clone() + 1)), (x,))
    assert [launch.op for launch in plan.launches] == ["clone+mul", "mul_1+clone_1+add"]


def test_a_clone_of_state_keeps_the_value_before_its_update():
    def fn(buf, x):
        old = buf.clone()
        buf.add_(x)
        return old * 1

    model = Buffered(fn, torch.randn(4, 6))
    lowered = _lower(model, (torch.ones(4, 6),))
    method = lowered.load().load_method("forward")
    for step in range(3):
        x = torch.full((4, 6), float(step + 1))
        torch.testing.assert_close(method(x), model(x))


# --- what must not fuse: intermediates whose dtype changes the result -----------------------------
def test_comparison_feeding_arithmetic_is_not_fused():
    x, y = torch.randn(17, 33), torch.randn(17, 33)
    _, plan = check_model(Fn(lambda x, y: (x > 0).float() * y), (x, y))
    assert [(launch.kernel, launch.op) for launch in plan.launches] == [
        ("pointwise", "gt"), ("pointwise_chain", "_to_copy+mul")]


def test_integer_intermediates():
    i = torch.randint(-100, 100, (17, 33), dtype=torch.int32)
    # int32 wraps in eager: an int32 intermediate is not kept in int64 registers.
    _, plan = check_model(Fn(lambda i: (i * 100000) * 100000), (i,))
    assert kernels(plan) == ["pointwise", "pointwise"]
    # int64 intermediates are exact: the chain fuses, and may end in a comparison.
    _, plan = check_model(Fn(lambda i: ((i.long() + 3) * 2) > 5), (i,))
    assert chains(plan) == [["copy", "add", "mul", "gt"]]


def test_bool_chain():
    a, b = torch.randn(17, 33), torch.randn(17, 33)
    _, plan = check_model(Fn(lambda a, b: torch.logical_not((a > 0) & (b > 0)) | (a > b)), (a, b))
    assert ["bitwise_and", "logical_not", "bitwise_or"] in chains(plan)


# --- the pass on its own (no device) --------------------------------------------------------------
def _ref(index, dtype=torch.float32):
    return TRef(index, index, dtype, (4,), (1,), 0)  # desc i lives in buffer i


def _exp_mm_neg(mm_writes):
    """exp(x) -> t; an opaque launch writing ``mm_writes``; neg(t) -> u."""
    x, t, m, u = (_ref(i) for i in range(4))
    records = [LaunchRecord(Launch("pointwise", (1,), [], op="exp"), PointwiseOp("exp", t, (x,), 1, "f32")),
               LaunchRecord(Launch("matmul", (1,), [], op="mm")),
               LaunchRecord(Launch("pointwise", (1,), [], op="neg"), PointwiseOp("neg", u, (t,), 1, "f32"))]
    touched = [{0, 1}, {0, 2}, {1, 3}]
    return records, touched, [{1}, mm_writes, {3}]


def test_pass_fuses_and_says_so():
    records, touched, writes = _exp_mm_neg({2})
    result = fusion.fuse_pointwise_chains(records, touched, writes, keep={0})
    assert result.changed
    assert [launch.kernel for launch in result.launches] == ["matmul", "pointwise_chain"]
    assert result.launches[1].op == "exp+neg"
    assert result.records[0].launch is records[1].launch and result.records[1].op is None  # fused: fuses no more
    # a kept buffer (a delegate output) is never fused away
    result = fusion.fuse_pointwise_chains(records, touched, writes, keep={0, 1})
    assert not result.changed and result.records is records


def test_pass_does_not_move_a_read_across_a_write():
    # The opaque launch writes exp's input (an in-place update): exp may not move after it.
    records, touched, writes = _exp_mm_neg({0, 2})
    result = fusion.fuse_pointwise_chains(records, touched, writes, keep={0})
    assert not result.changed and result.records is records


# --- in-place updates (kernels/scatter.py): a read of the updated buffer never moves across the write
def _read_update_read(buf, pos, v):
    before = buf * 2  # reads the old cache
    buf[:, :, pos] = v  # the in-place update
    return before + 1, buf * 3  # before's consumer comes after the update; buf * 3 reads the new cache


def test_in_place_update_keeps_reads_on_their_side():
    # mul -> add would fuse into one launch at add's place, reading the cache after the update.
    model = Buffered(_read_update_read, torch.randn(1, 3, 17, 5))
    calls = [(torch.tensor([2, 5]), torch.randn(1, 3, 2, 5))]
    run = check_state_updates(model, calls, in_place={torch.ops.aten.index_put.default})
    assert run.aliases == {0: 0}
    assert [(launch.kernel, launch.op) for launch in run.plan.launches] == [
        ("pointwise", "mul"), ("scatter", "index_put"), ("pointwise", "add"), ("pointwise", "mul_1")]
    # Functional, the same chain fuses: the update writes a fresh tensor, not the cache.
    run = check_state_updates(model, calls)
    assert ("pointwise_chain", "mul+add") in [(launch.kernel, launch.op) for launch in run.plan.launches]


# --- the package decoder --------------------------------------------------------------------------
def _lower(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(torch.export.export(model, args))


def test_demo_decoder_has_fewer_launches_and_matches_eager(monkeypatch):
    model, args = demo_decoder()
    lowered = _lower(model, args)
    method = lowered.load(devices="simulated").load_method()
    with torch.no_grad():
        out, expected = method(*args), model(*args)
    assert (out - expected).abs().max().item() < 1e-3
    plans = [d.plan for m in lowered.program.methods for d in m.delegates]
    # The RMSNorms are rms_norm ops (passes/fuse_rms_norm.py) and each runs as the prologue of the
    # matmuls that read it; silu * up runs in a matmul epilogue once per layer, and so does each
    # residual add after a projection (test_epilogue.py).
    launches = [launch for plan in plans for launch in plan.launches]
    assert not any(launch.kernel == "norm" for launch in launches)
    prologues = [launch.op for launch in launches if launch.constexprs.get("PROLOGUE") and
                 launch.constexprs["PROLOGUE"].value == "rms"]
    assert len(prologues) == 2 * model.cfg.n_layers + 1  # Q/K/V, gate/up (glu_linear) per layer; the LM head
    epilogues = [ops for plan in plans for ops in map(epilogue_ops, plan.launches) if ops]
    assert sorted(epilogues) == [["add"]] * 2 * model.cfg.n_layers
    glu = [launch for launch in launches if launch.constexprs.get("GLU")]
    assert [launch.constexprs["GLU"].value for launch in glu] == ["silu"] * model.cfg.n_layers
    after = method.stats.launches_per_call

    monkeypatch.setattr(fusion, "fuse", lambda records, *_, **__: fusion.FusionResult(records, False))
    before = _lower(model, args).load(devices="simulated").load_method().stats.launches_per_call
    # per layer: prologues save 2 launches (the norms), epilogues 2 (the residual adds)
    assert after <= before - 4 * model.cfg.n_layers, (before, after)
