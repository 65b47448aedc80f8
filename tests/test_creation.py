import pytest
import torch

import tritondelegate.decompose
from harness import FLOAT_DTYPES, Fn, check_model, lower_resident, plan_launches, run_delegated
from tritondelegate.kernels import creation, registry

aten = torch.ops.aten
DTYPES = FLOAT_DTYPES + (torch.int64, torch.int32, torch.bool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_and_full_like(dtype):
    x = torch.randn(17, 33)
    value = True if dtype == torch.bool else 3 if not dtype.is_floating_point else -2.75
    fn = lambda x: (  # noqa: E731
        torch.full((17, 33), value, dtype=dtype),  # full
        torch.full((), value, dtype=dtype),  # a 0-d full
        torch.full_like(x, value, dtype=dtype),  # full_like
        torch.zeros_like(x, dtype=dtype), torch.ones(5, 129, dtype=dtype),  # both become full(_like)
        x.new_zeros(1, 341, dtype=dtype),
    )
    check_model(Fn(fn), (x,))


def test_full_special_values():
    fn = lambda x: (torch.full((3, 17), float("-inf")), torch.full((2, 5), torch.finfo(torch.float16).min,  # noqa: E731
                    dtype=torch.float16), torch.full((4,), 2**40), x.new_full((3,), -7, dtype=torch.int32))
    check_model(Fn(fn), (torch.randn(3),))


def test_scalar_tensor_via_masked_fill_and_where():
    # masked_fill(Scalar) and where(cond, x, scalar) decompose to scalar_tensor + where.
    x = torch.randn(17, 33)
    fn = lambda x: (x.masked_fill(x > 0, -1e4), torch.where(x < 0, x, 0.5), torch.where(x < 0, 2, x))  # noqa: E731
    _, plan = check_model(Fn(fn), (x,))
    assert "scalar_tensor" in {launch.op for launch in plan.launches}


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_masked_fill_half(dtype):
    x = torch.randn(5, 129, dtype=dtype)
    fn = lambda x: x.masked_fill(x > 0.5, float("-inf"))  # noqa: E731
    check_model(Fn(fn), (x,))


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32))
@pytest.mark.parametrize("args", [(1,), (17,), (341,), (2, 9), (-5, 1030, 3), (20, -3, -4)])
def test_arange_int(dtype, args):
    check_model(Fn(lambda x: torch.arange(*args, dtype=dtype) + x), (torch.zeros((), dtype=dtype),))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("args", [(17,), (0.5, 3.0, 0.25), (-1.0, 1.0, 0.0625), (10.0, 0.0, -0.75)])
def test_arange_float(dtype, args):
    fn = lambda x: torch.arange(*args, dtype=dtype) * x  # noqa: E731
    check_model(Fn(fn), (torch.ones((), dtype=dtype),))


def test_arange_positions_as_in_causal_lms():
    # position ids and a causal mask: arange, comparisons, a scalar fill.
    def fn(x):
        n = x.shape[1]
        pos = torch.arange(n).unsqueeze(0).expand(x.shape[0], -1)
        i = torch.arange(n)
        mask = torch.where(i[None, :] <= i[:, None], 0.0, torch.finfo(torch.float32).min)
        return pos, mask + x[0, :, :1]

    check_model(Fn(fn), (torch.randn(2, 17, 3),))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.bool))
@pytest.mark.parametrize("diagonal", (-1, 0, 2))
def test_tril_triu(dtype, diagonal):
    # Both decompose to arange, comparisons, scalar_tensor and where.
    x = (torch.randn(17, 33) > 0) if dtype == torch.bool else torch.randn(17, 33, dtype=dtype)
    check_model(Fn(lambda x: (torch.tril(x, diagonal), torch.triu(x, diagonal))), (x,))


def test_empty_has_the_right_shape_and_launches_nothing():
    results, plan = run_delegated(Fn(lambda x: (torch.empty(3, 17, dtype=torch.float16), torch.empty_like(x))),
                                  (torch.randn(5, 2),))
    assert [(r.shape, r.dtype) for r in results] == [((3, 17), torch.float16), ((5, 2), torch.float32)]
    assert plan.launches == []


def test_fill_scalar_when_kept_whole(monkeypatch):
    # Default decomposition rewrites fill.Scalar to full_like; a caller that keeps it gets it whole.
    keep = tritondelegate.decompose.default_keep() + [aten.fill.Scalar]
    monkeypatch.setattr(tritondelegate.decompose, "default_keep", lambda: keep)
    _, plan = check_model(Fn(lambda x: (aten.fill.Scalar(x, 1.5), aten.fill.Scalar(x.t(), 7))), (torch.randn(5, 17),))
    assert {launch.op for launch in plan.launches} >= {"fill", "fill_1"}


def _node(fn, *args):
    ep = torch.export.export(Fn(fn), args)
    return next(n for n in ep.graph.nodes if n.op == "call_function")


def test_support_refusals():
    assert creation.supported(_node(lambda x: torch.full((3,), 1.0, dtype=torch.float64), torch.ones(1))) \
        == "dtype torch.float64 is not supported (supported: torch.float32, torch.float16, torch.bfloat16, " \
           "torch.int64, torch.int32, torch.bool)"
    node = _node(lambda x: torch.arange(0, 5, 1.5, dtype=torch.int64), torch.ones(1))
    assert "non-integer" in creation.supported_arange(node)
    assert creation.supported_arange(_node(lambda x: torch.arange(7), torch.ones(1))) is None


@pytest.mark.parametrize("fn, shape, launches", [
    (lambda x: x.repeat(2, 3), (3, 4), 1),
    (lambda x: x.repeat(2, 1, 3, 1), (2, 5, 3), 1),  # new leading dims
    (lambda x: x.t().repeat(1, 2), (3, 4), 1),  # a strided operand
    (lambda x: x[:, None].expand(4, 3, 2).repeat(2, 1, 1, 2), (4, 2), 1),  # an expanded one
    (lambda x: x.repeat(1, 1), (3, 4), 1),
    (lambda x: x.repeat(2, 2, 2, 2), (2, 3, 4), 4),  # too many dims for one walk: a copy per repeated dim
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.int64])
def test_repeat(fn, shape, launches, dtype):
    x = torch.randn(shape).mul(10).to(dtype)
    lowered = lower_resident(Fn(fn), (x,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise"] * launches
    assert torch.equal(lowered.load().load_method()(x), fn(x))


def test_repeat_over_too_many_dims_runs_as_its_decomposition():
    # the repeat kernel walks at most 4 dims; torch's decomposition (an expand, a copy, a view) is claimed
    x = torch.randn(2, 2)
    fn = lambda t: t.repeat(1, 2, 1, 2, 1)  # noqa: E731
    lowered = lower_resident(Fn(fn), (x,))
    assert not lowered.reports["forward"].nodes.host
    (node,) = [n for n in torch.export.export(Fn(fn), (x,)).graph.nodes if n.target is torch.ops.aten.repeat.default]
    assert "repeats over 5 dims" in registry.OPS[torch.ops.aten.repeat.default].support(node)
    torch.testing.assert_close(lowered.load().load_method()(x), fn(x))


def test_as_strided_restrides_within_its_operand():
    """Adaptive pooling to 1 x 1 on channels-last: the mean restrided (DINOv3-ConvNeXt); an as_strided
    that reads outside its operand stays on the host with the reason."""
    fn = lambda x: torch.as_strided(x.mean((-1, -2), keepdim=True), (2, 6, 1, 1), (6, 1, 6, 6)) * 2  # noqa: E731
    x = torch.randn(2, 6, 3, 3)
    lowered = lower_resident(Fn(fn), (x,))
    assert not lowered.reports["forward"].nodes.host
    torch.testing.assert_close(lowered.load().load_method()(x), fn(x))
    window = lambda x: torch.as_strided(x * 1, (3, 4), (2, 1)) + 1  # noqa: E731  overlapping rows of 4
    lowered = lower_resident(Fn(window), (torch.randn(10),))
    assert not lowered.reports["forward"].nodes.host
    torch.testing.assert_close(lowered.load().load_method()(torch.arange(10.0)), window(torch.arange(10.0)))
    beyond = lambda x: torch.as_strided(x * 1, (4, 4), (3, 1)) + 1  # noqa: E731  reaches element 12 of 10
    (host,) = lower_resident(Fn(beyond), (torch.randn(10),)).reports["forward"].nodes.host
    assert "outside its operand" in host[2]


def test_a_restride_of_size_one_dims_with_a_dynamic_batch_is_a_view():
    pool = torch.nn.AdaptiveAvgPool2d(1)
    x = torch.randn(2, 6, 3, 3).to(memory_format=torch.channels_last)
    batch = torch.export.Dim("batch", max=4)
    lowered = lower_resident(Fn(lambda t: pool(t) * 2), (x,), dynamic_shapes={"args": ({0: batch},)})
    assert not lowered.reports["forward"].nodes.host
    method = lowered.load().load_method()
    for n in (1, 3):
        y = torch.randn(n, 6, 3, 3).to(memory_format=torch.channels_last)
        torch.testing.assert_close(method(y), pool(y) * 2)


def test_unfold_is_a_strided_view_with_overlapping_windows():
    """``x.unfold(dim, size, step)`` (UniVNet's kernel predictor, PatchTST's patches): overlapping windows
    read through their strides, no copy and no host op, at a static and a dynamic length."""
    lin = torch.nn.Linear(4, 8)
    fn = lambda x: (lin(x.unfold(-1, 4, 2)), x.transpose(1, 2).unfold(1, 3, 1).sum(-1))  # noqa: E731
    x = torch.randn(2, 3, 11)
    lowered = lower_resident(Fn(fn), (x,))
    assert not lowered.reports["forward"].nodes.host
    assert [launch.kernel for launch in plan_launches(lowered)] == ["matmul", "reduce"]
    for got, want in zip(lowered.load().load_method()(x), fn(x)):
        torch.testing.assert_close(got, want)
    windows = lambda x: (x.unfold(-1, 4, 1).amax(-1), x.unfold(1, 2, 1) * 3)  # noqa: E731
    length = torch.export.Dim("length", min=6, max=40)
    lowered = lower_resident(Fn(windows), (x,), dynamic_shapes={"args": ({2: length},)})
    assert not lowered.reports["forward"].nodes.host
    method = lowered.load().load_method()
    for n in (11, 6, 29):
        y = torch.randn(2, 3, n)
        for got, want in zip(method(y), windows(y)):
            torch.testing.assert_close(got, want)
