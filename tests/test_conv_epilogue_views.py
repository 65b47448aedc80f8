"""A convolution's epilogue may read its result through a permutation or reshape that reads each
element once (``fusion._whole_result_chain``): Segformer's and PVT-v2's Mix-FFN apply their GELU to
``dwconv(x).flatten(2).transpose(1, 2)``; the epilogue writes the chain's result in its own layout."""

from __future__ import annotations

import pytest
import torch

from harness import FLOAT_DTYPES, check_launches


class MixFFN(torch.nn.Module):
    """Segformer's Mix-FFN: linear, a depthwise 3x3 over the tokens as an image, GELU, linear."""

    def __init__(self, c=8, hidden=32, size=(5, 6)):
        super().__init__()
        self.size = size
        self.fc1, self.fc2 = torch.nn.Linear(c, hidden), torch.nn.Linear(hidden, c)
        self.dw = torch.nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.fc1(x).transpose(1, 2).view(b, -1, *self.size)
        h = self.dw(h).flatten(2).transpose(1, 2)
        return self.fc2(torch.nn.functional.gelu(h))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_the_gelu_after_a_transpose_runs_in_the_depthwise_convolution(dtype):
    torch.manual_seed(0)
    launches = check_launches(MixFFN().eval().to(dtype), (torch.randn(2, 30, 8).to(dtype),), dtype)
    kernels = [launch.kernel for launch in launches]
    assert kernels == ["matmul", "depthwise_conv", "matmul"], kernels
    assert launches[1].constexprs["EOP0"].value == "gelu"


class ChannelsLast(torch.nn.Module):
    """A convolution whose result is permuted to channels-last, then scaled per channel (an operand over
    the last dim) and activated: ConvNeXt's layout, with a chain instead of its norm."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.gamma = torch.nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x, r):
        return torch.relu(self.conv(x).permute(0, 2, 3, 1) * self.gamma + r)  # r [H, W, 1]: per pixel


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_permuted_result_with_broadcast_operands(dtype):
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 5, 7).to(dtype), torch.randn(5, 7, 1).to(dtype))
    (launch,) = check_launches(ChannelsLast().eval().to(dtype), args, dtype)
    assert launch.kernel == "conv2d" and launch.constexprs["EPILOGUE"].value == 3


class Partial(torch.nn.Module):
    """The chain reads half of the result's channels: each element is not read once, so it stays apart."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)[:, :3].permute(0, 2, 3, 1))


def test_a_chain_that_reads_part_of_the_result_stays_apart():
    launches = check_launches(Partial().eval(), (torch.randn(2, 3, 5, 7),))
    assert [launch.kernel for launch in launches] == ["conv2d", "pointwise"]
