"""Row kernels with their pointwise neighbours (kernels/fuse_rows.py): the chain that alone feeds a norm
or softmax runs as its prologue, the chain that alone reads its result as its epilogue.

Each case is compared with eager (fp16/bf16 against an fp32 reference on the same rounded inputs and
weights) and its launches are listed as (kernel, the nodes it computes).
"""


import pytest
import torch

import tritondelegate as td
from harness import (FLOAT_DTYPES, Buffered, Fn, assert_close, check_dynamic, check_low, check_state_updates,
                     plan_launches)
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import norm, softmax

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)


class Norm(torch.nn.Module):
    """``fn(norm, *args)`` with a LayerNorm (or RMSNorm) over ``dim`` with random affine parameters."""

    def __init__(self, fn, dim, rms=False, affine=True):
        super().__init__()
        layer = torch.nn.RMSNorm if rms else torch.nn.LayerNorm
        self.norm = layer(dim, elementwise_affine=affine)
        with torch.no_grad():
            for p in self.norm.parameters():
                p.copy_(torch.randn_like(p))
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.norm, *args)


def launches(plan):
    return [(launch.kernel, launch.op) for launch in plan.launches]


def check(model, args, dtype=torch.float32):
    """``model`` in ``dtype`` against fp32 on the same rounded values (``harness.check_low``): the plan."""
    return check_low(model, args, dtype, tolerance=dtype)[1]


@pytest.fixture
def two_pass(monkeypatch):
    """Rows longer than 32 columns take the kernels' two-pass loop."""
    monkeypatch.setattr(norm, "MAX_BLOCK_C", 32)
    monkeypatch.setattr(softmax, "MAX_BLOCK_C", 32)


# --- prologues ------------------------------------------------------------------------------------
@dtypes
@pytest.mark.parametrize("shape", [(3, 5, 33), (1, 17, 1), (2, 129)], ids=str)
def test_embedding_sums_into_layer_norm(shape, dtype):
    """BERT's embeddings: word + token type + position (broadcast over the batch) -> LayerNorm."""
    torch.manual_seed(0)
    pos = torch.randn(shape[-2:]) if len(shape) == 3 else torch.randn(shape[-1])
    model = Norm(lambda n, a, b, p: n(a + b + p), shape[-1])
    plan = check(model, (torch.randn(shape), torch.randn(shape), pos), dtype)
    assert launches(plan) == [("norm", "add+add_1+layer_norm")]


@dtypes
def test_prologue_two_passes(two_pass, dtype):
    """A row of 45 columns read twice (statistics, then normalize): the chain runs in both passes."""
    torch.manual_seed(0)
    for rms in (False, True):
        model = Norm(lambda n, x, r: n(x * 0.5 + r), 45, rms=rms)
        plan = check(model, (torch.randn(3, 7, 45), torch.randn(7, 45)), dtype)
        assert [k for k, _ in launches(plan)] == ["norm"]
        assert not plan.launches[0].constexprs["ONE_PASS"].value


@dtypes
def test_softmax_prologue_scale_and_mask(dtype):
    """A scale and an additive mask broadcast over batch and heads, into a standalone softmax."""
    torch.manual_seed(0)
    mask = torch.randn(1, 1, 9, 13)
    plan = check(Fn(lambda s, m: torch.softmax(s * 0.125 + m, -1)), (torch.randn(2, 3, 9, 13), mask), dtype)
    assert launches(plan) == [("softmax", "mul+add+softmax")]


def test_softmax_over_a_middle_dim_two_passes(two_pass):
    """Softmax over dim 1 (strided columns) of a chain, rows longer than one chunk."""
    torch.manual_seed(0)
    plan = check(Fn(lambda x, y: torch.log_softmax(x - y, 1)), (torch.randn(2, 70, 3), torch.randn(70, 1)))
    assert launches(plan) == [("softmax", "sub+log_softmax")]


# --- epilogues ------------------------------------------------------------------------------------
@dtypes
@pytest.mark.parametrize("shape", [(3, 5, 33), (17, 1)], ids=str)
def test_norm_epilogue_scale_residual_cast(shape, dtype):
    """A norm's result scaled, plus a broadcast residual, cast to fp32: one launch storing fp32."""
    torch.manual_seed(0)
    model = Norm(lambda n, x, g: (n(x) * 0.5 + g).float(), shape[-1], rms=True)
    plan = check(model, (torch.randn(shape), torch.randn(shape[-1])), dtype)
    assert [k for k, _ in launches(plan)] == ["norm"]
    assert plan.launches[0].constexprs["EPILOGUE"].value == 2


@dtypes
def test_softmax_epilogue_two_passes(two_pass, dtype):
    torch.manual_seed(0)
    plan = check(Fn(lambda x, m: torch.softmax(x, -1) * m), (torch.randn(3, 5, 71), torch.randn(5, 1)), dtype)
    assert launches(plan) == [("softmax", "softmax+mul")]


def test_norm_with_prologue_and_epilogue_permuted(two_pass):
    """ConvNeXt's channels-first LayerNorm: a residual add, permuted to channels-last, normalized,
    permuted back and scaled: one launch reading x and y, storing the result."""
    torch.manual_seed(0)
    model = Norm(lambda n, x, y: n((x + y).permute(0, 2, 3, 1)).permute(0, 3, 1, 2) * 3.0, 40)
    plan = check(model, (torch.randn(2, 40, 3, 5), torch.randn(2, 40, 3, 5)))
    assert launches(plan) == [("norm", "add+layer_norm+mul")]


@dtypes
def test_one_operand_walked_two_ways(dtype):
    """r read transposed by the prologue and straight by the epilogue: one tensor, two walks."""
    torch.manual_seed(0)
    model = Norm(lambda n, x, r: n((x + r).transpose(1, 2)) * r, 33)
    plan = check(model, (torch.randn(2, 33, 33), torch.randn(2, 33, 33)), dtype)
    assert launches(plan) == [("norm", "add+layer_norm+mul")]


def test_native_layer_norm_keeps_its_statistics():
    torch.manual_seed(0)
    w, b = torch.randn(33), torch.randn(33)

    def fn(x, y):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x + y, [33], w, b, 1e-5)
        return out * 2.0, mean, rstd

    plan = check(Fn(fn), (torch.randn(5, 33), torch.randn(5, 33)))
    assert launches(plan) == [("norm", "add+native_layer_norm+mul")]
    assert plan.launches[0].constexprs["STATS"].value


# --- what must not fuse ---------------------------------------------------------------------------
def test_intermediates_that_are_outputs_stay():
    torch.manual_seed(0)
    model = Norm(lambda n, x, y: (lambda t: (n(t), t))(x + y), 33)
    plan = check(model, (torch.randn(4, 33), torch.randn(4, 33)))
    assert [k for k, _ in launches(plan)] == ["pointwise", "norm"]
    model = Norm(lambda n, x: (lambda u: (u, u * 2.0))(n(x)), 33)
    plan = check(model, (torch.randn(4, 33),))
    assert [k for k, _ in launches(plan)] == ["norm", "pointwise"]


def test_intermediates_read_twice_stay():
    torch.manual_seed(0)
    model = Norm(lambda n, x, y: (lambda t: n(t) * t)(x + y), 33)  # t read by the norm and the mul
    plan = check(model, (torch.randn(4, 33), torch.randn(4, 33)))
    assert launches(plan) == [("pointwise", "add"), ("norm", "layer_norm+mul")]  # the mul reads t once
    plan = check(Fn(lambda x: (lambda u: u * u)(torch.softmax(x, -1))), (torch.randn(4, 33),))
    assert [k for k, _ in launches(plan)] == ["softmax", "pointwise"]


def test_broadcast_result_stays():
    """An epilogue must read the result elementwise: u broadcast against a larger operand stays."""
    torch.manual_seed(0)
    plan = check(Fn(lambda x, y: torch.softmax(x, -1) + y), (torch.randn(4, 33), torch.randn(3, 4, 33)))
    assert [k for k, _ in launches(plan)] == ["softmax", "pointwise"]


def _prologue_across_update(buf, pos, v):
    t = buf * 2.0  # reads the old cache
    buf[:, :, pos] = v  # the in-place update
    return torch.softmax(t, -1), buf * 3.0


def _epilogue_across_update(buf, pos, v):
    u = torch.softmax(buf, -1)  # reads the old cache
    buf[:, :, pos] = v
    return u * 2.0, buf * 3.0


@pytest.mark.parametrize("fn, fused", [(_prologue_across_update, "mul+softmax"),
                                       (_epilogue_across_update, "softmax+mul")])
def test_in_place_update_keeps_reads_on_their_side(fn, fused):
    """A read of an updated buffer never moves across the update, into a row kernel or with one."""
    model = Buffered(fn, torch.randn(1, 3, 17, 5))
    calls = [(torch.tensor([2, 5]), torch.randn(1, 3, 2, 5))]
    run = check_state_updates(model, calls, in_place={torch.ops.aten.index_put.default})
    kernels = [launch.kernel for launch in run.plan.launches]
    assert kernels.count("pointwise") == 2 and "softmax" in kernels
    assert fused not in [launch.op for launch in run.plan.launches]
    run = check_state_updates(model, calls)  # functional: the update writes a fresh tensor, and they fuse
    assert fused in [launch.op for launch in run.plan.launches]


# --- through the public API -----------------------------------------------------------------------
def test_dynamic_rows():
    torch.manual_seed(0)
    model = Norm(lambda n, x, y: n(x + y) * 2.0, 33)
    batch = torch.export.Dim("batch", min=1, max=64)
    lowered, _ = check_dynamic(model, [(torch.randn(n, 33), torch.randn(n, 33)) for n in (5, 1, 17)],
                               (({0: batch}, {0: batch}),))
    (launch,) = plan_launches(lowered)
    assert (launch.kernel, launch.op.split("+")[:2]) == ("norm", ["add", "layer_norm"])
    assert launch.constexprs["EPILOGUE"].value == 1


def test_saved_and_loaded(tmp_path):
    """The fused launch's constexprs and arguments survive the program file."""
    torch.manual_seed(0)
    x, m = torch.randn(2, 9, 13), torch.randn(9, 13)
    lowered = td.lower(torch.export.export(Fn(lambda x, m: torch.softmax(x + m, -1) * 0.5), (x, m)))
    assert [(k.kernel, k.op) for k in plan_launches(lowered)] == [("softmax", "add+softmax+mul")]
    lowered.save(tmp_path / "rows.tdp")
    out = td.load(tmp_path / "rows.tdp").load_method("forward")(x, m)
    assert_close(out, torch.softmax(x + m, -1) * 0.5)
