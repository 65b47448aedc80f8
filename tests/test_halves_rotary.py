"""Rotary embeddings written over the two halves of x (passes/halves_rotary.py): GPT-OSS's
``cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)`` runs as one rotary launch for q and k together, its tables
computed in the kernel from the angles when they come from positions, against eager; what is not that
rotary stays as it is."""

from __future__ import annotations

import pytest
import torch

from harness import TOLERANCES, Fn, lower_resident, plan_launches


def halves(x, c, s, sliced=False):
    """transformers' GPT-OSS ``_apply_rotary_emb``: chunk (or slices) of x, then the halves rotated."""
    h = x.shape[-1] // 2
    x1, x2 = (x[..., :h], x[..., h:]) if sliced else torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Rotary(torch.nn.Module):
    """q [B, H, S, D] and k [B, Hk, S, D] rotated by tables from positions, scaled and cast as GPT-OSS's
    rotary embedding builds them."""

    def __init__(self, dim=16, scale=1.0, sliced=False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.scale, self.sliced = scale, sliced

    def forward(self, q, k, positions):
        angles = positions[:, :, None].float() * self.inv_freq  # [B, S, D / 2]
        c = (angles.cos() * self.scale).to(q.dtype)[:, None]
        s = (angles.sin() * self.scale).to(q.dtype)[:, None]
        return halves(q, c, s, self.sliced), halves(k, c, s, self.sliced)


def _fused(lowered) -> str:
    return "\n".join(lowered.reports["forward"].fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliced", [False, True])
def test_the_halves_rotary_runs_as_one_launch_with_its_tables_inline(dtype, sliced):
    torch.manual_seed(0)
    model = Rotary(scale=1.35, sliced=sliced)
    args = (torch.randn(2, 4, 5, 16).to(dtype), torch.randn(2, 2, 5, 16).to(dtype), torch.arange(10).view(2, 5) * 3)
    lowered = lower_resident(model, args)
    assert _fused(lowered).count("rotary of the halves") == 2, _fused(lowered)
    assert "rotary_angles, tables from its angles" in _fused(lowered)
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert kernels.count("rotary") == 1 and len(kernels) <= 2, kernels  # q and k paired; the angles' product
    atol, rtol = TOLERANCES[dtype]
    for got, want in zip(lowered.load().load_method()(*args), model(*args)):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_given_tables_take_their_whole_width_form():
    torch.manual_seed(1)
    args = (torch.randn(3, 6, 8), torch.randn(6, 4), torch.randn(6, 4))  # x [B, S, D]; c, s [S, D / 2]
    lowered = lower_resident(Fn(halves), args)
    assert "-> rotary_default (tritondelegate::rotary)" in _fused(lowered), _fused(lowered)
    assert [launch.kernel for launch in plan_launches(lowered)].count("rotary") == 1
    torch.testing.assert_close(lowered.load().load_method()(*args), halves(*args), atol=1e-6, rtol=1e-6)


def _first_half_returned(x, c, s):
    x1, x2 = torch.chunk(x, 2, -1)
    first = x1 * c - x2 * s
    return torch.cat((first, x2 * c + x1 * s), -1), first  # an intermediate is an output


@pytest.mark.parametrize("fn", [
    _first_half_returned,
    lambda x, c, s: torch.cat((x[..., :4] * c - x[..., 4:] * s, x[..., 4:] * s + x[..., :4] * c), -1),  # swapped
    lambda x, c, s: torch.cat((x[..., :3] * c[..., :3] - x[..., 3:6] * s[..., :3],
                               x[..., 3:6] * c[..., :3] + x[..., :3] * s[..., :3]), -1),  # not the halves of x
])
def test_what_is_not_the_halves_rotary_stays(fn):
    torch.manual_seed(2)
    args = (torch.randn(3, 6, 8), torch.randn(6, 4), torch.randn(6, 4))
    lowered = lower_resident(Fn(fn), args)
    assert "rotary of the halves" not in _fused(lowered)
    for got, want in zip(lowered.load().load_method()(*args), fn(*args)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
