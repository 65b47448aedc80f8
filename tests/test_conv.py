import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from harness import (FLOAT_DTYPES, Fn, check_dynamic, check_launches, check_model, export_decomposed, plan_launches,
                     run_delegated)
from tritondelegate.kernels import conv
from tritondelegate.kernels.table import KERNELS
from tritondelegate.runtime.footprints import kernel_parameters

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
    assert [launch.kernel for launch in plan.launches] == ["depthwise_conv" if groups == c_in else "conv2d"]


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
    kernel = "depthwise_conv" if groups == c_in else "conv2d"
    assert [launch.kernel for launch in plan.launches] == [kernel]  # the GELU in its epilogue, no copy


def _conv_node(model, x):
    ep = export_decomposed(model, (x,))
    return next(n for n in ep.graph.nodes if n.target is torch.ops.aten.convolution.default)


@pytest.mark.parametrize("model, x, reason", [
    (torch.nn.Conv2d(3, 4, 3).double(), torch.randn(1, 3, 5, 5, dtype=torch.float64),
     "dtype torch.float64 is not supported"),
    (torch.nn.Conv3d(3, 4, 3).double(), torch.randn(1, 3, 5, 5, 5, dtype=torch.float64),
     "dtype torch.float64 is not supported"),
])
def test_unsupported_convolutions_are_refused_with_a_reason(model, x, reason):
    assert reason in conv.supported(_conv_node(model.eval(), x))


def test_a_convolution_of_four_spatial_dims_is_refused():
    # No module exports one (PyTorch has no 4-D convolution backend): a graph written by hand.
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.randn(1, 2, 3, 3, 3, 3), torch.randn(4, 2, 1, 1, 1, 1)
    node = graph.call_function(torch.ops.aten.convolution.default,
                               (x, w, None, [1] * 4, [0] * 4, [1] * 4, False, [0] * 4, 1))
    assert "4-D convolution is not supported (1-D, 2-D and 3-D only)" in conv.supported(node)


@pytest.mark.parametrize("model, x", [
    (torch.nn.Conv2d(4, 6, 3, groups=2), torch.randn(1, 4, 5, 5)),
    (torch.nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1, groups=2), torch.randn(1, 4, 5, 5)),
    (torch.nn.ConvTranspose1d(3, 4, 3), torch.randn(1, 3, 9)),
    (torch.nn.Conv3d(4, 6, 3, groups=2), torch.randn(1, 4, 5, 5, 5)),
    (torch.nn.ConvTranspose3d(3, 4, 3, stride=2), torch.randn(1, 3, 3, 4, 5)),
])
def test_supported_convolutions_have_no_reason(model, x):
    assert conv.supported(_conv_node(model.eval(), x)) is None


# Transposed: (C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, (N, H, W))
CASES_T = {
    "unet_up_s2_p1_op1": (4, 3, 3, 2, 1, 1, 1, 1, True, (2, 5, 6)),
    "dcgan_k4_s2_p1": (5, 4, 4, 2, 1, 0, 1, 1, True, (1, 4, 5)),
    "stride1_dilation2": (3, 4, 3, 1, 1, 0, 2, 1, True, (1, 6, 5)),
    "groups2_bias": (4, 6, 3, 2, 0, 1, 1, 2, True, (1, 5, 5)),
    "odd_5x7_rect": (3, 5, (3, 2), (2, 3), (1, 0), (1, 2), 1, 1, True, (1, 5, 7)),
    "k2_s2_no_overlap": (8, 4, 2, 2, 0, 0, 1, 1, True, (1, 4, 4)),
    "no_bias": (3, 4, 3, 2, 1, 0, 1, 1, False, (2, 4, 4)),
    # kernels smaller than the stride: the phases of residue >= the kernel have no taps (bias only)
    "k1_s2_op1": (4, 3, 1, 2, 0, 1, 1, 1, True, (1, 3, 4)),
    "k2_s3_p1_op2": (3, 4, 2, 3, 1, 2, 1, 1, True, (2, 3, 4)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES_T))
def test_conv_transpose2d(case, dtype):
    c_in, c_out, k, stride, padding, output_padding, dilation, groups, bias, (n, h, w) = CASES_T[case]
    model = torch.nn.ConvTranspose2d(c_in, c_out, k, stride, padding, output_padding, groups, bias, dilation)
    model, x, reference = _low_precision(model.eval(), torch.randn(n, c_in, h, w), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]
    assert plan.launches[0].constexprs["TRANSPOSED"].value is True
    assert ("PHASED" in plan.launches[0].constexprs) == (dilation == 1)  # by stride phase unless dilated


# Transposed 1-D: (C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, (N, L))
CASES_T1D = {
    "vocoder_k16_s8_p4": (4, 3, 16, 8, 4, 0, 1, 1, True, (1, 9)),  # HiFi-GAN-style upsampling
    "stride1": (3, 5, 3, 1, 1, 0, 1, 1, False, (2, 11)),
    "stride2_dilation2_groups2": (4, 6, 3, 2, 2, 1, 2, 2, True, (1, 10)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES_T1D))
def test_conv_transpose1d(case, dtype):
    c_in, c_out, k, stride, padding, output_padding, dilation, groups, bias, (n, length) = CASES_T1D[case]
    model = torch.nn.ConvTranspose1d(c_in, c_out, k, stride, padding, output_padding, groups, bias, dilation)
    model, x, reference = _low_precision(model.eval(), torch.randn(n, c_in, length), dtype)
    _, plan = check_model(model, (x.transpose(1, 2).contiguous().transpose(1, 2),), reference_args=reference)
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]  # read through its strides, no copy
    assert ("PHASED" in plan.launches[0].constexprs) == (dilation == 1)


class UpBlock(torch.nn.Module):
    """A UNet decoder step: upsample, ReLU, add the skip connection."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(6, 4, 2, stride=2)

    def forward(self, x, skip):
        return torch.relu(self.up(x)) + skip


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_conv_transpose_epilogue(dtype):
    torch.manual_seed(0)
    model = UpBlock().eval().to(dtype)
    (launch,) = check_launches(model, (torch.randn(2, 6, 3, 4).to(dtype), torch.randn(2, 4, 6, 8).to(dtype)), dtype)
    assert launch.kernel == "conv2d" and launch.constexprs["EPILOGUE"].value == 2


def test_conv_transpose_dynamic_batch():
    torch.manual_seed(0)
    batch = Dim("batch", max=5)
    lowered, _ = check_dynamic(UpBlock().eval(),
                               [(torch.randn(n, 6, 3, 4), torch.randn(n, 4, 6, 8)) for n in (2, 1, 5, 3)],
                               {"x": {0: batch}, "skip": {0: batch}})
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["TRANSPOSED"].value is True and launch.constexprs["EPILOGUE"].value == 2


def test_conv_transpose_dynamic_height_and_width():
    torch.manual_seed(0)
    model = torch.nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1).eval()  # OH = 2H, OW = 2W
    h, w = Dim("h", min=2, max=9), Dim("w", min=2, max=9)
    lowered, _ = check_dynamic(model, [(torch.randn(1, 3, a, b),) for a, b in ((4, 5), (2, 9), (9, 3))],
                               {"input": {2: h, 3: w}})
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "conv2d" and launch.constexprs["PHASED"].value is True


def _exact_pairs(out: int, k: int, stride: int, pad: int) -> int:
    """Along one dim of a transposed conv: the (output index o, tap t) pairs with o + pad - t a multiple
    of the stride, the taps that land on o (their input inside x or not)."""
    return sum((o + pad - t) % stride == 0 for o in range(out) for t in range(k))


@pytest.mark.parametrize("model, x", [
    (torch.nn.ConvTranspose1d(8, 6, 16, 8, 4), torch.randn(1, 8, 5)),  # HiFi-GAN: 2 of 16 taps per phase
    (torch.nn.ConvTranspose2d(4, 6, 3, 2, 1, 1, groups=2), torch.randn(2, 4, 3, 4)),  # 1, 2 or 4 of 9
    (torch.nn.ConvTranspose3d(4, 3, 2, 2, bias=False), torch.randn(1, 4, 2, 3, 2)),  # 1 of 8
], ids=["1d_k16_s8_p4", "2d_k3_s2_p1_op1_groups2", "3d_k2_s2"])
def test_conv_transpose_walks_only_the_exact_taps(model, x):
    # By stride phase: grid axis 0 = (phases) x (tiles of the largest phase's rows), and the launch's
    # FLOPs (traffic.py: what its K walk multiplies) count 2 per output pixel, exact tap, input channel
    # of its group and output channel, where walking every tap counts stride product times as many.
    out = model.eval()(x)
    _, plan = check_model(model, (x,))
    (launch,) = plan.launches
    assert launch.constexprs["PHASED"].value is True
    c_in, c_out, spatial = x.shape[1], out.shape[1], out.shape[2:]
    strides, pads, kernel = model.stride, model.padding, model.kernel_size
    rows = x.shape[0] * math.prod(-(-o // s) for o, s in zip(spatial, strides))
    assert launch.grid[0] == math.prod(strides) * -(-rows // launch.constexprs["BLOCK_M"].value)
    macs = x.shape[0] * math.prod(_exact_pairs(*d) for d in zip(spatial, kernel, strides, pads)) * c_in // model.groups
    bias = out.numel() if model.bias is not None else 0
    assert launch.flops == 2 * macs * c_out + bias
    every_tap = 2 * out.numel() * c_in // model.groups * math.prod(kernel) + bias
    assert launch.flops < every_tap and (every_tap - bias) / (launch.flops - bias) >= math.prod(strides) * 0.5


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * inf in rows never stored
@pytest.mark.parametrize("tap", [(1, 1), (0, 0)], ids=["interior", "corner"])
def test_conv_transpose_inf_weight(tap):
    # A finite input and one inf weight (input channel 0 -> output channel 1). Interior tap (its input
    # exists for every output of its phase): every output as eager's, inf where eager's is, the other
    # phases finite. Corner tap: its phase's outputs at the last row or column read it outside x (masked:
    # 0 * inf = NaN) where eager adds nothing; every other output as eager's.
    torch.manual_seed(0)
    model = torch.nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1).eval()
    with torch.no_grad():
        model.weight[0, 1][tap] = float("inf")
    x = torch.randn(1, 2, 4, 5)
    with torch.no_grad():
        expected = model(x)
    (result,), plan = run_delegated(model, (x,))
    assert plan.launches[0].constexprs["PHASED"].value is True
    assert torch.isinf(expected).any() and not torch.isnan(expected).any()
    border = torch.zeros_like(expected, dtype=torch.bool)
    if tap == (0, 0):  # kh = 0 is exact at odd oh, read at ih = (oh + 1) // 2: H (outside x) at oh = 7
        border[0, 1, 1::2, 1::2] = True
        border[0, 1, 1:-1:2, 1:-1:2] = False
    assert torch.equal(torch.isnan(result), border)
    torch.testing.assert_close(result[~border], expected[~border])


# --- 3-D --------------------------------------------------------------------------------------------
# (C_in, C_out, kernel, stride, padding, dilation, groups, bias, (N, D, H, W)): odd channels and sizes
CASES_3D = {
    "k3_pad1": (3, 5, 3, 1, 1, 1, 1, True, (2, 5, 6, 7)),
    "stride2_rect": (4, 6, (3, 2, 3), (2, 1, 2), (1, 0, 1), 1, 1, True, (1, 5, 6, 7)),
    "dilation2_no_bias": (3, 4, 3, 1, 2, (2, 1, 2), 1, False, (1, 6, 5, 6)),
    "groups2": (4, 6, 3, 1, (0, 1, 1), 1, 2, True, (1, 4, 5, 5)),
    "depthwise_stride2": (5, 5, 3, 2, 1, 1, 5, False, (1, 5, 7, 6)),
    "videomae_tubelet": (3, 17, (2, 4, 4), (2, 4, 4), 0, 1, 1, True, (2, 4, 8, 12)),  # VideoMAE/ViViT patches
    "pseudo_3d_k133": (5, 4, (1, 3, 3), (2, 1, 1), (0, 1, 1), 1, 1, True, (1, 5, 6, 6)),  # KD 1, still 3-D
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES_3D))
def test_conv3d(case, dtype):
    c_in, c_out, k, stride, padding, dilation, groups, bias, (n, d, h, w) = CASES_3D[case]
    model = torch.nn.Conv3d(c_in, c_out, k, stride, padding, dilation, groups, bias).eval()
    model, x, reference = _low_precision(model, torch.randn(n, c_in, d, h, w), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    (launch,) = plan.launches
    assert launch.kernel == ("depthwise_conv" if groups == c_in else "conv2d")
    assert launch.constexprs["DEPTH"].value is True and launch.constexprs["KD"].value == model.kernel_size[0]


def test_conv3d_strided_input_needs_no_copy():
    """A channels-last [N, D, H, W, C] video read through a permute and a slice of its frames."""
    conv3d = torch.nn.Conv3d(5, 4, 3, stride=(1, 2, 2), padding=1).eval()
    _, plan = check_model(Fn(lambda x: conv3d(x.permute(0, 4, 1, 2, 3)[:, :, 1:])), (torch.randn(2, 5, 7, 6, 5),))
    assert [launch.kernel for launch in plan.launches] == ["conv2d"]


class CausalConv3d(torch.nn.Module):
    """A causal video VAE's convolution: k3, the frames padded on the left only (2 zeros), the spatial
    dims on both sides, no padding of its own (the pad folds into it: kernels/fuse_pad.py)."""

    def __init__(self, c_in=3, c_out=4):
        super().__init__()
        self.conv = torch.nn.Conv3d(c_in, c_out, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 1, 1, 2, 0)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_causal_video_vae_conv3d(dtype):
    model, x, reference = _low_precision(CausalConv3d().eval(), torch.randn(2, 3, 5, 6, 7), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    (launch,) = plan.launches
    assert launch.kernel == "conv2d" and launch.op.startswith("constant_pad_nd+")
    names, _ = kernel_parameters(KERNELS["conv2d"])
    args = {name: arg.value for name, arg in zip(names, launch.args)}
    assert (args["pad_d"], args["pad_h"], args["pad_w"]) == (2, 1, 1)  # the zeros before, as its own padding


# Transposed 3-D: (C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, (N, D, H, W))
CASES_T3D = {
    "unet_k2_s2": (4, 3, 2, 2, 0, 0, 1, 1, True, (1, 3, 4, 5)),
    "k3_s2_p1_op1": (3, 4, 3, 2, 1, 1, 1, 1, True, (2, 3, 3, 4)),
    "rect_groups2_no_bias": (4, 6, (3, 2, 3), (2, 2, 1), (1, 0, 1), (1, 0, 0), 1, 2, False, (1, 3, 4, 3)),
    "dilation2": (3, 2, 3, (1, 2, 2), 1, 0, 2, 1, True, (1, 4, 3, 3)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES_T3D))
def test_conv_transpose3d(case, dtype):
    c_in, c_out, k, stride, padding, output_padding, dilation, groups, bias, (n, d, h, w) = CASES_T3D[case]
    model = torch.nn.ConvTranspose3d(c_in, c_out, k, stride, padding, output_padding, groups, bias, dilation)
    model, x, reference = _low_precision(model.eval(), torch.randn(n, c_in, d, h, w), dtype)
    _, plan = check_model(model, (x,), reference_args=reference)
    (launch,) = plan.launches
    assert launch.kernel == "conv2d"
    assert launch.constexprs["TRANSPOSED"].value is True and launch.constexprs["DEPTH"].value is True
    assert ("PHASED" in launch.constexprs) == (dilation == 1)


class Block3d(torch.nn.Module):
    """A 3-D UNet / video VAE step: conv, ReLU, the skip connection, and a per-frame shift broadcast over
    H and W (every operand addressed through the epilogue's five strides)."""

    def __init__(self, transposed=False):
        super().__init__()
        conv = torch.nn.ConvTranspose3d if transposed else torch.nn.Conv3d
        self.conv = conv(6, 4, 2, stride=2) if transposed else conv(6, 4, 3, padding=1)

    def forward(self, x, skip, frames):
        return torch.relu(self.conv(x)) + skip + frames[:, :, :, None, None]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_conv3d_epilogue(dtype, transposed):
    torch.manual_seed(0)
    model = Block3d(transposed).eval().to(dtype)
    n, d, h, w = (2, 3, 5, 4)
    od, oh, ow = (2 * d, 2 * h, 2 * w) if transposed else (d, h, w)
    args = (torch.randn(n, 6, d, h, w), torch.randn(n, 4, od, oh, ow), torch.randn(1, 4, od))
    (launch,) = check_launches(model, tuple(a.to(dtype) for a in args), dtype)
    assert launch.kernel == "conv2d" and launch.constexprs["EPILOGUE"].value == 3
    assert launch.constexprs["DEPTH"].value is True


def test_conv3d_dynamic_batch():
    torch.manual_seed(0)
    batch = Dim("batch", max=5)
    calls = [(torch.randn(n, 6, 3, 5, 4), torch.randn(n, 4, 3, 5, 4), torch.randn(1, 4, 3)) for n in (2, 1, 5, 3)]
    lowered, _ = check_dynamic(Block3d().eval(), calls, {"x": {0: batch}, "skip": {0: batch}, "frames": None})
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["DEPTH"].value is True and launch.constexprs["EPILOGUE"].value == 3
