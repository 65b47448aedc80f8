import pytest
import torch

from harness import FLOAT_DTYPES, Fn, check_model, export_decomposed, run_delegated
from tritondelegate.decompose import decompose
from tritondelegate.kernels import softmax as sm

COLS = (1, 17, 33, 129, 1025)


def both(dim):
    return Fn(lambda x: (torch.softmax(x, dim), torch.log_softmax(x, dim)))


def kernels(plan):
    return [launch.kernel for launch in plan.launches]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_softmax_last_dim(cols, dtype):
    x = torch.randn(5, cols, dtype=dtype) * 3
    _, plan = check_model(both(-1), (x,), reference_args=(both(-1), (x.float(),)))
    # softmax.int and log_softmax.int are kept whole: one launch each
    assert kernels(plan) == ["softmax", "softmax"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_softmax_middle_dim_of_3d_needs_no_copy(dtype):
    x = torch.randn(3, 17, 5, dtype=dtype)
    _, plan = check_model(both(1), (x,), reference_args=(both(1), (x.float(),)))
    assert kernels(plan) == ["softmax", "softmax"]


def test_softmax_of_strided_views():
    # a transpose (strided rows and columns) and a slice feed the kernel directly
    x = torch.randn(33, 17)
    fn = Fn(lambda x: (torch.softmax(x.t(), -1), torch.log_softmax(x[:, 3:], 0), torch.softmax(x.t(), 0)))
    _, plan = check_model(fn, (x,))
    assert kernels(plan) == ["softmax"] * 3


@pytest.mark.parametrize("cols", (33, 1025))
def test_online_softmax_loop(monkeypatch, cols):
    # 32-wide chunks: the two-pass path with a running max and a rescaled running sum
    monkeypatch.setattr(sm, "MAX_BLOCK_C", 32)
    x = torch.randn(4, 2, cols) * 4
    x[0, 0, : min(40, cols - 1)] = float("-inf")  # a first chunk of -inf only (masked attention)
    x[1, 1, -1] = 50.0  # the max arrives in the last chunk
    fn = Fn(lambda x, y: (*both(-1)(x), *both(1)(y)))
    check_model(fn, (x, x.transpose(1, 2).contiguous()))


def test_softmax_at_the_block_cap_loops():
    x = torch.randn(2, sm.MAX_BLOCK_C + 1, dtype=torch.float16)
    check_model(both(-1), (x,), reference_args=(both(-1), (x.float(),)))


def test_dtype_argument_and_half_to_float():
    x = torch.randn(4, 33, dtype=torch.float16)
    kept = Fn(lambda x: (torch.softmax(x, -1, dtype=torch.float32), torch.log_softmax(x, 0, dtype=torch.float32)))
    results, _ = check_model(kept, (x,), reference_args=(kept, (x.float(),)))
    assert [r.dtype for r in results] == [torch.float32] * 2
    # _softmax(x, dim, half_to_float=True): eager CPU refuses it, so judge against fp32 softmax
    raw = Fn(lambda x: (torch.ops.aten._softmax(x, -1, True), torch.ops.aten._log_softmax(x, 0, True)))
    fp32 = Fn(lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 0)))
    results, _ = check_model(raw, (x,), reference_args=(fp32, (x.float(),)))
    assert [r.dtype for r in results] == [torch.float32] * 2


def test_all_minus_inf_row_is_nan_like_eager():
    x = torch.randn(3, 9)
    x[1] = float("-inf")
    (out,), _ = run_delegated(Fn(lambda x: torch.softmax(x, -1)), (x,))
    expected = torch.softmax(x, -1)
    assert torch.isnan(out[1]).all() and torch.isnan(expected[1]).all()
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]])


def _node(fn, x, target, **export_kwargs):
    ep = decompose(torch.export.export(Fn(fn), (x,), **export_kwargs))
    return next(n for n in ep.graph.nodes if n.target == target)


def test_support_reasons():
    aten = torch.ops.aten
    node = _node(lambda x: torch.softmax(x, -1), torch.randn(2, 3, dtype=torch.float64), aten.softmax.int)
    assert "float64" in sm.supported(node)
    node = _node(lambda x: torch.softmax(x, -1), torch.randn(4, 3), aten.softmax.int,
                 dynamic_shapes=(({0: torch.export.Dim("rows")},),))
    assert sm.supported(node) is None  # a dynamic dim is the plan's business (test_dynamic_kernels.py)
    node = _node(lambda x: torch.softmax(x, -1), torch.randn(4, 3), aten.softmax.int)
    assert sm.supported(node) is None


def test_export_keeps_softmax_whole():
    ep = export_decomposed(both(-1), (torch.randn(2, 3),))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert targets == {torch.ops.aten.softmax.int, torch.ops.aten.log_softmax.int}
