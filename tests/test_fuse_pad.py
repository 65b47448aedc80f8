"""Zero padding that only convolutions read is their own padding (kernels/fuse_pad.py): TensorFlow's
``SAME`` padding on one side, a causal 1-D convolution's left padding, a causal video VAE's 3-D one, a
pad read by two convolutions; a pad that something else reads, or of another value or mode, stays a
launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import FLOAT_DTYPES, check_launches

torch.manual_seed(0)
W2, W1, W3 = torch.randn(4, 3, 3, 3), torch.randn(5, 3, 3), torch.randn(4, 3, 3, 3, 3)


def _kernels(model, x, dtype=torch.float32) -> list[str]:
    launches = check_launches(model.to(dtype), (x.to(dtype),), dtype)
    return [launch.kernel for launch in launches]


class Conv(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w2, self.w1 = torch.nn.Parameter(W2.clone()), torch.nn.Parameter(W1.clone())
        self.w3 = torch.nn.Parameter(W3.clone())

    def forward(self, x):
        return self.fn(self, x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", [8, 9])  # TF's SAME at stride 2: one zero after (8) or one each side (9)
def test_tf_same_padding_of_a_strided_convolution(dtype, size):
    def same(m, x):
        total = max(3 - 2, 0) if size % 2 == 0 else max(3 - 1, 0)
        lo = total // 2
        return F.conv2d(F.pad(x, (lo, total - lo, lo, total - lo)), m.w2, stride=2)

    assert _kernels(Conv(same), torch.randn(2, 3, size, size), dtype) == ["conv2d"]


def test_padding_on_top_of_the_convolutions_own_and_an_epilogue():
    def padded(m, x):
        return torch.relu(F.conv2d(F.pad(x, (1, 0, 2, 3)), m.w2, padding=1, dilation=(2, 1)))

    assert _kernels(Conv(padded), torch.randn(1, 3, 7, 9)) == ["conv2d"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_causal_1d_convolution(dtype):
    def causal(m, x):
        return F.conv1d(F.pad(x, (4, 0)), m.w1, dilation=2)

    assert _kernels(Conv(causal), torch.randn(2, 3, 11), dtype) == ["conv2d"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_causal_3d_convolution(dtype):
    # a causal video VAE: two zeros before the frames, one on each side of H and W, strided in H and W
    def causal(m, x):
        return torch.relu(F.conv3d(F.pad(x, (1, 1, 1, 1, 2, 0)), m.w3, stride=(1, 2, 2)))

    assert _kernels(Conv(causal), torch.randn(2, 3, 4, 7, 6), dtype) == ["conv2d"]


def test_a_3d_pad_on_top_of_the_convolutions_own_padding():
    def padded(m, x):
        return F.conv3d(F.pad(x, (0, 1, 2, 0, 1, 1)), m.w3, padding=(1, 0, 1), dilation=(1, 2, 1))

    assert _kernels(Conv(padded), torch.randn(1, 3, 4, 6, 5)) == ["conv2d"]


def test_a_pad_two_convolutions_read():
    def both(m, x):
        p = F.pad(x, (1, 1, 0, 2))
        return F.conv2d(p, m.w2), F.conv2d(p, m.w2 * 2, stride=2)

    assert _kernels(Conv(both), torch.randn(1, 3, 6, 7)).count("pad") == 0


@pytest.mark.parametrize("case", ["read_elsewhere", "value", "reflect", "channels", "cropped"])
def test_pads_that_stay(case):
    def pad(m, x):
        if case == "read_elsewhere":
            p = F.pad(x, (1, 1, 1, 1))
            return F.conv2d(p, m.w2), p * 2
        if case == "value":
            return F.conv2d(F.pad(x, (1, 1, 1, 1), value=1.5), m.w2)
        if case == "reflect":
            return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), m.w2)
        if case == "channels":
            return F.conv2d(F.pad(x, (1, 1, 1, 1, 1, 0)), m.w2[:, :3].repeat(1, 2, 1, 1)[:, :4])
        return F.conv2d(F.pad(x, (-1, 1, 1, 1)), m.w2)  # a crop: negative padding

    assert "pad" in _kernels(Conv(pad), torch.randn(1, 3, 6, 6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_a_pad_before_a_transposed_convolution_stays(dtype):
    # a transposed convolution's padding crops its output: zeros before its input are no part of it
    def up(m, x):
        return F.conv_transpose2d(F.pad(x, (1, 0, 2, 1)), m.w2.transpose(0, 1), stride=2, padding=1)

    assert _kernels(Conv(up), torch.randn(1, 3, 4, 5), dtype) == ["pad", "conv2d"]
