"""Reductions with their pointwise neighbours (kernels/fuse_reduce.py): the chain that alone feeds a
one-pass float sum, mean, prod, max or min runs as its prologue, the chain that alone reads its result
as its epilogue, so the intermediate is never stored and one launch disappears.

Each case runs on the simulated device against eager (fp16/bf16 against an fp32 reference on the same
rounded inputs, at the dtype's tolerance), lists its launches as (kernel, the nodes it computes), and
counts the launches the same model takes with the reduction fusion switched off.
"""

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, Buffered, Fn, assert_close, check_dynamic, check_low, check_state_updates
from harness import plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import fuse_reduce
from tritondelegate.kernels import reduce as red

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)


def launches(plan):
    return [(launch.kernel, launch.op) for launch in plan.launches]


def check(fn, args, dtype=torch.float32):
    """``fn`` in ``dtype`` against fp32 on the same rounded values (``harness.check_low``): the plan."""
    return check_low(Fn(fn), args, dtype, tolerance=dtype)[1]


@pytest.fixture
def unfused(monkeypatch):
    """The number of launches of ``fn`` on ``args`` with no reduction fusion (and the result checked)."""

    def count(fn, args, dtype=torch.float32):
        with monkeypatch.context() as m:
            m.setattr(fuse_reduce, "reduce_launch", lambda *_: None)
            return len(check(fn, args, dtype).launches)

    return count


def chain_constexprs(launch) -> dict:
    return {k: v.value for k, v in launch.constexprs.items() if k in ("PROLOGUE", "P_ROUND", "EPILOGUE", "ROUND_TO")}


# --- epilogues ------------------------------------------------------------------------------------
@dtypes
@pytest.mark.parametrize("T, k, H", [(5, 3, 7), (1, 2, 33), (17, 4, 1), (3, 1, 9)], ids=str)
def test_moe_tail(T, k, H, dtype, unfused):
    """A Mixture-of-Experts layer's tail: the k expert rows of each token summed (a reduction over a
    middle dim), plus the residual: one launch storing the sum, never the per-token reduction."""
    torch.manual_seed(T * k + H)
    fn = lambda r, y: r + y.view(T, k, H).sum(1)  # noqa: E731
    args = (torch.randn(T, H), torch.randn(T * k, H))
    plan = check(fn, args, dtype)
    assert launches(plan) == [("reduce", "sum_1+add")]
    assert chain_constexprs(plan.launches[0]) == {"EPILOGUE": 1, "ROUND_TO": dtype_name(dtype)}
    assert unfused(fn, args, dtype) == 2


@dtypes
def test_mean_scaled_and_cast(dtype, unfused):
    """``x.mean(-1) * scale`` and a sum accumulated to fp32 then cast back: the scale and the cast run
    on the rounded mean (eager stores it so) in the reduction's launch."""
    torch.manual_seed(0)
    fn = lambda x: (x.mean(-1) * 0.75, x.sum(-1, dtype=torch.float32).to(x.dtype))  # noqa: E731
    args = (torch.randn(6, 33) * 0.25,)
    plan = check(fn, args, dtype)
    if dtype == torch.float32:  # the cast is no op
        assert launches(plan) == [("reduce", "mean+mul"), ("reduce", "sum_1")]
        assert unfused(fn, args, dtype) == 3
    else:
        assert launches(plan) == [("reduce", "mean+mul"), ("reduce", "sum_1+_to_copy")]
        assert unfused(fn, args, dtype) == 4


@dtypes
def test_broadcast_operands_per_row(dtype, unfused):
    """Epilogue operands broadcast over the rows: per position over the batch, per batch over the
    positions, and a keepdim result over dims 0 and 2 (x copied first, its kept dim first), each
    addressed by its own row strides."""
    torch.manual_seed(0)
    fn = lambda x, p, b: (x.amax(-1) + p, x.sum(1) * b[:, None],  # noqa: E731
                          (x.mean((0, 2), keepdim=True) - 1.0).abs())
    args = (torch.randn(3, 5, 9) * 0.5, torch.randn(5), torch.randn(3))
    plan = check(fn, args, dtype)
    assert launches(plan) == [("reduce", "amax+add"), ("reduce", "sum_1+mul"), ("pointwise", "mean"),
                              ("reduce", "mean+sub+abs_1")]
    assert [chain_constexprs(launch).get("EPILOGUE") for launch in plan.launches] == [1, 1, None, 2]
    assert unfused(fn, args, dtype) == 7


def test_epilogue_into_a_transposed_result():
    """The chain stores its result transposed (``(x.sum(1) + r).t()`` made contiguous by its reader)
    and reads the reduction through a transpose: the store follows the result's own row strides."""
    torch.manual_seed(0)
    plan = check(lambda x, r: (x.sum(1).t() * r).contiguous(), (torch.randn(4, 6, 5), torch.randn(5, 4)))
    assert [k for k, _ in launches(plan)] == ["reduce"]


# --- prologues ------------------------------------------------------------------------------------
@dtypes
@pytest.mark.parametrize("shape", [(4, 33), (1, 17), (2, 3, 1)], ids=str)
def test_product_summed(shape, dtype, unfused):
    """``(a * b).sum(-1)``: the product recomputed per element as the reduction reads it, rounded to
    its dtype as eager stores it."""
    torch.manual_seed(0)
    fn = lambda a, b: (a * b).sum(-1)  # noqa: E731
    args = (torch.randn(shape) * 0.5, torch.randn(shape) * 0.5)
    plan = check(fn, args, dtype)
    assert launches(plan) == [("reduce", "mul+sum_1")]
    assert chain_constexprs(plan.launches[0]) == {"PROLOGUE": 1, "P_ROUND": dtype_name(dtype)}
    assert unfused(fn, args, dtype) == 2


@dtypes
def test_upcast_squares_and_extremes(dtype, unfused):
    """``x.float().pow(2).sum(-1)`` (two ops, fp32: no rounding), a broadcast weight times x summed,
    and a shift into max, min and prod (the masked columns take each reduction's identity)."""
    torch.manual_seed(0)
    fn = lambda x, w: (x.float().pow(2).sum(-1), (x * w).sum(-1), (x - 1.0).amax(-1),  # noqa: E731
                       (x + 0.5).amin(0), (x * 0.25 + 1.0).prod(-1))
    args = (torch.randn(5, 19) * 0.5, torch.randn(19))
    plan = check(fn, args, dtype)
    assert [k for k, _ in launches(plan)] == ["reduce"] * 5
    upcast = dtype != torch.float32  # x.float() is no op in fp32
    assert chain_constexprs(plan.launches[0]) == {"PROLOGUE": 1 + upcast, "P_ROUND": "float32"}
    assert unfused(fn, args, dtype) == 10


def test_prologue_over_a_middle_dim_in_chunks(monkeypatch):
    """A sum over dim 1 (strided columns) of a chain, rows longer than one 32-wide chunk: the chain
    runs in every chunk of the loop."""
    monkeypatch.setattr(red, "MAX_BLOCK_C", 32)
    torch.manual_seed(0)
    plan = check(lambda x, y: (x - y).sum(1) * 0.5, (torch.randn(2, 70, 3) * 0.25, torch.randn(70, 1)))
    assert launches(plan) == [("reduce", "sub+sum_1+mul")]


@dtypes
def test_prologue_and_epilogue(dtype, unfused):
    """A dot product per row, scaled, plus a residual: three launches become one."""
    torch.manual_seed(0)
    fn = lambda a, b, r: (a * b).sum(-1) * 0.5 + r  # noqa: E731
    args = (torch.randn(3, 7, 17) * 0.5, torch.randn(3, 7, 17) * 0.5, torch.randn(3, 7))
    plan = check(fn, args, dtype)
    assert launches(plan) == [("reduce", "mul+sum_1+mul_1+add")]
    assert unfused(fn, args, dtype) == 3  # the mul, the reduction, the chain mul_1+add


# --- what must not fuse ---------------------------------------------------------------------------
def test_intermediates_that_are_outputs_stay():
    torch.manual_seed(0)
    x, r = torch.randn(4, 33), torch.randn(4)
    plan = check(lambda x, r: (lambda u: (u, u + r))(x.sum(-1)), (x, r))
    assert [k for k, _ in launches(plan)] == ["reduce", "pointwise"]
    plan = check(lambda x, r: (lambda t: (t.sum(-1), t))(x * 2.0), (x, r))
    assert [k for k, _ in launches(plan)] == ["pointwise", "reduce"]


def test_intermediates_read_twice_stay():
    torch.manual_seed(0)
    x, r = torch.randn(4, 33), torch.randn(4)
    plan = check(lambda x, r: (lambda u: u * (u + r))(x.sum(-1)), (x, r))  # u read by the add and the mul
    assert [k for k, _ in launches(plan)] == ["reduce", "pointwise_chain"]
    plan = check(lambda x: (lambda t: t.sum(-1, keepdim=True) * t)(x * 2.0), (x,))  # t read twice
    assert [k for k, _ in launches(plan)] == ["pointwise", "reduce", "pointwise"]


def test_broadcast_result_stays():
    """An epilogue must read the result once per row: a keepdim mean broadcast over x stays (RMSNorm's
    rsqrt(mean + eps) * x is a chain of its own)."""
    torch.manual_seed(0)
    plan = check(lambda x: x - x.mean(-1, keepdim=True), (torch.randn(4, 33),))
    assert [k for k, _ in launches(plan)] == ["reduce", "pointwise"]


def test_other_reductions_stay():
    """Variances, arg reductions, integer sums and reductions split over programs keep their chains."""
    torch.manual_seed(0)
    x, i = torch.randn(4, 33), torch.randint(-5, 5, (4, 33))
    plan = check(lambda x, i: (x.var(-1) * 2.0, x.argmax(-1) + 1, (i * 3).sum(-1) * 2,  # noqa: E731
                               (i.sum(-1) * 2).float() * 0.5), (x, i))
    assert [k for k, _ in launches(plan)] == ["reduce", "pointwise", "reduce", "pointwise", "pointwise",
                                               "reduce", "pointwise", "reduce", "pointwise", "pointwise_chain"]
    plan = check(lambda x: (x * 2.0).sum() + 1.0, (torch.randn(200, 200),))  # 40000 columns: split
    assert [k for k, _ in launches(plan)] == ["pointwise", "reduce", "reduce", "pointwise"]


def _epilogue_across_update(buf, pos, v):
    u = buf.sum(-1)  # reads the old cache
    buf[:, :, pos] = v  # the in-place update
    return u * 2.0, buf * 3.0


def _prologue_across_update(buf, pos, v):
    t = buf * 2.0  # reads the old cache
    buf[:, :, pos] = v
    return t.amax(-1), buf * 3.0


@pytest.mark.parametrize("fn, fused", [(_prologue_across_update, "mul+amax"),
                                       (_epilogue_across_update, "sum_1+mul")])
def test_in_place_update_keeps_reads_on_their_side(fn, fused):
    """A read of an updated buffer never moves across the update, into a reduction or with one."""
    model = Buffered(fn, torch.randn(1, 3, 17, 5))
    calls = [(torch.tensor([2, 5]), torch.randn(1, 3, 2, 5))]
    run = check_state_updates(model, calls, in_place={torch.ops.aten.index_put.default})
    assert fused not in [launch.op for launch in run.plan.launches]
    run = check_state_updates(model, calls)  # functional: the update writes a fresh tensor, and they fuse
    assert fused in [launch.op for launch in run.plan.launches]


# --- through the public API -----------------------------------------------------------------------
def test_dynamic_tokens():
    """The MoE tail and a scaled dot product with a bounded dynamic token count: the rows and the
    operands' row strides follow the size."""
    torch.manual_seed(0)
    fn = Fn(lambda r, y, a: (r + y.sum(1), (a * r[:, None, :4]).sum(-1) * 0.5))
    tokens = Dim("tokens", min=1, max=23)
    calls = [(torch.randn(n, 9), torch.randn(n, 3, 9), torch.randn(n, 2, 4)) for n in (5, 1, 23, 7)]
    lowered, _ = check_dynamic(fn, calls, (({0: tokens}, {0: tokens}, {0: tokens}),))
    kinds = [(launch.kernel, chain_constexprs(launch)) for launch in plan_launches(lowered)]
    assert [k for k, _ in kinds] == ["reduce", "reduce"]
    assert kinds[0][1]["EPILOGUE"] == 1 and kinds[1][1]["PROLOGUE"] == 1 and kinds[1][1]["EPILOGUE"] == 1


def test_saved_and_loaded(tmp_path):
    """The fused launch's constexprs and arguments survive the program file."""
    torch.manual_seed(0)
    r, y = torch.randn(5, 7), torch.randn(15, 7)
    fn = Fn(lambda r, y: r + y.view(5, 3, 7).sum(1))
    lowered = td.lower(torch.export.export(fn, (r, y)))
    assert [(k.kernel, k.op) for k in plan_launches(lowered)] == [("reduce", "sum_1+add")]
    lowered.save(tmp_path / "moe_tail.tdp")
    out = td.load(tmp_path / "moe_tail.tdp").load_method("forward")(r, y)
    assert_close(out, r + y.view(5, 3, 7).sum(1))
