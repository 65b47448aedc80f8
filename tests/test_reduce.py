import math

import pytest
import torch

from harness import FLOAT_DTYPES, Fn, check_model, run_delegated
from tritondelegate.decompose import decompose
from tritondelegate.kernels import reduce as red

COLS = (1, 17, 33, 129, 1025)


def check(fn, *args, scale=1.0):
    """fp16/bf16 inputs are judged against fp32 math on the same (rounded) values."""
    return check_model(Fn(fn), args, scale=scale, reference_args=(Fn(fn), [a.float() for a in args]))


def kernels(plan):
    return [launch.kernel for launch in plan.launches]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_last_dim(cols, dtype):
    x = torch.randn(6, cols, dtype=dtype)
    fn = lambda x: (x.sum(-1), x.mean(-1, keepdim=True), x.amax(-1), x.amin(-1),  # noqa: E731
                    x.var(-1, correction=0), x.max(-1), x.argmin(-1))
    # the sum of up to 1025 terms is judged against one fp32 rounding: widen by 2 for its accumulation
    _, plan = check(fn, x, scale=2)
    assert kernels(plan) == ["reduce"] * 7  # no copies: each op is one launch


@pytest.mark.parametrize("dims, keepdim", [((0,), False), ((1,), True), ((2,), False), ((0, 2), True),
                                           ((0, 1), False), ((1, 2), True), ((-1, -3), False), ((0, 1, 2), True)])
def test_dims_and_keepdim(dims, keepdim):
    x = torch.randn(5, 17, 9)
    fn = lambda x: (x.sum(dims, keepdim=keepdim), x.mean(dims, keepdim=keepdim),  # noqa: E731
                    x.amax(dims, keepdim=keepdim), torch.var_mean(x, dims, keepdim=keepdim, correction=2))
    _, plan = check_model(Fn(fn), (x,))
    # dims that are not one strided block (0 and 2 of 3) are made contiguous once per op
    copies = kernels(plan).count("pointwise")
    assert copies == (4 if sorted(d % 3 for d in dims) == [0, 2] else 0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_strided_input_and_column_reductions(dtype):
    # a transposed input, and sums down the columns: rows are the contiguous dim (a tall tile)
    x = torch.randn(257, 33, dtype=dtype)
    fn = lambda x: (x.t().sum(-1), x.sum(0), x[:, 3:20].mean(0), x.t().amax(0))  # noqa: E731
    _, plan = check(fn, x, scale=4)  # 257-term sums in fp16/bf16 outputs
    assert kernels(plan) == ["reduce"] * 4
    assert plan.launches[1].constexprs["BLOCK_C"].value == 32


def test_full_reductions_split_over_programs():
    # 40000 columns in one row: partial sums over 10 programs, then a second launch
    x = torch.randn(200, 200)
    fn = lambda x: (x.sum(), x.mean(), x.max(), x.min(), x.amax((0, 1)), x.abs().add(0.5).log().sum())  # noqa: E731
    _, plan = check_model(Fn(fn), (x,), scale=10)  # a 40000-term fp32 sum
    assert [launch.grid for launch in plan.launches if launch.kernel == "reduce"] == [(1, 10), (1, 1)] * 6
    # small full reductions stay one launch
    _, plan = check_model(Fn(lambda x: (x.sum(), x.mean())), (torch.randn(3, 5, 7),))
    assert len(plan.launches) == 2


def test_variance_and_std():
    x = torch.randn(4, 33, 6) * 3 + 100  # a large mean: the one-pass Welford merge stays accurate
    fn = lambda x: (x.var(1), x.std(-1), x.var((0, 2), correction=0), x.var(), torch.var_mean(x, 1),  # noqa: E731
                    x[:, :1].var(1))  # N - correction = 0: NaN like eager
    results, _ = run_delegated(Fn(fn), (x,))
    expected = torch.utils._pytree.tree_leaves(fn(x))
    for r, e in zip(results, expected):
        torch.testing.assert_close(r, e, atol=1e-3, rtol=1e-4, equal_nan=True)


def test_max_min_with_ties_nan_and_inf():
    x = torch.randn(7, 40)
    x[0, :] = 1.0  # all ties: the first index
    x[1, 5] = x[1, 30] = 9.0  # a tie across lanes
    x[2, 7] = float("nan")  # NaN wins max and min
    x[2, 20] = float("nan")
    x[3, :] = float("-inf")
    x[4, 35] = float("inf")
    fn = lambda x: (x.max(1), x.min(1), x.argmax(1), x.argmin(-1), x.amax(1), x.amin(0),  # noqa: E731
                    x.argmax(), x[:2].argmin(keepdim=True), x.max(0, keepdim=True))
    results, _ = run_delegated(Fn(fn), (x,))
    expected = torch.utils._pytree.tree_leaves(fn(x))
    for r, e in zip(results, expected):
        assert r.dtype == e.dtype and r.shape == e.shape
        torch.testing.assert_close(r, e, equal_nan=True)


def test_integer_extremes():
    # int64 and int32 amax / amin / max / min (Phi-3 longrope's max(position_ids)), values at the
    # int64 extremes, and a long row split over programs (partials in int64).
    i = torch.randint(-50, 50, (5, 33))
    i[2, 7], i[3, 0] = 2**62, -(2**62)
    long = torch.randint(-10**12, 10**12, (2, 20000))
    fn = lambda i, long: (i.amax(1), i.amin(0), i.max(), i.min(), i.int().amax(-1), long.amax(-1),  # noqa: E731
                          long.min())
    results, plan = check_model(Fn(fn), (i, long))
    assert [r.dtype for r in results] == [torch.int64] * 4 + [torch.int32] + [torch.int64] * 2
    assert {launch.kernel for launch in plan.launches} <= {"reduce", "pointwise"}


def test_integer_sums_and_dtype_argument():
    i = torch.randint(-50, 50, (5, 33))
    x = torch.randn(5, 33, dtype=torch.float16)
    fn = lambda i, x: (i.sum(1), i.sum(), (i > 0).sum(0), i.int().sum(-1),  # noqa: E731
                       x.sum(1, dtype=torch.float32), x.mean(dtype=torch.float32), i.prod(0))
    results, _ = check_model(Fn(fn), (i, x))
    assert [r.dtype for r in results] == [torch.int64] * 4 + [torch.float32] * 2 + [torch.int64]


def test_integer_arg_extremes_compare_exactly(monkeypatch):
    """argmax / argmin / max.dim / min.dim of int64 and int32 in int64: values past 2**24 (which fp32 would
    round together) and ties keep the first index; over 32-wide chunks as well as in one tile. CLIP-style
    text pooling (``ids.int().argmax(-1)``) runs on the device."""
    big = 2 ** 40
    i = torch.randint(-big, big, (4, 70))
    i[0, 3], i[0, 50] = big + 1, big + 2  # one apart: equal in fp32
    i[1] = 7  # all ties: index 0
    i[2, 9] = i[2, 60] = big + 5  # a tie: the first
    fn = lambda i: (i.argmax(1), i.argmin(-1), i.max(1), i.min(0), i.int().argmax(-1), i.int().max(1),  # noqa: E731
                    i.argmax())
    results, plan = check_model(Fn(fn), (i,))
    assert results[0].tolist()[:3] == [50, 0, 9] and kernels(plan).count("reduce") >= 6
    monkeypatch.setattr(red, "MAX_BLOCK_C", 32)
    check_model(Fn(fn), (i,))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_prod_and_vector_norms(dtype):
    x = (torch.rand(4, 33, dtype=dtype) + 0.5)
    fn = lambda x: (x.prod(1), x.prod(), x.norm(dim=-1), torch.linalg.vector_norm(x, 1, 0),  # noqa: E731
                    torch.linalg.vector_norm(x - 1, math.inf, 1), torch.linalg.vector_norm(x - 1, -math.inf, 1),
                    x / x.norm(dim=-1, keepdim=True))
    check(fn, x, scale=2)


def test_looping_over_chunks(monkeypatch):
    # 32-wide chunks: the tile accumulators, Welford merges and arg lanes across the loop
    monkeypatch.setattr(red, "MAX_BLOCK_C", 32)
    x = torch.randn(3, 1025) + 10
    x[1, 1000] = 99.0
    x[2, 70] = float("nan")
    fn = lambda x: (x.sum(1), x.var(1), x.max(1), x.argmin(1), x.amin(1))  # noqa: E731
    results, _ = run_delegated(Fn(fn), (x,))
    for r, e in zip(results, torch.utils._pytree.tree_leaves(fn(x))):
        torch.testing.assert_close(r, e, atol=2e-3, rtol=1e-4, equal_nan=True)


def test_scalars_empty_tensors_and_scrambled_layouts():
    def run(fn, *args):
        results, plan = run_delegated(Fn(fn), args)
        for r, e in zip(results, torch.utils._pytree.tree_leaves(fn(*args))):
            torch.testing.assert_close(r, e, equal_nan=True)
        return kernels(plan)

    run(lambda x: (x.sum(), x.sum(0), x.mean(), x.amax(), x.argmax(), x.var(correction=0)), torch.tensor(2.5))
    # no columns: the identity of the reduction (mean: NaN); no rows: nothing to launch
    assert run(lambda x: (x.sum(-1), x.mean(-1), x.prod(-1), x.sum(0)), torch.randn(5, 0)) == ["reduce"] * 3
    # a 5-D permutation: three strided row dims suffice for sum and amax; softmax's output walks
    # the same rows in another order, so its input is copied first
    x = torch.randn(2, 3, 4, 5, 6)
    fn = lambda x: (x.permute(4, 2, 0, 3, 1).sum(2), x.permute(4, 2, 0, 3, 1).amax((1, 3)),  # noqa: E731
                    x.permute(4, 2, 0, 3, 1).softmax(2))
    assert run(fn, x) == ["reduce", "reduce", "pointwise", "softmax"]


def _node(fn, x, target, **kwargs):
    ep = decompose(torch.export.export(Fn(fn), (x,), **kwargs))
    return next(n for n in ep.graph.nodes if n.target == target)


def test_support_reasons():
    aten = torch.ops.aten
    assert "int64" in red.supported_float(_node(lambda x: x.amax(0), torch.arange(6), aten.amax.default))
    assert red.supported_extreme(_node(lambda x: x.amax(0), torch.arange(6), aten.amax.default)) is None
    assert "bool" in red.supported_extreme(_node(lambda x: x.amax(0), torch.arange(6) > 2, aten.amax.default))
    assert red.supported_sum(_node(lambda x: x.sum(0), torch.arange(6), aten.sum.dim_IntList)) is None
    x = torch.randn(3, 4)
    assert "float64" in red.supported_sum(_node(lambda x: x.sum(0, dtype=torch.float64), x, aten.sum.dim_IntList))
    assert "order 3" in red.supported_norm(_node(lambda x: x.norm(3, dim=0), x, aten.linalg_vector_norm.default))
    dyn = _node(lambda x: x.sum(-1), x, aten.sum.dim_IntList, dynamic_shapes=(({0: torch.export.Dim("rows")},),))
    assert red.supported_sum(dyn) is None  # a dynamic dim is the plan's business (test_dynamic_kernels.py)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64, torch.bool))
def test_any_and_all_over_dims_keepdim_and_nothing(dtype):
    """T5's fp16 overflow guard (``isinf(h).any()``) and friends: True where some (every) element is
    nonzero; over no element any is False and all is True."""
    x = torch.randint(0, 3, (5, 7)).to(dtype)
    x[3] = 0
    if dtype.is_floating_point:
        x[1, 2], x[4, 1] = float("inf"), float("nan")  # NaN is nonzero
    empty = torch.zeros(0, 3, dtype=dtype)
    fn = lambda x, e: (x.any(), x.all(), x.any(1), x.all(0, keepdim=True), x.any((0, 1)),  # noqa: E731
                       e.any(0), e.all(0), e.any(), e.all(), torch.isinf(x).any(-1), torch.isnan(x))
    got, _ = run_delegated(Fn(fn), (x, empty))
    for g, e in zip(got, fn(x, empty)):
        assert torch.equal(g, e)
