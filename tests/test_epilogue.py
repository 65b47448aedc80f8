"""Matmul epilogue fusion (kernels/fusion.py, kernels/matmul.py): a pointwise chain that alone reads a
matmul's result runs on the accumulator tile before the store, and the result is never written.

Each case is compared with eager (fp16/bf16 against an fp32 reference on the same rounded weights and
inputs) and its launches are listed: a matmul launch as ("matmul", its epilogue's ops).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from harness import FLOAT_DTYPES, Buffered, Fn, check_model, check_state_updates, run_delegated
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import fusion, matmul
from tritondelegate.kernels.refs import LaunchRecord, TRef
from tritondelegate.kernels.elementwise import PointwiseOp
from tritondelegate.plan import Arg, Launch

aten = torch.ops.aten


class Linears(torch.nn.Module):
    """``fn(lin, *args)`` over linear layers ``lin[i]``, one per (in, out, bias) triple."""

    def __init__(self, fn, *features):
        super().__init__()
        self.lin = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=b) for i, o, b in features)
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.lin, *args)


def epilogue(launch):
    c = {k: v.value for k, v in launch.constexprs.items()}
    return [c[f"EOP{i}"] for i in range(c.get("EPILOGUE", 0))]


def launches(plan):
    """Each launch as (kernel, epilogue ops) for a matmul, (kernel, node) otherwise."""
    return [(launch.kernel, epilogue(launch)) if launch.kernel == "matmul" else (launch.kernel, launch.op)
            for launch in plan.launches]


def check(model, args, dtype=torch.float32):
    """``model`` in ``dtype`` through a delegate, against the same rounded weights and inputs in fp32."""
    torch.manual_seed(0)
    low = copy.deepcopy(model).to(dtype)
    low_args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    ref_args = tuple(a.float() if a.is_floating_point() else a for a in low_args)
    _, plan = check_model(low, low_args, reference_args=(copy.deepcopy(low).float(), ref_args))
    return plan


# (M, K, N) of a linear: each of 1, 17, 33, 129 in every position
SHAPES = [(1, 33, 129), (17, 129, 1), (33, 1, 17), (129, 17, 33)]
shape_ids = pytest.mark.parametrize("mkn", SHAPES, ids=lambda s: "x".join(map(str, s)))
dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)


# --- what fuses -----------------------------------------------------------------------------------
@dtypes
@shape_ids
def test_linear_bias_gelu(mkn, dtype):
    M, K, N = mkn
    plan = check(Linears(lambda lin, x: F.gelu(lin[0](x)), (K, N, True)), (torch.randn(M, K),), dtype)
    assert launches(plan) == [("matmul", ["gelu"])]
    assert plan.launches[0].constexprs["HAS_BIAS"].value


@pytest.mark.parametrize("act, op", [
    (F.silu, "silu"), (F.relu, "relu"), (torch.tanh, "tanh"), (torch.sigmoid, "sigmoid"),
    (lambda y: F.gelu(y, approximate="tanh"), "gelu_tanh")])
def test_linear_activations(act, op):
    plan = check(Linears(lambda lin, x: act(lin[0](x)), (33, 17, True)), (torch.randn(2, 17, 33),))
    assert launches(plan) == [("matmul", [op])]


@dtypes
def test_gate_up(dtype):
    # silu(gate(x)) * up(x): the chain silu -> mul starts from gate's product, so gate's matmul takes it
    # and moves after up's, reading up's result; neither gate's product nor silu's is written.
    model = Linears(lambda lin, x: F.silu(lin[0](x)) * lin[1](x), (33, 40, False), (33, 40, False))
    plan = check(model, (torch.randn(2, 17, 33),), dtype)
    assert launches(plan) == [("matmul", []), ("matmul", ["silu", "mul"])]
    assert [launch.op for launch in plan.launches] == ["linear_1", "linear+silu+mul"]


@dtypes
@shape_ids
def test_linear_residual_add(mkn, dtype):
    M, K, N = mkn
    model = Linears(lambda lin, x, r: (r + lin[0](x), lin[1](x) - r), (K, N, True), (K, N, False))
    plan = check(model, (torch.randn(M, K), torch.randn(M, N)), dtype)
    assert launches(plan) == [("matmul", ["add"]), ("matmul", ["sub"])]
    # r + t: add commutes, no swap; t - r: the product is the left operand
    assert [launch.constexprs["ESWAP0"].value for launch in plan.launches] == [False, False]


def test_running_value_as_right_operand():
    # r - t, r / t: the product is the right operand of a non-commutative op (ESWAP0)
    model = Linears(lambda lin, x, r: (r - lin[0](x), r / lin[0](x).exp()), (33, 17, False))
    plan = check(model, (torch.randn(5, 33), torch.randn(5, 17)))
    assert launches(plan) == [("matmul", ["sub"]), ("matmul", ["exp", "div"])]
    assert [launch.constexprs["ESWAP0"].value for launch in plan.launches] == [True, False]
    assert plan.launches[1].constexprs["ESWAP1"].value is True


@dtypes
def test_bmm_scale_and_mask(dtype):
    # attention scores: q @ k^T * scale + mask; the mask broadcasts over the batch and the heads
    q, k, mask = torch.randn(2, 3, 17, 16), torch.randn(2, 3, 33, 16), torch.randn(17, 33)
    plan = check(Fn(lambda q, k, m: (q @ k.transpose(-1, -2) * 0.25, q @ k.transpose(-1, -2) / 4 + m)),
                 (q, k, mask), dtype)
    assert launches(plan) == [("matmul", ["mul"]), ("matmul", ["div", "add"])]
    assert plan.launches[0].constexprs["EIS_SCALAR0"].value is True


@dtypes
def test_broadcast_operands(dtype):
    # a row (over M), a column (over N), a [1, 1] tensor and a transposed operand, in one epilogue
    row, col, one, rt = torch.randn(129), torch.randn(17, 1), torch.randn(1, 1), torch.randn(129, 17)
    model = Linears(lambda lin, x, row, col, one, rt: ((lin[0](x) * row + col) * one).relu() + rt.t(),
                    (33, 129, True))
    plan = check(model, (torch.randn(17, 33), row, col, one, rt), dtype)
    assert launches(plan) == [("matmul", ["mul", "add", "mul", "relu"]), ("pointwise", "add_1")]


def test_chain_limit_and_cast():
    # four ops and a cast back: the cast adds no step; a fifth op stays a launch of its own
    model = Linears(lambda lin, x, r: ((((lin[0](x) * 2 + 1).relu() - r).half(),
                                        (((lin[0](x) * 2 + 1) * 3 - r) / 4).relu())), (33, 17, True))
    plan = check(model, (torch.randn(5, 33), torch.randn(5, 17)))
    assert launches(plan) == [("matmul", ["mul", "add", "relu", "sub"]), ("matmul", ["mul", "add", "mul", "sub"]),
                              ("pointwise_chain", "div+relu_1")]
    assert plan.tensors[plan.launches[0].args[2].value].dtype == "float16"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_product_is_rounded_before_the_epilogue(dtype):
    # linear(x).float(): eager stores the product in fp16/bf16, then widens it; so does the epilogue
    torch.manual_seed(0)
    lin = torch.nn.Linear(129, 33).to(dtype)
    x = torch.randn(17, 129).to(dtype)
    reference = Fn(lambda x: F.linear(x, lin.weight.float(), lin.bias.float()))
    results, plan = check_model(Fn(lambda x: lin(x).float()), (x,), dtype, reference_args=(reference, (x.float(),)))
    assert launches(plan) == [("matmul", ["copy"])]
    assert results[0].dtype == torch.float32
    # every value is one of the low-precision dtype: the fp32 accumulator was rounded first
    assert torch.equal(results[0], results[0].to(dtype).float())


@dtypes
def test_fused_equals_unfused_bit_for_bit(dtype, monkeypatch):
    # The epilogue starts from the product rounded as the matmul stores it, runs the pointwise formula
    # in fp32 and rounds once at the store: what the matmul launch and then the pointwise launch do.
    torch.manual_seed(0)
    model = Linears(lambda lin, x, r: (F.gelu(lin[0](x)), r - lin[1](x)), (33, 17, True), (33, 17, False))
    args = (torch.randn(5, 33).to(dtype), torch.randn(5, 17).to(dtype))
    fused, plan = run_delegated(model.to(dtype), args)
    assert launches(plan) == [("matmul", ["gelu"]), ("matmul", ["sub"])]
    monkeypatch.setattr(fusion, "_merge_epilogues", lambda *_: {})
    unfused, plan = run_delegated(model, args)
    assert launches(plan) == [("matmul", []), ("pointwise", "gelu"), ("matmul", []), ("pointwise", "sub")]
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))


def test_comparison_result():
    torch.manual_seed(0)
    model = Linears(lambda lin, x: lin[0](x) > 0.5, (33, 17, True))
    _, plan = check_model(model, (torch.randn(5, 33),))
    assert launches(plan) == [("matmul", ["gt"])]


def test_transposed_store():
    # (a @ b) [Z, M, N] read back as [M, Z, N]: the product is stored in the consumer's layout
    a, b = torch.randn(3, 17, 16), torch.randn(3, 16, 33)
    plan = check(Fn(lambda a, b: (a @ b).view(1, 3, 17, 33).transpose(1, 2).contiguous()), (a, b))
    assert launches(plan) == [("matmul", ["copy"])]


# --- what must not fuse ---------------------------------------------------------------------------
def test_intermediate_that_is_an_output():
    for outputs in (lambda t: (t, F.gelu(t)), lambda t: (t.view(-1), t * 2)):
        plan = check(Linears(lambda lin, x: outputs(lin[0](x)), (33, 17, True)), (torch.randn(5, 33),))
        assert [kernel for kernel, _ in launches(plan)] == ["matmul", "pointwise"]
        assert epilogue(plan.launches[0]) == []


def test_intermediate_read_twice():
    # by two consumers, or twice by one op
    model = Linears(lambda lin, x: (lambda t, u: (t.sigmoid(), t * 2, u * u))(lin[0](x), lin[1](x)),
                    (33, 17, True), (33, 17, False))
    plan = check(model, (torch.randn(5, 33),))
    assert launches(plan) == [("matmul", []), ("matmul", []), ("pointwise", "sigmoid"), ("pointwise", "mul"),
                              ("pointwise", "mul_1")]


def test_consumer_layout_that_no_view_maps():
    # Two batch entries of the product transposed (z splits over two dims of the result): the clone
    # stays a launch of its own, still correct.
    a, b = torch.randn(6, 17, 16), torch.randn(6, 16, 33)
    plan = check(Fn(lambda a, b: (a @ b).view(2, 3, 17, 33).transpose(1, 2).contiguous()), (a, b))
    assert launches(plan) == [("matmul", []), ("pointwise", "clone")]
    # an operand whose rows do not merge across the batch: the linear runs as one product per batch
    # entry (matmul.batch_split), which addresses it
    r = torch.randn(17, 2, 20)
    plan = check(Linears(lambda lin, x, r: lin[0](x) + r.transpose(0, 1), (33, 20, False)), (torch.randn(2, 17, 33), r))
    assert launches(plan) == [("matmul", ["add"])] and tuple(plan.launches[0].grid)[1] == 2
    # the product broadcast over a batch: each element would be computed twice
    plan = check(Linears(lambda lin, x, r: lin[0](x) + r, (33, 20, False)),
                 (torch.randn(17, 33), torch.randn(2, 17, 20)))
    assert launches(plan) == [("matmul", []), ("pointwise", "add")]


def _read_write_read(buf, pos, v, w):
    t = buf @ w  # reads the old buffer
    buf[pos] = v  # the in-place update
    return t + 1, buf * 3  # t's consumer comes after the update


def test_matmul_read_is_not_moved_across_an_in_place_write():
    model = Buffered(_read_write_read, torch.randn(17, 5))
    calls = [(torch.tensor([2, 5]), torch.randn(2, 5), torch.randn(5, 9))]
    run = check_state_updates(model, calls, in_place={aten.index_put.default})
    assert launches(run.plan) == [("matmul", []), ("scatter", "index_put"), ("pointwise", "add"),
                                  ("pointwise", "mul")]
    run = check_state_updates(model, calls)  # functional: the update writes a fresh tensor
    assert ("matmul", ["add"]) in launches(run.plan)


def test_nothing_to_fuse_launches_no_epilogue():
    # the constexprs of a plain matmul; its epilogue slots hold stand-ins: C's pointer, 0.0, zero strides
    plan = check(Linears(lambda lin, x: lin[0](x), (33, 17, True)), (torch.randn(17, 33),))  # not GEMV
    (launch,) = plan.launches
    assert list(launch.constexprs) == ["HAS_BIAS", "DOT_UPCAST", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M",
                                       "num_warps", "num_stages"]
    a, c, slots = launch.args[0], launch.args[2], launch.args[21:41]
    assert slots == [c] * 4 + [Arg.of(0.0)] * 4 + [Arg.of(0)] * 12
    # no norm prologue: A stands in for its weight and bias
    assert launch.args[41:45] == [a, a, Arg.of(0), Arg.of(0.0)]
    # no rotary epilogue: A stands in for its pairs, tables and norm weights; one inner row, no index, zero
    # strides, no normed pair
    assert launch.args[45:60] == [a, a, a, Arg.of(1)] + [Arg.of(0)] * 7 + [Arg.of(1.0), a, Arg.of(0), Arg.of(0.0)]
    # no quantized B: A stands in for its zero and scale tables; zero strides (batch, row, group), groups of 1
    assert launch.args[60:] == [a, a, Arg.of(0), Arg.of(0), Arg.of(0), Arg.of(1)]


# --- the pass on its own (no device) --------------------------------------------------------------
def _mm_then(consumer_op, reads_written=frozenset()):
    """mm(a, b) -> t [1, 4, 4]; an opaque launch writing ``reads_written``; consumer_op(t2d, r) -> u."""
    ref = lambda i, shape, strides, buf: TRef(i, buf, torch.float32, shape, strides, 0)  # noqa: E731
    a, b = ref(0, (1, 4, 4), (0, 4, 1), 0), ref(1, (1, 4, 4), (0, 4, 1), 1)
    c, t = ref(2, (1, 4, 4), (16, 4, 1), 2), ref(3, (4, 4), (4, 1), 2)  # the product, and as the node sees it
    r, u = ref(4, (4,), (1,), 3), ref(5, (4, 4), (4, 1), 4)
    op = matmul.MatmulOp(a, b, c, c, False, 1.0, 1.0, matmul.choose_config(1, 4, 4, 4, torch.float32))
    records = [LaunchRecord(Launch("matmul", (1, 1), [], op="mm"), op), LaunchRecord(Launch("scatter", (1,), [], op="put")),
               LaunchRecord(Launch("pointwise", (1,), [], op=consumer_op), PointwiseOp(consumer_op, u, (t, r), 1, "f32"))]
    touched = [{0, 1, 2}, set(reads_written), {2, 3, 4}]
    writes = [{2}, set(reads_written), {4}]
    return records, touched, writes


def test_pass_folds_the_consumer_into_the_matmul():
    records, touched, writes = _mm_then("mul")
    result = fusion.fuse(records, touched, writes, keep={0, 1, 3, 4})
    assert result.changed
    assert [(launch.kernel, launch.op) for launch in result.launches] == [("scatter", "put"), ("matmul", "mm+mul")]
    # the product's buffer is kept (a delegate output): nothing fuses
    result = fusion.fuse(records, touched, writes, keep={0, 1, 2, 3, 4})
    assert not result.changed
    # without matmul records, only pointwise chains are fused
    assert not fusion.fuse_pointwise_chains(records, touched, writes, keep={0, 1, 3, 4}).changed


def test_pass_does_not_move_the_matmul_across_a_write_of_its_operands():
    records, touched, writes = _mm_then("mul", reads_written={1})
    assert not fusion.fuse(records, touched, writes, keep={0, 1, 3, 4}).changed


def test_epilogue_config_keeps_registers():
    # 128x128 over 8 warps: 64 accumulator elements per thread; fp16/bf16 keep it for up to two
    # operand tiles (bias included), else 128x64; fp32 (FMA dots, near the register limit) never keeps it
    big = matmul.Config(128, 128, 64, 8, num_warps=8, num_stages=4)
    tiles = lambda cfg: (cfg.block_m, cfg.block_n, cfg.num_warps)  # noqa: E731
    assert tiles(matmul.epilogue_config(big, torch.float16, 2)) == (128, 128, 8)
    assert tiles(matmul.epilogue_config(big, torch.bfloat16, 3)) == (128, 64, 8)
    assert tiles(matmul.epilogue_config(big, torch.float32, 0)) == (128, 64, 8)
    assert tiles(matmul.epilogue_config(matmul.Config(128, 64, 32, 8, 4, 4), torch.float32, 1)) == (128, 64, 8)
    small = matmul.Config(16, 32, 64, 8, num_warps=4, num_stages=4)
    assert matmul.epilogue_config(small, torch.float32, 5) == small
