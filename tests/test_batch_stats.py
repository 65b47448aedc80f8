"""Batch norm with the batch's own statistics (kernels/batch_stats.py): instance norm, and batch norm
exported in training mode with its running statistics updated as program state, against eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tritondelegate as td
from harness import TOLERANCES


def _lower(model, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(torch.export.export(model, (x,)))


def _affine(norm):
    torch.manual_seed(1)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    return norm


@pytest.mark.parametrize("dtype", TOLERANCES)
@pytest.mark.parametrize("norm, shape", [
    (torch.nn.InstanceNorm2d(3, affine=True), (2, 3, 5, 7)),
    (torch.nn.InstanceNorm1d(4), (3, 4, 9)),
])
def test_instance_norm(norm, shape, dtype):
    model = norm.eval().to(dtype)
    if model.affine:
        _affine(model)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    lowered = _lower(model, x)
    nodes = lowered.reports["forward"].nodes
    assert nodes.delegated == nodes.total, lowered.summary()
    out = lowered.load().load_method()(x)
    expected = copy.deepcopy(model).float()(x.float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


class Tracked(torch.nn.Module):
    """A norm in training mode that also returns its running statistics after the update."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x), self.norm.running_mean + 0, self.norm.running_var + 0


@pytest.mark.parametrize("norm, shape", [
    (torch.nn.BatchNorm2d(3, momentum=0.3), (2, 3, 4, 5)),
    (torch.nn.BatchNorm1d(4), (5, 4)),
    (torch.nn.InstanceNorm1d(3, affine=True, track_running_stats=True), (2, 3, 7)),
])
def test_training_mode_updates_the_running_statistics_every_call(norm, shape):
    model = Tracked(_affine(norm)).train()
    eager = copy.deepcopy(model)
    torch.manual_seed(0)
    xs = [torch.randn(shape) * 2 + k for k in range(3)]
    lowered = _lower(model, xs[0])
    nodes = lowered.reports["forward"].nodes
    assert nodes.delegated == nodes.total, lowered.summary()
    method = lowered.load().load_method()
    for x in xs:  # the running statistics are state: each call starts from the last one's
        for got, want in zip(method(x), eager(x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_inf_weight_gives_eagers_nans():
    # eager computes x * (rstd * weight) + (bias - mean * rstd * weight): opposite infinities give NaN
    model = _affine(torch.nn.InstanceNorm2d(3, affine=True)).eval()
    with torch.no_grad():
        model.weight[1] = float("inf")
    x = torch.randn(2, 3, 4, 4)
    out = _lower(model, x).load().load_method()(x)
    expected = model(x)
    assert expected[:, 1].isnan().any()
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_training_statistics_when_read():
    """native_batch_norm in training mode returns its batch's mean and 1 / std too (save_mean,
    save_invstd), computed from the same statistics the apply launch reads."""
    from harness import Fn, check_model

    fn = lambda x, w, b, rm, rv: torch.ops.aten.native_batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)  # noqa: E731
    torch.manual_seed(0)
    args = (torch.randn(4, 3, 5) * 2 + 1, torch.randn(3), torch.randn(3), torch.zeros(3), torch.ones(3))
    check_model(Fn(fn), args)
