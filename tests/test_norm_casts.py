"""A norm computed in fp32 on an fp16/bf16 row and cast straight back is that norm of the row
(passes/norm_casts.py): one launch, or the prologue of the projection that reads it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import Fn, assert_close, lower_resident, plan_launches

LOW = [torch.float16, torch.bfloat16]


class UpcastNorm(torch.nn.Module):
    """OLMo's LayerNorm (no weight), or with a weight and bias of the model's dtype applied in fp32,
    or an RMSNorm so: x.float(), the norm, .to(x.dtype); then a projection."""

    def __init__(self, kind: str, dtype: torch.dtype):
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter((torch.rand(24) + 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(24).to(dtype))
        self.proj = torch.nn.Linear(24, 40, bias=False).to(dtype)

    def forward(self, x):
        xf = x.to(torch.float32)
        if self.kind == "plain":
            y = F.layer_norm(xf, (24,), None, None, 1e-5)
        elif self.kind == "affine":
            y = F.layer_norm(xf, (24,), self.weight.float(), self.bias.float(), 1e-5)
        else:
            y = F.rms_norm(xf, (24,), self.weight.float(), 1e-6)
        return self.proj(y.to(x.dtype))


def _rewrites(lowered) -> list[str]:
    return [f for f in lowered.reports["forward"].fused if "fp32 casts dropped" in f]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["plain", "affine", "rms"])
def test_the_norm_runs_in_the_projections_prologue(kind, dtype):
    torch.manual_seed(0)
    model = UpcastNorm(kind, dtype)
    x = (torch.randn(2, 7, 24) * 2 + 0.5).to(dtype)
    lowered = lower_resident(model, (x,))
    assert len(_rewrites(lowered)) == 1
    assert [launch.kernel for launch in plan_launches(lowered)] == ["matmul"]
    with torch.no_grad():
        expected = model(x)
    assert_close(lowered.load().load_method("forward")(x), expected, dtype=dtype)


def test_what_is_not_a_round_trip_stays():
    # the fp32 norm also returned; a cast to another dtype; an fp32 model (nothing to drop)
    def both(x):
        y = F.layer_norm(x.float(), (16,))
        return y.to(x.dtype), y

    def other(x):
        return F.layer_norm(x.float(), (16,)).to(torch.float16)

    for fn, x in ((both, torch.randn(3, 16, dtype=torch.bfloat16)), (other, torch.randn(3, 16, dtype=torch.bfloat16)),
                  (lambda x: F.layer_norm(x.double(), (16,)).float(), torch.randn(3, 16))):
        lowered = lower_resident(Fn(fn), (x,))
        assert not _rewrites(lowered)
        got, expected = lowered.load().load_method("forward")(x), fn(x)
        for g, e in zip(got if isinstance(got, (list, tuple)) else [got], expected if isinstance(expected, tuple) else [expected]):
            assert_close(g, e)
