"""Activations with parameters (kernels/activations.py) and activations written out as x times a
function of x (passes/fuse_activations.py): each is one pointwise op, so after a linear or a
convolution it runs in that launch's epilogue, and it matches eager in every float dtype, NaN and inf
included. The shrink and soft activations too, which torch writes out or decomposes into 2 to 5
launches (softsign, tanhshrink, hardshrink, softshrink) or kept whole but had no kernel for."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import FLOAT_DTYPES, Fn, assert_close, check_low, lower_resident, run_delegated

ACTIVATIONS = {
    "leaky_relu": lambda c: nn.LeakyReLU(0.2),
    "prelu": lambda c: nn.PReLU(c, init=0.3),
    "prelu_one": lambda c: nn.PReLU(1, init=-0.5),
    "elu": lambda c: nn.ELU(0.7),
    "selu": lambda c: nn.SELU(),
    "celu": lambda c: nn.CELU(0.5),
    "softplus": lambda c: nn.Softplus(),
    "softplus_beta": lambda c: nn.Softplus(beta=2.0, threshold=5.0),
    "mish": lambda c: nn.Mish(),
    "hardswish": lambda c: nn.Hardswish(),
}

WRITTEN_OUT = {
    "swish": lambda x: x * torch.sigmoid(x),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "gelu_erf": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_erf_mul": lambda x: x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476)),
    "hardswish_relu6": lambda x: x * F.relu6(x + 3) / 6,
}


class After(nn.Module):
    """``act(layer(x))``: the activation after a linear or a convolution."""

    def __init__(self, layer, act):
        super().__init__()
        self.layer, self.act = layer, act

    def forward(self, x):
        return self.act(self.layer(x))


def _cases(kind, act):
    torch.manual_seed(0)
    if kind == "linear":
        return After(nn.Linear(12, 8), act(8)).eval(), (torch.randn(5, 12) * 3,)
    return After(nn.Conv2d(3, 8, 3, padding=1), act(8)).eval(), (torch.randn(2, 3, 5, 6) * 3,)


def _launches(lowered) -> int:
    return sum(lowered.reports["forward"].launches.values())


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_runs_in_the_epilogue(name, kind):
    model, args = _cases(kind, ACTIVATIONS[name])
    lowered = lower_resident(model, args)
    assert _launches(lowered) == 1, lowered.summary()
    with torch.no_grad():
        torch.testing.assert_close(lowered.load().load_method()(*args), model(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_a_written_out_activation_runs_in_the_epilogue(name):
    model, args = _cases("linear", lambda c: Fn(WRITTEN_OUT[name]))
    lowered = lower_resident(model, args)
    assert _launches(lowered) == 1, lowered.summary()
    op = {"swish": "silu", "quick_gelu": "sigmoid_gate", "hardswish_relu6": "hardswish"}.get(name, "gelu")
    assert [f.split(".")[0] for f in lowered.reports["forward"].fused] == [op]
    with torch.no_grad():
        torch.testing.assert_close(lowered.load().load_method()(*args), model(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=str)
@pytest.mark.parametrize("name", [*ACTIVATIONS, *WRITTEN_OUT])
def test_half_precision(name, dtype):
    act = ACTIVATIONS.get(name) or (lambda c: Fn(WRITTEN_OUT[name]))
    model, args = _cases("linear", act)
    check_low(model, args, dtype)


def test_an_intermediate_read_elsewhere_keeps_the_pattern_computed():
    model = After(nn.Linear(12, 8), Fn(lambda x: (x * torch.sigmoid(x), torch.sigmoid(x) + 1)))
    args = (torch.randn(5, 12),)
    lowered = lower_resident(model.eval(), args)
    assert not [f for f in lowered.reports["forward"].fused if f.startswith("silu")]
    with torch.no_grad():
        for got, want in zip(lowered.load().load_method()(*args), model(*args)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardswish"])
def test_nan_and_inf_as_eager(name):
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e-8, 0.0, -0.0, 1e-8, 30.0, -30.0, 2.5])
    act = ACTIVATIONS[name](1)
    (out,), _ = run_delegated(Fn(act), (x,))
    torch.testing.assert_close(out, act(x), equal_nan=True)


# launches before: alone 1, 2, 3, 5, 1, 2; after a linear 2, 3, 4, 6, 2, 3
SHRINKS = {
    "softsign": lambda c: nn.Softsign(),
    "logsigmoid": lambda c: nn.LogSigmoid(),
    "hardshrink": lambda c: nn.Hardshrink(0.7),
    "softshrink": lambda c: nn.Softshrink(0.7),
    "tanhshrink": lambda c: nn.Tanhshrink(),
    "threshold": lambda c: nn.Threshold(0.3, -2.0),  # two steps through -inf, one launch
}

SPECIAL = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e-8, 0.0, -0.0, 1e-8, 30.0, -30.0, 0.3,
                        -0.7, 0.7, 0.71, -2.5, 2.5, 1e-3])


def _run(lowered, *args):
    with torch.no_grad():
        return lowered.load().load_method()(*args)


@pytest.mark.parametrize("name", SHRINKS)
def test_a_shrink_or_soft_activation_is_one_launch_and_none_after_a_linear_or_conv(name):
    act = SHRINKS[name](1)
    lowered = lower_resident(Fn(act), (SPECIAL,))
    assert _launches(lowered) == 1 and "on the host" not in lowered.summary(), lowered.summary()
    torch.testing.assert_close(_run(lowered, SPECIAL), act(SPECIAL), equal_nan=True, atol=1e-6, rtol=1e-6)
    for kind in ("linear", "conv"):
        model, args = _cases(kind, SHRINKS[name])
        lowered = lower_resident(model, args)
        assert _launches(lowered) == 1, lowered.summary()
        with torch.no_grad():
            torch.testing.assert_close(_run(lowered, *args), model(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=str)
def test_shrink_and_soft_activations_in_half_precision(dtype):
    torch.manual_seed(0)
    acts = [make(8) for make in SHRINKS.values()]
    model = After(nn.Linear(12, 8), Fn(lambda y: tuple(act(y) for act in acts))).eval().to(dtype)
    x = (torch.randn(5, 12) * 3).to(dtype)
    lowered = lower_resident(model, (x,))
    assert _launches(lowered) == 1 + len(SHRINKS), lowered.summary()  # each one op, though they share abs(y)
    got = _run(lowered, x)
    with torch.no_grad():
        want = model.float()(x.float())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w.to(dtype).float(), dtype)
