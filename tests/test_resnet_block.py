"""A small ResNet-style CNN, end to end through one delegate: conv (stride, padding, groups, depthwise),
eval batch norm, relu, max pool, residual adds, global average pool, flatten and a linear head."""

import copy

import pytest
import torch
from torch import nn

from harness import FLOAT_DTYPES, check_model


def _bn(channels):
    norm = nn.BatchNorm2d(channels)
    norm.running_mean.normal_(0.0, 0.5)
    norm.running_var.uniform_(0.5, 2.0)
    norm.weight.data.normal_(1.0, 0.2)
    norm.bias.data.normal_(0.0, 0.2)
    return norm


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1, groups=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = _bn(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, groups=groups, bias=False)
        self.bn2 = _bn(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _bn(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class DepthwiseSeparable(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, 1, 2, dilation=2, groups=channels)
        self.pointwise = nn.Conv2d(channels, channels, 1)
        self.bn = _bn(channels)

    def forward(self, x):
        return x + torch.relu(self.bn(self.pointwise(self.depthwise(x))))


class TinyResNet(nn.Module):
    def __init__(self, classes=5, head=True):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), _bn(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.layer1 = BasicBlock(8, 8, groups=2)
        self.layer2 = BasicBlock(8, 17, stride=2)
        self.layer3 = DepthwiseSeparable(17)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(17, classes) if head else None

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x) if self.fc is not None else x


def check(model, x, dtype):
    model = copy.deepcopy(model).eval().to(dtype)
    x = x.to(dtype)
    return check_model(model, (x,), reference_args=(copy.deepcopy(model).float(), (x.float(),)))


def test_resnet_backbone():
    # Everything but the linear head: runs whatever state kernels/matmul.py is in.
    _, plan = check(TinyResNet(head=False), torch.randn(2, 3, 16, 16), torch.float32)
    kernels = {launch.kernel for launch in plan.launches}
    assert {"conv2d", "batch_norm", "pool2d", "pointwise"} <= kernels


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_resnet_classifier(dtype):
    check(TinyResNet(), torch.randn(2, 3, 9, 9), dtype)
