"""A 1x1 convolution computes its input where it reads it (kernels/fuse_conv1x1.py, ``conv1x1``): from
the taps of the depthwise convolution that alone feeds it (with that convolution's epilogue), or from the
pointwise chain that wrote it for it alone. The input, as wide as an inverted residual's expanded
channels, is never stored."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, check_dynamic, check_launches, plan_launches

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class Separable(torch.nn.Module):
    """depthwise conv -> [batch norm] -> [activation] -> 1x1 conv -> [batch norm] -> [residual add]."""

    def __init__(self, c=24, c_out=16, k=3, stride=1, dilation=1, multiplier=1, norm=True, act="relu6",
                 residual=False, bias=False):
        super().__init__()
        width = c * multiplier
        self.dw = torch.nn.Conv2d(c, width, k, stride, dilation * (k // 2), dilation, groups=c, bias=bias)
        self.dw_bn = torch.nn.BatchNorm2d(width) if norm else torch.nn.Identity()
        self.pw = torch.nn.Conv2d(width, c_out, 1, bias=bias)
        self.pw_bn = torch.nn.BatchNorm2d(c_out) if norm else torch.nn.Identity()
        self.act, self.residual = act, residual

    def forward(self, x):
        t = self.dw_bn(self.dw(x))
        if self.act == "relu6":
            t = torch.nn.functional.relu6(t)
        elif self.act == "silu":
            t = torch.nn.functional.silu(t)
        y = self.pw_bn(self.pw(t))
        return y + x if self.residual else y


def _model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = Separable(**kw).eval()
    for bn in (model.dw_bn, model.pw_bn):
        if isinstance(bn, torch.nn.BatchNorm2d):  # statistics that move the values off zero
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
    return model.to(dtype)


def _fused(launches) -> list:
    return [launch.kernel for launch in launches]


def _constexpr(launch, name):
    return launch.constexprs[name].value if name in launch.constexprs else None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", [
    dict(),                                       # MobileNetV2's: 3x3, BN, ReLU6, then 1x1 and BN
    dict(stride=2),                               # a downsampling block
    dict(k=5, dilation=2, act="silu"),            # a dilated 5x5 with SiLU
    dict(k=7, c=40, c_out=72),                    # 3 K steps, a partial one; 2 program columns
    dict(multiplier=2, c=12),                     # two depthwise channels per input channel
    dict(norm=False, act=None, bias=True),        # no epilogue on either side: the biases only
    dict(c_out=24, residual=True),                # the 1x1 convolution's epilogue adds the block's input
])
def test_the_depthwise_convolution_runs_in_the_pointwise_one(dtype, case):
    model = _model(dtype, **case)
    c = case.get("c", 24)
    (launch,) = check_launches(model, (torch.randn(2, c, 7, 9).to(dtype),), dtype)
    assert launch.kernel == "conv1x1" and _constexpr(launch, "KH") == case.get("k", 3)
    # half precision keeps the batch norm as the depthwise result's epilogue (fp32 folds it into the weights)
    act = {"relu6": 2, "silu": 1, None: 0}[case.get("act", "relu6")]  # relu6: a lower and an upper clamp
    steps = act + (2 if dtype != torch.float32 and case.get("norm", True) else 0)
    assert (_constexpr(launch, "PROLOGUE") or 0) == steps
    assert launch.op.startswith("convolution") and "+convolution" in launch.op


def test_many_channels_and_rows():
    """Several program rows and columns and a K walk of many steps, against eager."""
    model = _model(c=96, c_out=80, stride=2)
    (launch,) = check_launches(model, (torch.randn(1, 96, 17, 18),))
    assert launch.kernel == "conv1x1" and tuple(launch.grid) == (2, 2)


class Conformer(torch.nn.Module):
    """A Conformer's convolution module: 1x1 conv1d -> GLU -> depthwise conv1d -> BN -> SiLU -> 1x1 conv1d."""

    def __init__(self, c=16):
        super().__init__()
        self.expand = torch.nn.Conv1d(c, 2 * c, 1)
        self.dw = torch.nn.Conv1d(c, c, 7, padding=3, groups=c)
        self.bn = torch.nn.BatchNorm1d(c)
        self.pw = torch.nn.Conv1d(c, c, 1)

    def forward(self, x):
        t = torch.nn.functional.glu(self.expand(x), dim=1)
        return self.pw(torch.nn.functional.silu(self.bn(self.dw(t))))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_one_dimensional_pair(dtype):
    torch.manual_seed(0)
    model = Conformer().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    launches = check_launches(model.to(dtype), (torch.randn(2, 16, 21).to(dtype),), dtype)
    assert _fused(launches)[-1] == "conv1x1"


def test_a_channels_last_input():
    model = _model()
    x = torch.randn(2, 24, 7, 9).to(memory_format=torch.channels_last)
    (launch,) = check_launches(model, (x,))
    assert launch.kernel == "conv1x1"


def test_dynamic_batch_and_size():
    batch, h = Dim("batch", max=4), Dim("h", min=4, max=16)
    calls = [(torch.randn(n, 24, rows, 9),) for n, rows in ((2, 7), (1, 16), (4, 4))]
    lowered, _ = check_dynamic(_model(stride=2), calls, {"x": {0: batch, 2: h}})
    assert _fused(plan_launches(lowered)) == ["conv1x1"]


class SqueezeExcite(torch.nn.Module):
    """EfficientNet's block tail: t = SiLU(BN(dwconv(x))) is read by the squeeze (a mean) and by the
    scaling, so the depthwise convolution keeps its launch; the scaling ``t * sigmoid(...)`` runs in the
    1x1 projection's."""

    def __init__(self, c=16, c_out=8, reduced=4):
        super().__init__()
        self.dw = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.reduce, self.expand = torch.nn.Conv2d(c, reduced, 1), torch.nn.Conv2d(reduced, c, 1)
        self.project = torch.nn.Conv2d(c, c_out, 1, bias=False)

    def forward(self, x):
        t = torch.nn.functional.silu(self.dw(x))
        s = torch.sigmoid(self.expand(torch.nn.functional.silu(self.reduce(t.mean((2, 3), keepdim=True)))))
        return self.project(t * s)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_squeeze_and_excitation_scale_runs_in_the_projection(dtype):
    torch.manual_seed(0)
    model = SqueezeExcite().eval().to(dtype)
    launches = check_launches(model, (torch.randn(2, 16, 7, 6).to(dtype),), dtype)
    last = launches[-1]
    assert last.kernel == "conv1x1" and not _constexpr(last, "DEPTHWISE")
    assert _constexpr(last, "PROLOGUE") == 2 and _constexpr(last, "POP1") == "mul"  # sigmoid(s), then * t
    assert "pointwise" not in _fused(launches) and "pointwise_chain" not in _fused(launches)


class Activated(torch.nn.Module):
    """A chain over x with operands that broadcast (per channel, per pixel, a scalar), then a 1x1 conv."""

    def __init__(self, c=12, c_out=20):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(c, 1, 1) + 0.5)
        self.pw = torch.nn.Conv2d(c, c_out, 1)

    def forward(self, x, pixels):
        return self.pw(torch.relu(x * self.scale + pixels) - 0.25)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_pointwise_chain_runs_in_the_convolution_that_reads_it(dtype):
    torch.manual_seed(0)
    args = (torch.randn(2, 12, 5, 7).to(dtype), torch.randn(1, 1, 5, 7).to(dtype))
    (launch,) = check_launches(Activated().eval().to(dtype), args, dtype)
    assert launch.kernel == "conv1x1" and _constexpr(launch, "PROLOGUE") == 4


def test_a_chain_of_broadcast_operands_only():
    """The chain's first operand broadcasts over the 1x1 convolution's input too: the tiles start from
    it as the chain reads it."""

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pw = torch.nn.Conv2d(6, 4, 1)

        def forward(self, rows, cols):
            return self.pw(torch.tanh(rows + cols))  # [1, 6, 5, 1] + [1, 6, 1, 7]

    (launch,) = check_launches(Outer().eval(), (torch.randn(1, 6, 5, 1), torch.randn(1, 6, 1, 7)))
    assert launch.kernel == "conv1x1" and _constexpr(launch, "PROLOGUE") == 2


class Kept(torch.nn.Module):
    """Cases where the depthwise convolution keeps its own launch."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        k, stride, groups = {"3x3": (3, 1, 1), "strided": (1, 2, 1), "grouped": (1, 1, 2)}.get(case, (1, 1, 1))
        self.pw = torch.nn.Conv2d(8, 8, k, stride, k // 2, groups=groups)

    def forward(self, x):
        if self.case == "chain_returned":
            u = torch.relu(x * 2.0)
            return self.pw(u), u
        t = torch.relu(self.dw(x))
        if self.case == "returned":
            return self.pw(t), t
        if self.case == "squeeze_excite":  # EfficientNet's: t is read by a pooling and by the scaling
            return self.pw(t * torch.sigmoid(t.mean((2, 3), keepdim=True)))
        if self.case == "read_twice":
            return self.pw(t) + t.sum()
        return self.pw(t)


@pytest.mark.parametrize("case", ["returned", "read_twice", "3x3", "strided", "grouped", "chain_returned"])
def test_the_input_stays_apart_where_it_cannot_merge(case):
    launches = check_launches(Kept(case).eval(), (torch.randn(2, 8, 6, 7),))
    kept = "pointwise_chain" if case == "chain_returned" else "depthwise_conv"
    assert "conv1x1" not in _fused(launches) and kept in _fused(launches)


def test_traffic_counts_no_depthwise_result_and_the_recomputed_taps():
    """The launch reads x, both weights and biases, and writes the 1x1 result only; its FLOPs count the
    depthwise taps once per program column."""
    model = _model(c=8, c_out=80, norm=False, act=None, bias=True)
    x = torch.randn(1, 8, 6, 6)
    lowered = td.lower(torch.export.export(model, (x,)), config=RESIDENT)
    (launch,) = plan_launches(lowered)
    pixels, columns = 36, 2  # 80 output channels in 2 columns of 64
    assert launch.bytes_written == pixels * 80 * 4
    assert launch.bytes_read == (x.numel() + 8 * 9 + 8 + 80 * 8 + 80) * 4
    assert launch.flops == pixels * 8 * (2 * 9 + 1) * columns + pixels * 80 * (2 * 8 + 1)
