"""An RMSNorm of a centered row is a LayerNorm (passes/centered_norm.py): Cohere's LayerNorm without
bias, written out, becomes one ``aten.layer_norm``: one row kernel, or the prologue of its projection."""

from __future__ import annotations

import pytest
import torch

from harness import FLOAT_DTYPES, Fn, assert_close, lower_resident, plan_launches



class CohereNorm(torch.nn.Module):
    """transformers' CohereLayerNorm: fp32 statistics, a weight, no bias."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + 1e-5)
        return (self.weight.to(torch.float32) * x).to(dtype)


class NormLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = CohereNorm(24), torch.nn.Linear(24, 40, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def _rewrites(lowered) -> list[str]:
    return [f for f in lowered.reports["forward"].fused if f.startswith("centered RMSNorm")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_written_out_layer_norm_is_one_launch(dtype):
    torch.manual_seed(0)
    model = CohereNorm(24)
    x = (torch.randn(3, 5, 24) * 3 + 1).to(dtype)
    lowered = lower_resident(model, (x,))
    assert len(_rewrites(lowered)) == 1
    assert [launch.kernel for launch in plan_launches(lowered)] == ["norm"]
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(x), model(x), dtype=dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_the_norm_becomes_the_projections_prologue(dtype):
    torch.manual_seed(0)
    model = NormLinear().to(dtype)
    x = torch.randn(2, 7, 24).to(dtype)
    lowered = lower_resident(model, (x,))
    # In fp16/bf16 the fp32 norm cast back is the norm of the row itself (passes/norm_casts.py).
    assert [launch.kernel for launch in plan_launches(lowered)] == ["matmul"]
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(x), model.float()(x.float()), dtype=dtype)


@pytest.mark.parametrize("case", ["mean_returned", "other_dim", "other_x"])
def test_what_is_not_a_layer_norm_stays(case):
    def fn(x, y):
        mean = x.mean(0 if case == "other_dim" else -1, keepdim=True)
        centered = (y if case == "other_x" else x) - mean
        normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed, mean) if case == "mean_returned" else normed

    args = (torch.randn(4, 16), torch.randn(4, 16))
    lowered = lower_resident(Fn(fn), args)
    assert not _rewrites(lowered)
    got = lowered.load().load_method("forward")(*args)
    expected = fn(*args)
    for g, e in zip(got if isinstance(got, (list, tuple)) else [got], expected if isinstance(expected, tuple) else [expected]):
        assert_close(g, e)
