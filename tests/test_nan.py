"""NaN and inf through every min/max/relu/clamp path, and pow's special values, against eager.

Each op runs through one delegate on the simulated device (``harness.run_delegated``) over inputs
that hold NaN, inf, -inf and signed zeros among ordinary values, and must give eager's result: NaN
exactly where eager has NaN, the same infinities, the same finite values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import Fn, run_delegated

NAN, INF = float("nan"), float("inf")
X = torch.tensor([[NAN, INF, -INF, -0.0, 0.0, 1.5, -2.5],
                  [3.0, -7.0, NAN, 0.25, INF, -1.0, 6.5],
                  [-INF, 2.0, -3.0, 8.0, -0.5, NAN, 1.0]])
Y = torch.tensor([[1.0, NAN, 0.0, INF, -INF, 2.0, -3.0],
                  [NAN, -8.0, 1.0, 0.5, 2.0, NAN, 7.0],
                  [0.0, INF, -INF, 9.0, -0.25, 1.0, NAN]])

ELEMENTWISE = {
    "relu": lambda x, y: torch.relu(x),
    "relu6": lambda x, y: F.relu6(x),
    "hardtanh": lambda x, y: F.hardtanh(x, -0.5, 2.0),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "clamp_scalars": lambda x, y: torch.clamp(x, -1.0, 2.0),
    "clamp_min": lambda x, y: torch.clamp_min(x, 0.5),
    "clamp_max": lambda x, y: torch.clamp_max(x, 0.5),
    "clamp_tensor_bounds": lambda x, y: torch.clamp(x, min=y, max=y + 1),
    "clamp_nan_bound": lambda x, y: torch.clamp(x, min=NAN),
    "fused_add_relu": lambda x, y: torch.relu(x + y) * 2,  # a pointwise chain
    "linear_relu": lambda x, y: torch.relu(x @ y.t()),  # a GEMM epilogue
    "pow_tensor": lambda x, y: torch.pow(x, y),
    "pow_scalars": lambda x, y: (x ** 2.5, x ** (1 / 3), x ** -1, x ** 3, x ** -2, x ** 0.0),
    "pow_scalar_base": lambda x, y: (2.0 ** x, (-2.0) ** y, 0.5 ** x),
}

REDUCTIONS = {
    "amax": lambda x: (x.amax(1), x.amax(0), x.amax()),
    "amin": lambda x: (x.amin(1), x.amin(0)),
    "max_min": lambda x: (x.max(), x.min()),
    "max_dim": lambda x: tuple(x.max(1)),
    "min_dim": lambda x: tuple(x.min(0)),
    "argmax_argmin": lambda x: (x.argmax(1), x.argmin(0), x.argmax()),
    "norm_inf": lambda x: (torch.linalg.vector_norm(x, INF, 1), torch.linalg.vector_norm(x, -INF, 1)),
    "sum_mean_var": lambda x: (x.sum(1), x.mean(0), *torch.var_mean(x, 1)),
    "softmax": lambda x: (torch.softmax(x, 1), torch.log_softmax(x, 0)),
    "max_pool": lambda x: F.max_pool2d(x[None], 2, 1, return_indices=True),
}


def _check(fn, args, dtype=torch.float32):
    args = tuple(a.to(dtype) for a in args)
    results, _ = run_delegated(Fn(fn), args)
    expected = torch.utils._pytree.tree_leaves(fn(*args))
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        # exact for max/min/clamp paths; pow and the reductions within fp32 rounding
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_pointwise_nan_and_inf_as_eager(name):
    _check(ELEMENTWISE[name], (X, Y))


@pytest.mark.parametrize("name", ["relu", "maximum", "clamp_tensor_bounds", "hardtanh"])
def test_pointwise_nan_and_inf_half(name):
    _check(ELEMENTWISE[name], (X, Y), torch.float16)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_nan_and_inf_as_eager(name):
    _check(REDUCTIONS[name], (X,))


def test_pow_of_negative_bases_and_signed_zero():
    # a negative base with a non-integer exponent is NaN; (-0) ** -1 is -inf; odd powers keep the sign
    base = torch.tensor([-2.0, -8.0, -0.0, 0.0, -0.0, -3.0, -1.0, -1.0, 1.0, NAN])
    exponent = torch.tensor([2.5, 1 / 3, -1.0, -1.0, -2.0, 3.0, INF, -INF, NAN, 0.0])
    (got,), _ = run_delegated(Fn(torch.pow), (base, exponent))
    expected = torch.pow(base, exponent)
    torch.testing.assert_close(got, expected, equal_nan=True)
    signed = ~expected.isnan()
    assert torch.equal(torch.signbit(got[signed]), torch.signbit(expected[signed]))  # -inf, -27: not +inf, +27


def test_var_mean_over_an_empty_dim_gives_nan():
    x = torch.randn(3, 0)
    results, _ = run_delegated(Fn(lambda x: torch.var_mean(x, 1)), (x,))
    var, mean = torch.var_mean(x, 1)
    assert results[0].isnan().all() and results[1].isnan().all() and var.isnan().all() and mean.isnan().all()
