"""A max or average pooling that alone reads a convolution's result (after its epilogue) runs in the
convolution's launch (kernels/fuse_pool.py, conv.conv2d_kernel's POOL_KH, POOL_KW and POOL): the full-size
result is never stored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, check_dynamic, check_launches, plan_launches

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class ConvPool(torch.nn.Module):
    """conv (stride 1 or 2) -> [batch norm] -> [ReLU, or a residual add and ReLU] -> max pooling."""

    def __init__(self, window=(3, 2, 1), stride=2, norm=True, act="relu", ceil_mode=False, c_in=3, c_out=8):
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=not norm)
        self.bn = torch.nn.BatchNorm2d(c_out) if norm else torch.nn.Identity()
        self.window, self.act, self.ceil_mode = window, act, ceil_mode

    def forward(self, x, r=None):
        y = self.bn(self.conv(x))
        if self.act == "relu":
            y = torch.relu(y)
        elif self.act == "residual":
            y = torch.relu(y + r)
        return F.max_pool2d(y, *self.window, ceil_mode=self.ceil_mode)


def _model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = ConvPool(**kw).eval()
    if isinstance(model.bn, torch.nn.BatchNorm2d):  # statistics that move the values off zero
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.data.uniform_(0.5, 1.5)
    return model.to(dtype)


def _pooled(launches) -> list:
    return [(launch.kernel, launch.constexprs.get("POOL_KH") and launch.constexprs["POOL_KH"].value)
            for launch in launches]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("window,stride,ceil_mode", [
    ((3, 2, 1), 2, False),   # ResNet's stem: overlapping windows over a stride-2 conv
    ((2, 2, 0), 1, False),   # VGG's stage: windows that do not overlap
    ((3, 2, 0), 1, True),    # ceil mode: the last window hangs past the conv's output
    ((3, 1, 1), 1, False),   # stride 1: every pixel in 9 windows
    (((2, 3), (1, 2), (0, 1)), 1, False),  # a rectangular window
])
def test_the_pooling_runs_in_the_convolution(dtype, window, stride, ceil_mode):
    model = _model(dtype, window=window, stride=stride, ceil_mode=ceil_mode)
    (launch,) = check_launches(model, (torch.randn(2, 3, 11, 13).to(dtype),), dtype)
    kh = window[0] if isinstance(window[0], int) else window[0][0]
    assert launch.kernel == "conv2d" and launch.constexprs["POOL_KH"].value == kh
    assert launch.op.endswith("+max_pool2d_with_indices")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_residual_epilogue_reads_the_conv_pixels_of_each_tap(dtype):
    model = _model(dtype, act="residual", norm=False)
    args = (torch.randn(2, 3, 9, 10).to(dtype), torch.randn(2, 8, 1, 5).to(dtype))  # r broadcast over rows
    (launch,) = check_launches(model, args, dtype)
    assert launch.constexprs["POOL_KH"].value == 3 and launch.constexprs["EPILOGUE"].value == 2


class ConvAvg(torch.nn.Module):
    """A DenseNet transition's 1x1 conv (or a 3x3 one) with ReLU, then an average pooling."""

    def __init__(self, k=1, **pool):
        super().__init__()
        self.conv, self.pool = torch.nn.Conv2d(4, 6, k, padding=k // 2), pool

    def forward(self, x):
        return F.avg_pool2d(torch.relu(self.conv(x)), **self.pool)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("k,pool", [
    (1, dict(kernel_size=2)),  # DenseNet's transition
    (3, dict(kernel_size=3, stride=2, padding=1)),  # the divisor counts the padding
    (3, dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),  # it counts the real taps only
    (3, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),  # the last window hangs past the padding
    (3, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    (1, dict(kernel_size=2, divisor_override=3)),
])
def test_an_average_pooling_runs_in_the_convolution(dtype, k, pool):
    torch.manual_seed(0)
    (launch,) = check_launches(ConvAvg(k, **pool).eval().to(dtype), (torch.randn(2, 4, 11, 10).to(dtype),), dtype)
    assert launch.constexprs["POOL"].value == "avg"
    assert launch.constexprs["POOL_COUNT_PAD"].value is pool.get("count_include_pad", True)


def test_padding_never_wins_and_nan_propagates():
    model = _model(act=None, norm=False)
    model.conv.bias.data.fill_(-50.0)  # every conv output negative: a padded tap (0) must not win
    x = torch.rand(1, 3, 10, 10)
    x[0, 1, 4, 6] = float("nan")
    lowered = td.lower(torch.export.export(model, (x,)), config=RESIDENT)
    assert _pooled(plan_launches(lowered)) == [("conv2d", 3)]
    result = lowered.load().load_method("forward")(x)
    with torch.no_grad():
        expected = model(x)
    assert (expected < 0).any() and expected.isnan().any() and not expected.isnan().all()
    torch.testing.assert_close(result, expected, equal_nan=True)


def test_dynamic_batch():
    batch = Dim("batch", max=4)
    lowered, _ = check_dynamic(_model(), [(torch.randn(n, 3, 12, 12),) for n in (2, 1, 4)], {"x": {0: batch}})
    assert _pooled(plan_launches(lowered)) == [("conv2d", 3)]


class Kept(torch.nn.Module):
    """Cases where the pooling stays its own launch."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        groups = 4 if case == "depthwise" else 1
        conv = torch.nn.ConvTranspose2d if case == "transposed" else torch.nn.Conv2d
        self.conv = conv(4, 4, 3, padding=1, groups=groups)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if self.case == "indices":
            values, indices = F.max_pool2d(y, 2, return_indices=True)
            return values, indices.float()
        if self.case == "returned":
            return F.max_pool2d(y, 2), y
        if self.case == "dilated":
            return F.max_pool2d(y, 2, dilation=2)
        if self.case == "adaptive":
            return F.adaptive_avg_pool2d(y, 3)
        if self.case == "global":  # EfficientNet's pooler: a window of 8 x 9 taps, one per pixel of the map
            return F.avg_pool2d(y, 1280, ceil_mode=True)
        return F.max_pool2d(y, 2)


@pytest.mark.parametrize("case", ["indices", "returned", "dilated", "adaptive", "depthwise", "transposed", "global"])
def test_the_pooling_stays_apart_where_it_cannot_merge(case):
    launches = check_launches(Kept(case).eval(), (torch.randn(2, 4, 8, 9),))
    assert [launch.kernel for launch in launches][:2] == [
        "depthwise_conv" if case == "depthwise" else "conv2d", "pool2d"]
    assert "POOL_KH" not in launches[0].constexprs


def test_traffic_counts_the_pooled_store_and_every_tap():
    """The launch writes the pooled result only; its FLOPs are the conv's at each window tap."""
    model = _model(norm=False, act=None, window=(3, 2, 1), stride=1)
    x = torch.randn(2, 3, 12, 12)
    lowered = td.lower(torch.export.export(model, (x,)), config=RESIDENT)
    (launch,) = plan_launches(lowered)
    rows, channels = 2 * 6 * 6, 8  # pooled pixels (n, ph, pw), output channels
    assert launch.bytes_written == rows * channels * 4
    pixels = rows * 9  # each pooled pixel computes its window's 3 x 3 conv pixels
    assert launch.flops == 2 * pixels * channels * (3 * 3 * 3) + pixels * channels  # products, then the bias


def test_dynamic_image_size():
    """The pooled size follows the image's: the launch's sizes are expressions of the symbols."""
    h, w = Dim("h", min=8, max=20), Dim("w", min=8, max=20)
    calls = [(torch.randn(1, 3, *size),) for size in ((12, 12), (8, 19), (20, 9))]
    lowered, _ = check_dynamic(_model(), calls, {"x": {2: h, 3: w}})
    assert _pooled(plan_launches(lowered)) == [("conv2d", 3)]


def test_grouped_convolution():
    model = _model(norm=False, c_in=4, c_out=8)
    model.conv = torch.nn.Conv2d(4, 8, 3, 2, 1, groups=2)
    (launch,) = check_launches(model, (torch.randn(2, 4, 10, 11),))
    assert launch.grid[2] == 2 and launch.constexprs["POOL_KH"].value == 3
