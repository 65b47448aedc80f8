"""``F.grid_sample`` on 4-D inputs (kernels/grid_sample.py): one launch, against eager, for each mode,
padding and corner alignment, with grid points inside, on and beyond the input's edges."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import FLOAT_DTYPES, Fn, check_model, run_delegated
from tritondelegate.decompose import decompose
from tritondelegate.kernels import grid_sample as gs


def _grid(n, h, w, spread=1.3, seed=0):
    """Points over [-spread, spread]^2: some outside the input, some exactly on its edges and pixel centres."""
    g = (torch.rand(n, h, w, 2, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * spread
    g[:, 0, 0] = torch.tensor([-1.0, 1.0])  # the corners
    g[:, -1, -1] = torch.tensor([0.0, 0.5])
    return g


def _sample(mode, padding, align):
    return Fn(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align))


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample(mode, padding, align):
    x, g = torch.randn(2, 3, 5, 7), _grid(2, 4, 6)
    _, plan = check_model(_sample(mode, padding, align), (x, g))
    assert [launch.kernel for launch in plan.launches] == ["grid_sample"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_grid_sample_dtypes(dtype):
    x, g = torch.randn(1, 4, 6, 6), _grid(1, 5, 3)
    model = _sample("bilinear", "zeros", False)
    check_model(model, (x.to(dtype), g.to(dtype)), reference_args=(model, (x, g)))


def test_deformable_attention_sampling():
    # Deformable DETR's form: values as [batch * heads, head_dim, H, W], points [batch * heads, queries, points, 2]
    values, points = torch.randn(8, 4, 6, 9), torch.rand(8, 10, 4, 2) * 2 - 1
    model = _sample("bilinear", "zeros", False)
    check_model(model, (values, points))


def test_a_strided_input_is_read_in_place():
    model = Fn(lambda x, g: F.grid_sample(x.permute(0, 3, 1, 2), g, align_corners=False))
    _, plan = check_model(model, (torch.randn(2, 5, 7, 3), _grid(2, 4, 4)))
    assert [launch.kernel for launch in plan.launches] == ["grid_sample"]


def test_points_exactly_halfway_round_to_even():
    # nearest: x = 0.5 and 1.5 between pixels round to 0 and 2, as eager's nearbyint
    x = torch.arange(12.0).view(1, 1, 3, 4)
    g = torch.tensor([[[[-0.5, 0.0], [0.0, 0.0], [0.5, -1 / 3]]]])  # x = 1.5, 0.5 + 1.5 ... pixel centres
    (out,), _ = run_delegated(_sample("nearest", "zeros", False), (x, g))
    torch.testing.assert_close(out, F.grid_sample(x, g, mode="nearest", align_corners=False), rtol=0, atol=0)


def test_bicubic_is_refused_with_a_reason():
    ep = decompose(torch.export.export(_sample("bicubic", "zeros", False), (torch.randn(1, 1, 4, 4), _grid(1, 2, 2))))
    (node,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.grid_sampler_2d.default]
    assert "bicubic" in gs.supported(node)
