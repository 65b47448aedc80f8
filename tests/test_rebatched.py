"""A linear over the pixels of a batch of images may run as one product per image (``matmul.batch_split``,
``fusion.py``): ConvNeXt's block reads its depthwise result NCHW through a permute to NHWC, and adds its
NCHW input back after the last linear. At a batch of one image both line up with the linear's rows; at
two or more they step by image between runs of rows, so the norm's input and the residual are addressed
with a batch stride, and the norm stays the first linear's prologue and the residual the second's
epilogue."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from harness import FLOAT_DTYPES, check_dynamic, check_launches, plan_launches


class ConvNeXtBlock(torch.nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.dw = torch.nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = torch.nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)
        self.gamma = torch.nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


KERNELS = ["depthwise_conv", "matmul", "matmul"]


def _block(dtype=torch.float32):
    torch.manual_seed(0)
    return ConvNeXtBlock().eval().to(dtype)


def _kernels(launches):
    return [launch.kernel for launch in launches]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_convnext_block_is_three_launches_at_any_batch(dtype, batch):
    launches = check_launches(_block(dtype), (torch.randn(batch, 16, 6, 5).to(dtype),), dtype)
    assert _kernels(launches) == KERNELS
    first, second = launches[1:]
    assert first.constexprs["PROLOGUE"].value == "layer" and first.op.endswith("+gelu")
    assert second.op.endswith("+mul+add")
    assert [tuple(launch.grid)[1] for launch in launches[1:]] == [batch, batch]  # one product per image


def test_a_convnext_block_at_a_dynamic_batch():
    calls = [(torch.randn(n, 16, 6, 5),) for n in (2, 4, 3)]
    lowered, _ = check_dynamic(_block(), calls, {"x": {0: Dim("batch", min=2, max=4)}})
    assert _kernels(plan_launches(lowered)) == KERNELS


class Rows(torch.nn.Module):
    """A linear over tokens whose residual is read per row: one product of all rows, as before."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, r):
        return r + self.fc(x)


def test_rows_that_line_up_stay_one_product():
    launches = check_launches(Rows().eval(), (torch.randn(3, 5, 8), torch.randn(3, 5, 8)))
    (launch,) = launches
    assert tuple(launch.grid)[1] == 1 and launch.op.endswith("+add")


class Mixed(torch.nn.Module):
    """The product's rows walk (h, image, w); split by the outermost, h, each run of 10 rows holds both
    images, between which x [2, C, H, W] steps by a stride no run can address: no split fits."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return x + self.fc(y).reshape(3, 2, 5, 4).permute(1, 3, 0, 2)


def test_a_residual_no_split_can_address_stays_a_launch_of_its_own():
    launches = check_launches(Mixed().eval(), (torch.randn(2, 4, 3, 5), torch.randn(3, 10, 4)))
    assert _kernels(launches) == ["matmul", "pointwise"]
