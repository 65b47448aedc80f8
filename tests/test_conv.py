import copy

import pytest
import torch

from harness import FLOAT_DTYPES, check_model, export_decomposed
from tritondelegate.kernels import conv

# (C_in, C_out, kernel, stride, padding, dilation, groups, bias, (N, H, W)): odd channels and sizes.
CASES = {
    "3x3_pad1": (3, 17, 3, 1, 1, 1, 1, True, (2, 9, 9)),
    "stride2_rect_input": (17, 8, 3, 2, 1, 1, 1, True, (1, 9, 16)),
    "dilation2": (4, 5, 3, 1, 2, 2, 1, False, (1, 7, 7)),
    "groups2_no_pad": (6, 4, 3, 1, 0, 1, 2, True, (2, 7, 9)),
    "depthwise_stride2": (17, 17, 3, 2, 1, 1, 17, True, (1, 16, 16)),
    "depthwise_multiplier2": (3, 6, 3, 1, 1, 1, 3, False, (1, 7, 7)),
    "1x1_downsample_1_out": (17, 1, 1, 2, 0, 1, 1, False, (2, 9, 9)),
    "1_in_rect_kernel": (1, 3, (3, 5), (2, 1), (1, 2), 1, 1, True, (1, 9, 7)),
}


def _low_precision(model, x, dtype):
    """The model and input in ``dtype``, and the fp32 reference holding the same (rounded) values."""
    model = copy.deepcopy(model).to(dtype)
    x = x.to(dtype)
    return model, x, (copy.deepcopy(model).float(), (x.float(),))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_conv2d(case, dtype):
    c_in, c_out, k, stride, padding, dilation, groups, bias, (n, h, w) = CASES[case]
    model = torch.nn.Conv2d(c_in, c_out, k, stride, padding, dilation, groups, bias).eval()
    model, x, reference = _low_precision(model, torch.randn(n, c_in, h, w), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_conv2d_k_step(dtype):
    # K = C_in * KH * KW = 72 runs in steps of 16 under fp32 (IEEE dots on the FMA units: a step of 32
    # spilled registers on sm_90, scripts/compile_check.py), of 32 under fp16/bf16
    model = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    model, x, reference = _low_precision(model, torch.randn(1, 8, 6, 6), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    (launch,) = plan.launches
    assert launch.constexprs["BLOCK_K"].value == (conv.FP32_K_STEP if dtype == torch.float32 else conv.K_STEP)
    assert (conv.FP32_K_STEP, conv.K_STEP) == (16, 32)


class ChannelsLastConv(torch.nn.Module):
    """Reads an NHWC input through a permute and a slice: the conv kernel walks the strides, no copy."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(5, 7, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x.permute(0, 3, 1, 2)[:, :, 1:, :])


def test_conv2d_strided_input_needs_no_copy():
    _, plan = check_model(ChannelsLastConv().eval(), (torch.randn(2, 10, 9, 5),))
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]


# (C_in, C_out, kernel, stride, padding, dilation, groups, bias, (N, L)): 1-D, as a 2-D conv of height 1
CASES_1D = {
    "k3_pad1_bias": (3, 17, 3, 1, 1, 1, 1, True, (2, 37)),  # Whisper's first conv
    "stride2_dilation2_groups2": (6, 4, 5, 2, 3, 2, 2, False, (1, 40)),
    "depthwise_k4": (8, 8, 4, 1, 3, 1, 8, True, (2, 19)),  # wav2vec-style grouped positional conv
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES_1D))
def test_conv1d(case, dtype):
    c_in, c_out, k, stride, padding, dilation, groups, bias, (n, length) = CASES_1D[case]
    model = torch.nn.Sequential(torch.nn.Conv1d(c_in, c_out, k, stride, padding, dilation, groups, bias),
                                torch.nn.GELU()).eval()
    model, x, reference = _low_precision(model, torch.randn(n, c_in, length), dtype)
    _, plan = check_model(model, (x.transpose(1, 2).contiguous().transpose(1, 2),), reference_args=reference)
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]  # the GELU in its epilogue, no copy


def _conv_node(model, x):
    ep = export_decomposed(model, (x,))
    return next(n for n in ep.graph.nodes if n.target is torch.ops.aten.convolution.default)


@pytest.mark.parametrize("model, x, reason", [
    (torch.nn.ConvTranspose2d(3, 4, 3), torch.randn(1, 3, 5, 5), "transposed convolution is not supported"),
    (torch.nn.ConvTranspose1d(3, 4, 3), torch.randn(1, 3, 9), "transposed convolution is not supported"),
    (torch.nn.Conv3d(3, 4, 3), torch.randn(1, 3, 5, 5, 5), "3-D convolution is not supported"),
    (torch.nn.Conv2d(3, 4, 3).double(), torch.randn(1, 3, 5, 5, dtype=torch.float64),
     "dtype torch.float64 is not supported"),
])
def test_unsupported_convolutions_are_refused_with_a_reason(model, x, reason):
    assert reason in conv.supported(_conv_node(model.eval(), x))


def test_supported_conv2d_has_no_reason():
    node = _conv_node(torch.nn.Conv2d(4, 6, 3, groups=2).eval(), torch.randn(1, 4, 5, 5))
    assert conv.supported(node) is None
