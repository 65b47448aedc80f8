import copy

import pytest
import torch

from harness import FLOAT_DTYPES, check_model, export_decomposed
from tritondelegate.kernels import batchnorm


def _with_stats(norm):
    """Non-trivial running statistics and affine parameters, in eval mode."""
    norm.running_mean.normal_(0.0, 2.0)
    norm.running_var.uniform_(0.25, 4.0)
    if norm.affine:
        norm.weight.data.normal_(1.0, 0.5)
        norm.bias.data.normal_()
    return norm.eval()


def check(model, x, dtype):
    model = copy.deepcopy(model).to(dtype)
    x = x.to(dtype)
    return check_model(model, (x,), reference_args=(copy.deepcopy(model).float(), (x.float(),)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("channels, spatial, affine", [
    (1, (9, 9), True),
    (3, (7, 16), True),
    (17, (9, 7), False),
], ids=str)
def test_batch_norm2d_eval(channels, spatial, affine, dtype):
    norm = _with_stats(torch.nn.BatchNorm2d(channels, eps=1e-3, affine=affine))
    _, plan = check(norm, torch.randn(2, channels, *spatial) * 3 + 1, dtype)
    assert [launch.kernel for launch in plan.launches] == ["batch_norm"]


@pytest.mark.parametrize("shape", [(5, 17), (2, 3, 9)], ids=str)
def test_batch_norm1d_eval(shape):
    check(_with_stats(torch.nn.BatchNorm1d(shape[1])), torch.randn(shape), torch.float32)


class StridedNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _with_stats(torch.nn.BatchNorm2d(5))

    def forward(self, x):
        # NHWC: H and W still merge into one strided dim, no copy. With H and W swapped they do not:
        # a contiguous copy first.
        return self.norm(x.permute(0, 3, 1, 2)), self.norm(x.permute(0, 3, 2, 1))


def test_batch_norm_strided_input():
    _, plan = check_model(StridedNorm().eval(), (torch.randn(2, 7, 9, 5),))
    assert [launch.kernel for launch in plan.launches] == ["batch_norm", "pointwise", "batch_norm"]


def test_training_mode_batch_norm_is_not_this_op():
    # In training mode BatchNorm2d exports to another op, which this file does not claim.
    ep = export_decomposed(torch.nn.BatchNorm2d(3).train(), (torch.randn(2, 3, 4, 4),))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._native_batch_norm_legit_no_training.default not in targets


def test_integer_input_is_refused_with_a_reason():
    ep = export_decomposed(_with_stats(torch.nn.BatchNorm2d(3)), (torch.randn(2, 3, 4, 4),))
    node = next(n for n in ep.graph.nodes
                if n.target is torch.ops.aten._native_batch_norm_legit_no_training.default)
    assert batchnorm.supported(node) is None
    node.args[0].meta["val"] = node.args[0].meta["val"].to(torch.int32)
    assert "dtype torch.int32 is not supported" in batchnorm.supported(node)
