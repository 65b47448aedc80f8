"""Padding kernels (pad.py): constant (negative pads crop), reflect and replicate over 1 to 3 dims,
strided operands, every dtype, and bounded dynamic sizes; hardtanh/ReLU6 beside them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import FLOAT_DTYPES, Fn, check_dynamic, check_model, run_delegated
from test_dynamic_kernels import calls


def _pads(x):
    return (
        F.pad(x, (1, 2)), F.pad(x, (2, 0, 1, 3), value=-1.5), F.pad(x, (-1, 2, 0, -2)), F.pad(x, (0, 0, 0, 0, 1, 1)),
        F.pad(x[0], (2, 1), mode="reflect"), F.pad(x, (3, 1, 1, 2), mode="reflect"),
        F.pad(x[0], (1, 2), mode="replicate"), F.pad(x, (2, 1, 3, 4), mode="replicate"),
        F.pad(x, (1, 1, 2, 0, 1, 1), mode="replicate"), F.pad(x, (1, 2, 1, 1, 0, 1), mode="reflect"),
        F.pad(x.transpose(2, 3)[:, 1:], (1, 1, 2, 2), mode="reflect"),  # a strided view, read in place
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_constant_reflect_and_replicate_pads(dtype):
    x = torch.randn(2, 3, 5, 6, dtype=dtype)
    _, plan = check_model(Fn(_pads), (x,), reference_args=(Fn(_pads), (x.float(),)))
    assert {launch.kernel for launch in plan.launches} == {"pad"}  # no copy before any of them


def test_integer_and_bool_pads_and_a_nan_fill():
    i = torch.randint(-9, 9, (3, 4, 5))
    fn = lambda i, x: (F.pad(i, (1, 2), value=7), F.pad(i > 0, (0, 1, 1, 0)), F.pad(x, (1, 1), value=float("nan")))  # noqa: E731
    args = (i, torch.randn(3, 4))
    results, _ = run_delegated(Fn(fn), args)
    for got, want in zip(results, fn(*args)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0)


def test_pads_with_dynamic_sizes():
    # the padded dims and the ones beside them dynamic; reflect needs n > pad over the whole range
    fn = lambda x: (F.pad(x, (1, 2, 0, 3)), F.pad(x, (2, 2), mode="reflect"),  # noqa: E731
                    F.pad(x, (1, 3, 2, 0), mode="replicate"), F.pad(x, (-1, 1)), F.relu6(x * 4))
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(2, n, n + 3)], sizes=(5, 1, 11, 7)),
                  {"args": ({1: torch.export.Dim("n", max=11), 2: torch.export.Dim("m", min=4, max=14)},)})


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hardtanh_and_relu6_fuse_into_one_launch(dtype):
    x = torch.randn(4, 129, dtype=dtype) * 4
    fn = lambda x: (F.relu6(x), F.hardtanh(x, -0.5, 0.25), F.hardtanh(x + 1))  # noqa: E731
    _, plan = check_model(Fn(fn), (x,), reference_args=(Fn(fn), (x.float(),)))
    assert len(plan.launches) == 3  # each clamp's max and min in one chain launch
