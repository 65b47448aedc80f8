"""Depthwise convolutions (``groups == C_in``) run as ``kernels/depthwise.py``'s direct convolution: one
launch over [channels, pixels] tiles across all groups, with the convolution's epilogue, pad folding and
batch-norm folding."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from harness import Fn, check_dynamic, check_launches, check_model, plan_launches
import tritondelegate as td

# (C_in, C_out, kernel, stride, padding, dilation, input shape): odd channels and sizes; C_out = m * C_in
CASES = {
    "2d_3x3_stride2": (6, 6, 3, 2, 1, 1, (2, 6, 9, 11)),
    "2d_multiplier2_rect": (3, 6, (3, 5), 1, (1, 2), 1, (1, 3, 7, 8)),
    "2d_one_input_channel_dilated": (1, 5, 3, 1, 2, 2, (1, 1, 9, 10)),
    "1d_causal_k4": (10, 10, 4, 1, 3, 1, (2, 10, 13)),
    "3d": (3, 3, 3, 1, 1, 1, (1, 3, 4, 5, 6)),
}
MODULES = {2: torch.nn.Conv2d, 1: torch.nn.Conv1d, 3: torch.nn.Conv3d}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_depthwise_matches_eager_in_one_launch(case, dtype):
    c_in, c_out, k, stride, padding, dilation, shape = CASES[case]
    model = MODULES[len(shape) - 2](c_in, c_out, k, stride, padding, dilation, groups=c_in).eval()
    x = torch.randn(shape)
    reference = (copy.deepcopy(model), (x.to(dtype).float(),))
    reference[0].load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    _, plan = check_model(model.to(dtype), (x.to(dtype),), reference_args=reference)
    (launch,) = plan.launches
    assert launch.kernel == "depthwise_conv"


def test_epilogue_and_a_channels_last_input_take_no_other_launch():
    """ConvNeXt's 7x7 with the residual add in its epilogue, reading an NHWC input through a permute."""
    weight = torch.randn(8, 1, 7, 7) * 0.1
    model = Fn(lambda x: (lambda y: y + F.conv2d(y, weight, padding=3, groups=8))(x.permute(0, 3, 1, 2)))
    launches = check_launches(model, (torch.randn(2, 9, 10, 8),))
    assert [launch.kernel for launch in launches] == ["depthwise_conv"]
    assert launches[0].constexprs["EPILOGUE"].value == 1


def test_mobilenet_block_folds_its_padding_and_batch_norm():
    """EfficientNet-style SAME padding (ZeroPad2d before the depthwise conv) and BatchNorm + ReLU6 after it:
    one depthwise launch, the pad read as the conv's own padding, the norm folded into its weights."""
    model = torch.nn.Sequential(torch.nn.ZeroPad2d((0, 1, 0, 1)), torch.nn.Conv2d(6, 6, 3, 2, groups=6, bias=False),
                                torch.nn.BatchNorm2d(6), torch.nn.ReLU6()).eval()
    model[2].running_mean.uniform_(-1, 1)
    model[2].running_var.uniform_(0.5, 2)
    launches = check_launches(model, (torch.randn(1, 6, 10, 10),))
    assert [launch.kernel for launch in launches] == ["depthwise_conv"]


def test_a_decode_step_is_one_program_per_channel_block_not_per_channel():
    """A Mamba-style causal conv1d over 512 channels at one output position: 2 programs of 256 channels
    (the implicit GEMM ran one per channel, 512); FLOPs counted as eager's multiply-adds."""
    model = torch.nn.Conv1d(512, 512, 4, groups=512).eval()
    x = torch.randn(1, 512, 4)
    lowered = td.lower(torch.export.export(model, (x,)))
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "depthwise_conv" and tuple(launch.grid) == (1, 2)
    assert launch.flops == 512 * (2 * 4 + 1)
    torch.testing.assert_close(lowered.load().load_method()(x), model(x))


def test_dynamic_length():
    model = torch.nn.Conv1d(6, 6, 4, padding=3, groups=6).eval()
    calls = [(torch.randn(2, 6, n),) for n in (13, 5, 20)]
    check_dynamic(model, calls, ({2: Dim("length", min=2, max=24)},))
