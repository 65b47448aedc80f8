"""rms_norm as the prologue of the matmuls that read it (kernels/fusion.py, matmul PROLOGUE="rms"):
the normalized rows are never stored, and the norm costs no launch of its own."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from harness import FLOAT_DTYPES, check_dynamic, check_launches, plan_launches

class NormThenLinear(torch.nn.Module):
    def __init__(self, dim, outs=(40,), weight=True, also_return_norm=False, bias=False):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(dim)) if weight else None
        self.linears = torch.nn.ModuleList(torch.nn.Linear(dim, n, bias=bias) for n in outs)
        self.also_return_norm = also_return_norm

    def forward(self, x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.w, 1e-5)
        ys = [lin(h) for lin in self.linears]
        return (*ys, h) if self.also_return_norm else tuple(ys)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_norm_runs_inside_the_linear(dtype):
    torch.manual_seed(0)
    model = NormThenLinear(33, bias=True).eval()
    launches = check_launches(model.to(dtype), (torch.randn(2, 5, 33).to(dtype),), dtype)
    (launch,) = launches
    assert launch.kernel == "matmul" and launch.constexprs["PROLOGUE"].value == "rms"


class SwiGLU(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],), None, 1e-6)
        return (torch.nn.functional.silu(self.gate(h)) * self.up(h),)


def test_norm_without_weight_into_a_gated_mlp():
    torch.manual_seed(0)
    launches = check_launches(SwiGLU(24, 40).eval(), (torch.randn(7, 24),))
    # gate and up are one GEMM (passes/fuse_glu.py) that normalizes its A and gates its result
    (launch,) = launches
    assert launch.kernel == "matmul" and launch.constexprs["PROLOGUE"].value == "rms"
    assert not launch.constexprs["HAS_PW"].value and launch.constexprs["GLU"].value == "silu"


def test_norm_with_two_readers():
    torch.manual_seed(0)
    model = NormThenLinear(24, outs=(40, 16)).eval()
    model.linears[1].bias = torch.nn.Parameter(torch.randn(16))  # not one projection group
    launches = check_launches(model, (torch.randn(7, 24),))
    assert [launch.kernel for launch in launches] == ["matmul", "matmul"]
    assert all(launch.constexprs["PROLOGUE"].value == "rms" for launch in launches)


def test_a_norm_that_is_also_returned_is_stored():
    torch.manual_seed(0)
    launches = check_launches(NormThenLinear(24, also_return_norm=True).eval(), (torch.randn(3, 24),))
    assert [launch.kernel for launch in launches] == ["norm", "matmul"]
    assert "PROLOGUE" not in launches[1].constexprs


def test_a_norm_read_transposed_is_not_a_prologue():
    class Transposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 3))

        def forward(self, x):  # the matmul reads the normalized rows as columns
            return (torch.nn.functional.rms_norm(x, (6,), None, 1e-5).t() @ self.w,)

    model = Transposed().eval()
    launches = check_launches(model, (torch.randn(5, 6),))
    assert [launch.kernel for launch in launches] == ["norm", "matmul"]


def test_dynamic_rows():
    torch.manual_seed(0)
    model = NormThenLinear(24, outs=(16,)).eval()
    lowered, _ = check_dynamic(model, [(torch.randn(1, n, 24),) for n in (5, 1, 16, 7)],
                               {"x": {1: Dim("seq", max=16)}})
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["PROLOGUE"].value == "rms"


def test_one_row_as_in_decode():
    torch.manual_seed(0)
    (launch,) = check_launches(NormThenLinear(33).eval(), (torch.randn(1, 1, 33),))
    assert launch.constexprs["PROLOGUE"].value == "rms"


class LayerNormThenLinear(torch.nn.Module):
    """layer_norm (weight and bias optional) read by linears (bias too); odd widths."""

    def __init__(self, dim, outs=(40,), affine=True, bias=True, shift=None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=affine, bias=affine)
        if affine:  # not the identity: weight near 1, bias near 0
            self.norm.weight.data = 1 + 0.1 * torch.randn(dim)
            self.norm.bias.data = 0.1 * torch.randn(dim)
        self.linears = torch.nn.ModuleList(torch.nn.Linear(dim, n, bias=bias) for n in outs)
        self.shift = shift  # rows far from zero mean: the prologue must center them

    def forward(self, x):
        h = self.norm(x if self.shift is None else x + self.shift)
        return tuple(lin(h) for lin in self.linears)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_runs_inside_the_linear(dtype):
    torch.manual_seed(0)
    model = LayerNormThenLinear(33, shift=3.0).eval()
    shift, launch = check_launches(model.to(dtype), (torch.randn(2, 5, 33).to(dtype),), dtype)
    assert shift.kernel == "pointwise"  # x + 3: the norm's input, stored
    assert launch.kernel == "matmul" and launch.constexprs["PROLOGUE"].value == "layer"
    assert launch.constexprs["HAS_PW"].value and launch.constexprs["HAS_PB"].value


def test_layer_norm_without_affine_and_two_readers():
    torch.manual_seed(0)
    model = LayerNormThenLinear(24, outs=(16, 8), affine=False).eval()
    model.linears[1].bias = None  # not one projection group: two GEMMs read the norm
    launches = check_launches(model, (torch.randn(7, 24),))
    assert [launch.kernel for launch in launches] == ["matmul", "matmul"]
    for launch in launches:
        assert launch.constexprs["PROLOGUE"].value == "layer"
        assert not launch.constexprs["HAS_PW"].value and not launch.constexprs["HAS_PB"].value


def test_layer_norm_dynamic_rows():
    torch.manual_seed(0)
    model = LayerNormThenLinear(24, outs=(16,)).eval()
    lowered, _ = check_dynamic(model, [(torch.randn(1, n, 24),) for n in (5, 1, 16)],
                               {"x": {1: Dim("seq", max=16)}})
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["PROLOGUE"].value == "layer"
