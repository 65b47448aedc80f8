"""Rotary embeddings written with complex numbers (passes/complex_rotary.py): Llama 4's and DeepSeek-V2's
``view_as_real(view_as_complex(x) * polar(1, angles))`` runs as ``rotary_angles`` of interleaved pairs on
the device, q and k in one launch, against eager; other complex products stay on the host."""

from __future__ import annotations

import pytest
import torch

from harness import TOLERANCES, Fn, lower_resident, plan_launches


class ComplexRotary(torch.nn.Module):
    """Llama 4's attention inputs: q and k of shape [B, S, H, D] rotated by freqs_cis from positions."""

    def __init__(self, dim=16, scale=1.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.scale = scale

    def forward(self, q, k, positions):
        angles = positions[:, :, None].float() * self.inv_freq  # [B, S, D / 2]
        freqs_cis = torch.polar(torch.ones_like(angles), angles) * self.scale
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        q_out = torch.view_as_real(qc * freqs_cis[:, :, None, :]).flatten(3)
        k_out = torch.view_as_real(kc * freqs_cis[:, :, None, :]).flatten(3)
        return q_out.type_as(q), k_out.type_as(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_complex_rotary_runs_as_one_interleaved_rotary_launch(dtype, scale):
    torch.manual_seed(0)
    model = ComplexRotary(scale=scale)
    args = (torch.randn(2, 5, 4, 16).to(dtype), torch.randn(2, 5, 2, 16).to(dtype), torch.arange(10).view(2, 5) * 3)
    lowered = lower_resident(model, args)
    report = lowered.reports["forward"]
    assert report.nodes.delegated == report.nodes.total, report.nodes.host  # no complex op on the host
    assert any("complex rotary" in d for d in report.fused), report.fused
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert kernels.count("rotary") == 1, kernels  # q and k paired
    atol, rtol = TOLERANCES[dtype]
    for got, want in zip(lowered.load().load_method()(*args), model(*args)):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_a_dynamic_length_keeps_its_sizes():
    model = ComplexRotary()
    args = (torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16), torch.arange(6)[None])
    seq = torch.export.Dim("seq", min=2, max=32)
    lowered = lower_resident(model, args, dynamic_shapes=({1: seq}, {1: seq}, {1: seq}))
    method = lowered.load().load_method()
    for n in (2, 9):
        call = (torch.randn(1, n, 4, 16), torch.randn(1, n, 2, 16), torch.arange(n)[None] + 4)
        for got, want in zip(method(*call), model(*call)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_complex_products_that_are_no_rotation_stay_on_the_host():
    def fn(x, r, a):  # a magnitude other than one: not a rotation
        z = torch.view_as_complex(x.reshape(3, -1, 2)) * torch.polar(r, a)
        return torch.view_as_real(z).flatten(1)

    args = (torch.randn(3, 8), torch.rand(3, 4) + 0.5, torch.randn(3, 4))
    lowered = lower_resident(Fn(fn), args)
    assert not any("complex rotary" in d for d in lowered.reports["forward"].fused)
    torch.testing.assert_close(lowered.load().load_method()(*args), fn(*args))
