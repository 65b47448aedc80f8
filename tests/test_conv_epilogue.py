"""A pointwise chain that alone reads a convolution's result runs in the conv kernel's epilogue
(kernels/conv.py, kernels/fusion.py): an activation, a residual add, a cast."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from harness import FLOAT_DTYPES, check_dynamic, check_launches, plan_launches

class ConvAct(torch.nn.Module):
    def __init__(self, residual=False, returned=False, groups=1):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1, groups=groups)
        self.residual, self.returned = residual, returned

    def forward(self, x, r):
        y = self.conv(x)
        out = torch.relu(y + r) if self.residual else torch.nn.functional.silu(y) * 2.0
        return (out, y) if self.returned else (out,)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_chain_runs_in_the_conv(dtype, residual):
    torch.manual_seed(0)
    model = ConvAct(residual=residual).eval().to(dtype)
    args = (torch.randn(2, 4, 5, 7).to(dtype), torch.randn(2, 8, 5, 7).to(dtype))
    (launch,) = check_launches(model, args, dtype)
    assert launch.kernel == "conv2d" and launch.constexprs["EPILOGUE"].value == 2


def test_broadcast_operand_and_depthwise():
    torch.manual_seed(0)
    model = ConvAct(residual=True, groups=4).eval()
    (launch,) = check_launches(model, (torch.randn(1, 4, 6, 6), torch.randn(1, 8, 1, 6)))  # r broadcast over h
    assert launch.constexprs["EPILOGUE"].value == 2


def test_a_result_also_returned_is_stored():
    torch.manual_seed(0)
    launches = check_launches(ConvAct(residual=True, returned=True).eval(), (torch.randn(1, 4, 5, 5), torch.randn(1, 8, 5, 5)))
    assert [launch.kernel for launch in launches] == ["conv2d", "pointwise_chain"]
    assert "EPILOGUE" not in launches[0].constexprs


def test_dynamic_batch():
    torch.manual_seed(0)
    batch = Dim("batch", max=5)
    lowered, _ = check_dynamic(ConvAct(residual=True).eval(),
                               [(torch.randn(n, 4, 5, 5), torch.randn(n, 8, 5, 5)) for n in (2, 1, 5, 3)],
                               {"x": {0: batch}, "r": {0: batch}})
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["EPILOGUE"].value == 2
