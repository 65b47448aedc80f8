"""Bounded dynamic shapes end to end: one program for every size up to a bound.

Each model is exported with ``torch.export.Dim(..., max=N)``, lowered once (memory planned for the
bound) and called at size 1, the bound and primes in between; every compute node is delegated and
every call matches eager.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from tritondelegate import models

from harness import check_dynamic


def test_mlp_dynamic_batch():
    torch.manual_seed(0)
    model = models.MLP([8, 24, 16, 4]).eval()
    lowered, method = check_dynamic(model, [(torch.randn(n, 8),) for n in (5, 1, 2, 7, 13, 33)],
                                    {"x": {0: Dim("batch", max=33)}})
    (symbol,) = lowered.program.methods[0].symbols
    assert (symbol.min, symbol.max, symbol.input, symbol.dim) == (0, 33, 0, 0)


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


def test_cnn_dynamic_batch():
    torch.manual_seed(0)
    model = TinyCNN().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2)
    check_dynamic(model, [(torch.randn(n, 3, 12, 12),) for n in (2, 1, 3, 7)], {"x": {0: Dim("batch", max=7)}})


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_decoder_dynamic_batch_and_sequence(attention):
    model, _ = models.demo_decoder(n_layers=1, attention=attention, max_seq_len=32)
    calls = [(torch.randint(0, 256, (b, s)),) for b, s in ((2, 5), (1, 1), (3, 16), (2, 7), (1, 13))]
    check_dynamic(model, calls, {"input_ids": {0: Dim("batch", max=3), 1: Dim("seq", max=16)}})
