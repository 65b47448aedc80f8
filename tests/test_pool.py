import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from harness import FLOAT_DTYPES, Fn, check_dynamic, check_model, export_decomposed, plan_launches, run_delegated
from tritondelegate.kernels import pool


def check(fn, x, dtype):
    x = x.to(dtype)
    return check_model(Fn(fn), (x,), reference_args=(Fn(fn), (x.float(),)))


MAX_POOLS = {  # returns (values, indices): the indices are compared exactly
    "k3_s2_p1": lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True),
    "k2_default_stride": lambda x: F.max_pool2d(x, 2, return_indices=True),
    "rect_dilation2": lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 1), dilation=2, return_indices=True),
    "ceil_mode": lambda x: F.max_pool2d(x, 3, 2, 0, ceil_mode=True, return_indices=True),
}


def all_of(fns):
    """One model computing every variant: one export, one launch each."""
    return lambda x: tuple(fn(x) for fn in fns.values())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 9, 9), (1, 17, 16, 7)], ids=str)
def test_max_pool2d_with_indices(shape, dtype):
    _, plan = check(all_of(MAX_POOLS), torch.randn(shape), dtype)
    assert [launch.kernel for launch in plan.launches] == ["pool2d"] * len(MAX_POOLS)


def test_max_pool2d_ties_take_the_first_maximum():
    # Small integers: every window has ties, and eager's index is the first maximum in row-major order.
    x = torch.randint(-2, 3, (2, 3, 9, 9)).float()
    check(MAX_POOLS["k3_s2_p1"], x, torch.float32)


def test_max_pool2d_nan_and_minus_inf():
    x = torch.randn(1, 2, 7, 7)
    x[0, 0, 1:4, 1:4] = float("-inf")  # a window of -inf: the first tap inside the image wins
    x[0, 1, 2, 2] = float("nan")  # NaN propagates; the last NaN of the window is its index
    x[0, 1, 2, 3] = float("nan")
    fn = lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True)  # noqa: E731
    (values, indices), _ = run_delegated(Fn(fn), (x,))
    expected_values, expected_indices = fn(x)
    assert values[0, 1, 1, 1].isnan()
    torch.testing.assert_close(values, expected_values, equal_nan=True)
    assert torch.equal(indices, expected_indices)


def test_max_pool2d_without_indices_writes_none():
    x = torch.randn(2, 3, 9, 9)
    _, plan = check(lambda x: F.max_pool2d(x, 3, 2, 1), x, torch.float32)
    assert not plan.launches[0].constexprs["WRITE_INDICES"].value


AVG_POOLS = {
    "k3_s2_p1": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "exclude_pad": lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    "ceil_mode": lambda x: F.avg_pool2d(x, (3, 2), 2, (1, 0), ceil_mode=True),
    "divisor_override": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_avg_pool2d(dtype):
    check(all_of(AVG_POOLS), torch.randn(2, 3, 9, 7), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("out_size, shape", [
    ((2, 3), (2, 3, 7, 9)),  # windows of uneven size that overlap
    ((3, 3), (1, 17, 9, 9)),
    ((5, 7), (1, 1, 16, 16)),
    ((16, 9), (1, 3, 16, 9)),  # output as large as the input: each window one pixel
], ids=str)
def test_adaptive_avg_pool2d(out_size, shape, dtype):
    check(lambda x: F.adaptive_avg_pool2d(x, out_size), torch.randn(shape), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 17, 7, 7), (1, 3, 16, 9)], ids=str)
def test_global_avg_pool(shape, dtype):
    # AdaptiveAvgPool2d((1, 1)) decomposes to mean.dim([-1, -2], keepdim=True): a reduce.py kernel.
    pool_ = torch.nn.AdaptiveAvgPool2d((1, 1))
    _, plan = check(lambda x: torch.flatten(pool_(x), 1), torch.randn(shape), dtype)
    assert [launch.op for launch in plan.launches] == ["mean"]


WINDOWS_PAST_THE_INPUT = {  # one output per dim: the taps past the padded input reach nothing
    "efficientnet_pooler": lambda x: F.avg_pool2d(x, 1280, ceil_mode=True),
    "exclude_pad": lambda x: F.avg_pool2d(x, 40, 40, 1, ceil_mode=True, count_include_pad=False),
    "include_pad": lambda x: F.avg_pool2d(x, (40, 3), (40, 1), (1, 1), ceil_mode=True),
    "max": lambda x: F.max_pool2d(x, 50, ceil_mode=True, return_indices=True),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_windows_larger_than_the_input_walk_the_input_only(dtype):
    """EfficientNet's pooler, ``AvgPool2d(1280, ceil_mode=True)`` over a 7 x 7 map: 49 taps a window, not
    1280 x 1280; eager's divisors and maxima (and indices) are kept."""
    _, plan = check(all_of(WINDOWS_PAST_THE_INPUT), torch.randn(2, 3, 7, 6), dtype)
    windows = [(launch.constexprs["KH"].value, launch.constexprs["KW"].value) for launch in plan.launches]
    assert windows == [(7, 6), (9, 8), (9, 3), (7, 6)]  # include_pad: 40 x 3 taps, 9 along the padded rows


def _node(fn, x, target):
    ep = export_decomposed(Fn(fn), (x,))
    return next(n for n in ep.graph.nodes if n.target is target)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("out_size, shape", [((3, 2), (2, 4, 7, 9)), (4, (1, 3, 9, 9)), ((5, 7), (1, 2, 5, 7))],
                         ids=str)
def test_adaptive_max_pool2d_with_indices(out_size, shape, dtype):
    # overlapping windows of unequal sizes (7 rows into 3), equal ones, and windows of one element
    _, plan = check(lambda x: F.adaptive_max_pool2d(x, out_size, return_indices=True), torch.randn(shape), dtype)
    assert [launch.kernel for launch in plan.launches] == ["pool2d"]
    assert plan.launches[0].constexprs["MODE"].value == "adaptive_max"


def test_adaptive_max_pool2d_ties_and_nan():
    x = torch.randint(-2, 3, (2, 3, 7, 9)).float()  # ties everywhere: the first maximum's index
    x[0, 1, 0, 0] = x[0, 1, 1, 2] = float("nan")  # the last NaN of a window is its index
    fn = lambda x: F.adaptive_max_pool2d(x, (3, 2), return_indices=True)  # noqa: E731
    (values, indices), _ = run_delegated(Fn(fn), (x,))
    expected_values, expected_indices = fn(x)
    torch.testing.assert_close(values, expected_values, equal_nan=True)
    assert torch.equal(indices, expected_indices)


def test_unbatched_input():
    fns = {"max": MAX_POOLS["k3_s2_p1"], "avg": AVG_POOLS["exclude_pad"],
           "adaptive": lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
           "adaptive_max": lambda x: F.adaptive_max_pool2d(x, 2)}
    check(all_of(fns), torch.randn(3, 9, 7), torch.float32)


def test_pool_of_other_dtypes_is_refused():
    node = _node(lambda x: F.avg_pool2d(x, 2), torch.randn(1, 3, 8, 8, dtype=torch.float64),
                 torch.ops.aten.avg_pool2d.default)
    assert "dtype torch.float64 is not supported" in pool.supported(node)


# --- 3-D --------------------------------------------------------------------------------------------
MAX_POOLS_3D = {  # returns (values, indices): the indices ((id * H + ih) * W + iw) are compared exactly
    "k3_s2_p1": lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True),
    "k2_default_stride": lambda x: F.max_pool3d(x, 2, return_indices=True),
    "rect_dilation2": lambda x: F.max_pool3d(x, (2, 2, 3), (1, 2, 2), (1, 0, 1), dilation=(2, 1, 2),
                                             return_indices=True),
    "ceil_mode": lambda x: F.max_pool3d(x, 3, 2, 0, ceil_mode=True, return_indices=True),
    "spatial_only_k133": lambda x: F.max_pool3d(x, (1, 3, 3), (1, 2, 2), (0, 1, 1), return_indices=True),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5, 6, 7), (1, 17, 4, 9, 5)], ids=str)
def test_max_pool3d_with_indices(shape, dtype):
    _, plan = check(all_of(MAX_POOLS_3D), torch.randn(shape), dtype)
    assert [launch.kernel for launch in plan.launches] == ["pool2d"] * len(MAX_POOLS_3D)
    assert all(launch.constexprs["DEPTH"].value for launch in plan.launches)


def test_max_pool3d_ties_take_the_first_maximum():
    # Small integers: every window has ties, and eager's index is the first maximum in (d, h, w) order.
    x = torch.randint(-2, 3, (2, 3, 5, 7, 6)).float()
    check(all_of({k: MAX_POOLS_3D[k] for k in ("k3_s2_p1", "rect_dilation2")}), x, torch.float32)


def test_max_pool3d_nan_and_minus_inf():
    x = torch.randn(1, 2, 5, 5, 5)
    x[0, 0, 0:3, 1:4, 1:4] = float("-inf")  # a window of -inf: the first tap inside the input wins
    x[0, 1, 2, 2, 2] = float("nan")  # NaN propagates; the last NaN of the window is its index
    x[0, 1, 3, 1, 2] = float("nan")
    fn = MAX_POOLS_3D["k3_s2_p1"]
    (values, indices), _ = run_delegated(Fn(fn), (x,))
    expected_values, expected_indices = fn(x)
    assert values[0, 1, 1, 1, 1].isnan()
    torch.testing.assert_close(values, expected_values, equal_nan=True)
    assert torch.equal(indices, expected_indices)


AVG_POOLS_3D = {
    "k3_s2_p1": lambda x: F.avg_pool3d(x, 3, 2, 1),
    "exclude_pad": lambda x: F.avg_pool3d(x, 3, 2, 1, count_include_pad=False),
    "ceil_mode": lambda x: F.avg_pool3d(x, (3, 2, 3), 2, (1, 0, 1), ceil_mode=True),
    "ceil_mode_exclude_pad": lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "divisor_override": lambda x: F.avg_pool3d(x, 2, divisor_override=3),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_avg_pool3d(dtype):
    _, plan = check(all_of(AVG_POOLS_3D), torch.randn(2, 3, 6, 9, 7), dtype)
    assert [launch.kernel for launch in plan.launches] == ["pool2d"] * len(AVG_POOLS_3D)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("out_size, shape", [
    ((2, 3, 2), (2, 3, 5, 7, 9)),  # windows of uneven size that overlap
    ((3, 1, 4), (1, 17, 9, 4, 4)),
    ((4, 5, 3), (1, 2, 4, 5, 3)),  # output as large as the input: each window one voxel
], ids=str)
def test_adaptive_avg_pool3d(out_size, shape, dtype):
    _, plan = check(lambda x: F.adaptive_avg_pool3d(x, out_size), torch.randn(shape), dtype)
    assert [launch.constexprs["MODE"].value for launch in plan.launches] == ["adaptive_avg"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("out_size, shape", [((2, 3, 2), (2, 4, 5, 7, 9)), (2, (1, 3, 4, 4, 4))], ids=str)
def test_adaptive_max_pool3d_with_indices(out_size, shape, dtype):
    _, plan = check(lambda x: F.adaptive_max_pool3d(x, out_size, return_indices=True), torch.randn(shape), dtype)
    assert [launch.constexprs["MODE"].value for launch in plan.launches] == ["adaptive_max"]


def test_adaptive_max_pool3d_ties_and_nan():
    x = torch.randint(-2, 3, (2, 3, 5, 7, 6)).float()  # ties everywhere: the first maximum's index
    x[0, 1, 0, 0, 0] = x[0, 1, 1, 2, 1] = float("nan")  # the last NaN of a window is its index
    fn = lambda x: F.adaptive_max_pool3d(x, (2, 3, 2), return_indices=True)  # noqa: E731
    (values, indices), _ = run_delegated(Fn(fn), (x,))
    expected_values, expected_indices = fn(x)
    torch.testing.assert_close(values, expected_values, equal_nan=True)
    assert torch.equal(indices, expected_indices)


def test_unbatched_input_3d():
    fns = {"max": MAX_POOLS_3D["k3_s2_p1"], "avg": AVG_POOLS_3D["exclude_pad"],
           "adaptive": lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)),
           "adaptive_max": lambda x: F.adaptive_max_pool3d(x, 2)}
    check(all_of(fns), torch.randn(3, 5, 7, 6), torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_local_response_norm_runs_on_the_device(dtype):
    # nn.LocalResponseNorm: an avg_pool3d of window (size, 1, 1) over the padded square viewed as
    # [N, 1, C, H, W], between pointwise ops; a dynamic batch
    torch.manual_seed(0)
    model = torch.nn.LocalResponseNorm(3, alpha=0.5, k=1.5).to(dtype)
    calls = [(torch.randn(n, 7, 5, 6).to(dtype),) for n in (2, 1, 3)]
    lowered, _ = check_dynamic(model, calls, {"input": {0: Dim("batch", max=4)}}, dtype=dtype,
                               reference=lambda x: model.float()(x.float()))
    assert "pool2d" in [launch.kernel for launch in plan_launches(lowered)]


def test_pool3d_support_checks():
    node = _node(lambda x: F.avg_pool3d(x, 2), torch.randn(1, 3, 8, 8, dtype=torch.float64),
                 torch.ops.aten.avg_pool3d.default)
    assert "dtype torch.float64 is not supported" in pool.supported_3d(node)
    node = _node(lambda x: F.avg_pool3d(x, 2), torch.randn(1, 2, 3, 4, 4), torch.ops.aten.avg_pool3d.default)
    assert pool.supported_3d(node) is None
    assert "input of rank 5 is not supported (2-D pooling" in pool.supported(node)
