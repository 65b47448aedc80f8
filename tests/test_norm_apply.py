"""A norm whose statistics another launch computes applies them in one launch (``group_norm.norm_apply``):
GroupNorm, instance norm and batch norm in training mode. Each row (n, c) computes its rstd, scale and
shift from the statistics as eager does and reads x once; the pointwise chain that alone reads the
result runs in its epilogue (a UNet's GroupNorm -> SiLU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, TOLERANCES, check_dynamic, check_launches, plan_launches

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class NormAct(torch.nn.Module):
    """norm -> SiLU (a diffusion UNet's ResNet block and VAE), optionally also returning the norm's result."""

    def __init__(self, norm, both=False):
        super().__init__()
        self.norm, self.both = norm, both

    def forward(self, x):
        y = self.norm(x)
        return (torch.nn.functional.silu(y), y) if self.both else torch.nn.functional.silu(y)


def _affine(norm, seed=0):
    torch.manual_seed(seed)
    if getattr(norm, "weight", None) is not None:
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    return norm


def _kernels(launches) -> list[str]:
    return [launch.kernel for launch in launches]


def _epilogue(launch) -> int:
    return launch.constexprs["EPILOGUE"].value if "EPILOGUE" in launch.constexprs else 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape, groups", [((2, 32, 6, 5), 8), ((1, 12, 17), 3), ((3, 6, 2, 3, 4), 6)])
def test_group_norm_and_its_activation_are_two_launches(dtype, shape, groups):
    model = NormAct(_affine(torch.nn.GroupNorm(groups, shape[1]))).eval()
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    launches = check_launches(model.to(dtype), (x,), dtype)
    assert _kernels(launches) == ["reduce", "norm_apply"]
    assert _epilogue(launches[1]) == 1 and launches[1].op.endswith("+silu")


def test_a_group_norm_read_twice_keeps_its_result():
    """The norm's result is a method output and the SiLU's input: it is stored, and the SiLU stays a launch."""
    model = NormAct(_affine(torch.nn.GroupNorm(4, 16)), both=True).eval()
    launches = check_launches(model, (torch.randn(2, 16, 5, 5),))
    assert _kernels(launches) == ["reduce", "norm_apply", "pointwise"]
    assert _epilogue(launches[1]) == 0


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_over_many_rows_and_positions(affine):
    """Several program rows and columns: 64 channels (rows of 2 samples) over 40 x 40 positions."""
    model = NormAct(_affine(torch.nn.GroupNorm(16, 64, affine=affine))).eval()
    launches = check_launches(model, (torch.randn(2, 64, 40, 40) * 2 - 1,))
    assert _kernels(launches) == ["reduce", "norm_apply"] and tuple(launches[1].grid)[1] > 1


def test_group_norm_of_a_channels_last_input():
    model = _affine(torch.nn.GroupNorm(4, 8)).eval()
    x = torch.randn(2, 8, 5, 7).to(memory_format=torch.channels_last)
    launches = check_launches(model, (x,))
    assert _kernels(launches)[-1] == "norm_apply"


def test_group_norm_without_positions():
    """GroupNorm takes [N, C] too: one column a row."""
    model = _affine(torch.nn.GroupNorm(2, 6)).eval()
    launches = check_launches(model, (torch.randn(4, 6),))
    assert _kernels(launches) == ["reduce", "norm_apply"]


def test_group_norm_with_an_inf_weight_gives_eagers_nans():
    """Eager computes x * (rstd * weight) + (bias - mean * rstd * weight): opposite infinities give NaN,
    where ``(x - mean) * rstd * weight + bias`` would give an infinity."""
    model = _affine(torch.nn.GroupNorm(2, 4)).eval()
    with torch.no_grad():
        model.weight[1] = float("inf")
    x = torch.randn(2, 4, 3, 3)
    out = td.lower(torch.export.export(model, (x,)), config=RESIDENT).load().load_method()(x)
    expected = model(x)
    assert expected[:, 1].isnan().any()
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_dynamic_batch_and_size_with_the_epilogue():
    batch, h = Dim("batch", max=4), Dim("h", min=2, max=12)
    model = NormAct(_affine(torch.nn.GroupNorm(4, 8))).eval()
    calls = [(torch.randn(n, 8, rows, 5),) for n, rows in ((2, 7), (1, 12), (4, 2))]
    lowered, _ = check_dynamic(model, calls, {"x": {0: batch, 2: h}})
    assert _kernels(plan_launches(lowered)) == ["reduce", "norm_apply"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_instance_norm_with_its_activation(dtype):
    """Instance norm (style transfer, some vocoders): two statistics launches, then the apply with the
    ReLU. Export normalizes x seen as [1, N * C, *] and views the result back as [N, C, *]; the apply
    walks [N, C, *] (each row still one instance), so the ReLU after the view is its epilogue."""
    model = torch.nn.Sequential(_affine(torch.nn.InstanceNorm2d(6, affine=True)), torch.nn.ReLU()).eval()
    x = (torch.randn(2, 6, 9, 7) * 2 + 1).to(dtype)
    launches = check_launches(model.to(dtype), (x,), dtype)
    assert _kernels(launches) == ["reduce", "reduce", "norm_apply"] and _epilogue(launches[-1]) == 1


def test_training_batch_norm_applies_its_batch_statistics_in_one_launch():
    """A batch norm in training mode: per channel (not per sample) statistics, the running ones updated."""
    model = torch.nn.Sequential(_affine(torch.nn.BatchNorm2d(5, momentum=0.2)), torch.nn.SiLU()).train()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 5, 4, 6) * 2 + 0.5
    lowered = td.lower(torch.export.export(model, (x,)), config=RESIDENT)
    assert "norm_apply" in _kernels(plan_launches(lowered))
    out = lowered.load().load_method()(x)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, eager(x), atol=atol, rtol=rtol)


def test_traffic_reads_x_once_and_writes_only_the_activation():
    """The modelled bytes of the apply launch: x read once, the statistics, weight and bias, and the
    SiLU's result written; the norm's result is never stored."""
    n, c, h, w, groups = 2, 16, 8, 8, 4
    model = NormAct(_affine(torch.nn.GroupNorm(groups, c))).eval()
    lowered = td.lower(torch.export.export(model, (torch.randn(n, c, h, w),)), config=RESIDENT)
    apply = plan_launches(lowered)[-1]
    assert apply.kernel == "norm_apply"
    assert apply.bytes_read == 4 * (n * c * h * w + 2 * n * groups + 2 * c)
    assert apply.bytes_written == 4 * n * c * h * w


class PreActivation(torch.nn.Module):
    """A pre-activation bottleneck's start (BiT, ResNet-v2): norm -> [ReLU] -> 1x1 convolution [+ x]."""

    def __init__(self, norm, c=16, act=True, residual=False):
        super().__init__()
        self.norm, self.act, self.residual = norm, act, residual
        self.conv = torch.nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.norm(x)
        y = self.conv(torch.relu(y) if self.act else y)
        return y + x if self.residual else y


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act, residual", [(True, False), (False, False), (True, True)])
def test_a_group_norm_is_computed_where_a_1x1_convolution_reads_it(dtype, act, residual):
    """The normalized (and activated) tensor is never stored: the convolution normalizes each tile of
    x it loads (fuse_conv1x1.claim_norms), then its own epilogue adds the residual."""
    model = PreActivation(_affine(torch.nn.GroupNorm(4, 16)), act=act, residual=residual).eval()
    x = (torch.randn(2, 16, 5, 7) * 2 + 1).to(dtype)
    launches = check_launches(model.to(dtype), (x,), dtype)
    assert _kernels(launches) == ["reduce", "conv1x1"]
    conv = launches[1]
    assert conv.constexprs["NORM"].value and conv.constexprs["HAS_NW"].value and conv.constexprs["HAS_NB"].value
    assert ("PROLOGUE" in conv.constexprs) == act and conv.op.endswith("+add" if residual else "convolution")


def test_a_training_batch_norm_is_computed_where_a_1x1_convolution_reads_it():
    """Per-channel statistics (sample stride 0, groups of one channel), the running statistics updated."""
    model = PreActivation(_affine(torch.nn.BatchNorm2d(16, momentum=0.2))).train()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 16, 4, 6) * 2 + 0.5
    lowered = td.lower(torch.export.export(model, (x,)), config=RESIDENT)
    assert _kernels(plan_launches(lowered))[-1] == "conv1x1"
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(lowered.load().load_method()(x), eager(x), atol=atol, rtol=rtol)


class ReadTwice(torch.nn.Module):
    """The activated norm feeds the 1x1 convolution and is returned: it must be stored."""

    def __init__(self):
        super().__init__()
        self.norm, self.conv = _affine(torch.nn.GroupNorm(4, 16)), torch.nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = torch.relu(self.norm(x))
        return self.conv(y), y


def test_a_normalized_tensor_read_twice_is_stored():
    launches = check_launches(ReadTwice().eval(), (torch.randn(2, 16, 5, 5),))
    assert _kernels(launches) == ["reduce", "norm_apply", "conv2d"]


def test_an_instance_norm_before_a_1x1_convolution_keeps_its_launch():
    """Instance norm normalizes x seen as [1, N * C, *]: its rows are not the convolution's (image, channel),
    so the convolution reads its stored result."""
    model = PreActivation(_affine(torch.nn.InstanceNorm2d(16, affine=True))).eval()
    launches = check_launches(model, (torch.randn(2, 16, 5, 5),))
    assert "norm_apply" in _kernels(launches)


def test_a_norm_in_a_1x1_convolution_at_a_dynamic_batch_and_size():
    batch, h = Dim("batch", max=4), Dim("h", min=2, max=12)
    model = PreActivation(_affine(torch.nn.GroupNorm(4, 16)), residual=True).eval()
    calls = [(torch.randn(n, 16, rows, 5),) for n, rows in ((2, 7), (1, 12), (4, 2))]
    lowered, _ = check_dynamic(model, calls, {"x": {0: batch, 2: h}})
    assert _kernels(plan_launches(lowered)) == ["reduce", "conv1x1"]


def test_traffic_of_a_norm_in_a_1x1_convolution():
    """x read once with the statistics, weight and bias; the convolution's weight and bias; its result."""
    n, c, h, w, groups = 2, 16, 6, 6, 4
    model = PreActivation(_affine(torch.nn.GroupNorm(groups, c))).eval()
    lowered = td.lower(torch.export.export(model, (torch.randn(n, c, h, w),)), config=RESIDENT)
    conv = plan_launches(lowered)[-1]
    assert conv.kernel == "conv1x1"
    assert conv.bytes_read == 4 * (n * c * h * w + 2 * n * groups + 2 * c + c * c + c)
    assert conv.bytes_written == 4 * n * c * h * w
