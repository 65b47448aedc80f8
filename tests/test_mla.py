"""DeepSeek-V3's Multi-head Latent Attention (transformers' ``DeepseekV3Attention``, written out here in
plain PyTorch) in few launches: the RMSNorms of the latents (``q_a_layernorm``, ``kv_a_layernorm``, each
of a slice of one projection's columns) as the next projections' prologues (kernels/fusion.py), and the
rotary of the even and odd columns (``apply_rotary_pos_emb_interleave``: ``rotary(..., deinterleave=True)``,
passes/halves_rotary.py) in the epilogues of the projections that produce q_pe and k_pe
(passes/fuse_rope_linear.py), so that the query is q_b_proj's result as it is (passes/cat_slices.py),
and the key's assembly from its parts as one launch (kernels/fuse_cat.py)."""

from __future__ import annotations

import pytest
import torch

import tritondelegate as td
from harness import assert_close, plan_launches

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 32, 4, 16, 16, 8, 8, 8


def _rms(x, w, eps=1e-6):  # DeepseekV3RMSNorm
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def _rotate(x, cos, sin):  # apply_rotary_pos_emb_interleave, for one tensor
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLA(torch.nn.Module):
    """One MLA attention block; ``latents``: also return the normed kv latent and the rotated k_pe (what
    a KV cache stores)."""

    def __init__(self, latents: bool = False):
        super().__init__()
        self.latents = latents
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_a_proj, self.q_b_proj = lin(HIDDEN, Q_RANK), lin(Q_RANK, HEADS * (NOPE + ROPE))
        self.kv_a_proj_with_mqa, self.kv_b_proj = lin(HIDDEN, KV_RANK + ROPE), lin(KV_RANK, HEADS * (NOPE + V))
        self.o_proj = lin(HEADS * V, HIDDEN)
        self.q_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(Q_RANK))
        self.kv_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(KV_RANK))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))

    def forward(self, x, positions):
        b, s, _ = x.shape
        angles = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = self.q_b_proj(_rms(self.q_a_proj(x), self.q_norm)).view(b, s, -1, NOPE + ROPE).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [NOPE, ROPE], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [KV_RANK, ROPE], dim=-1)
        kv_nope = _rms(kv_nope, self.kv_norm).view(b, 1, s, KV_RANK)
        q_rot, k_rot = _rotate(q_rot, cos, sin), _rotate(k_rot.view(b, 1, s, ROPE), cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)
        kv = self.kv_b_proj(kv_nope).view(b, s, -1, NOPE + V).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE, V], dim=-1)
        key = kv.new_empty(*kv.shape[:-1], NOPE + ROPE)
        key[..., :NOPE].copy_(k_nope)
        key[..., NOPE:].copy_(k_rot.expand(-1, HEADS, -1, -1))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
        out = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return (out, kv_nope, k_rot) if self.latents else out


def _run(model, dtype):
    torch.manual_seed(0)
    x, positions = torch.randn(2, 7, HIDDEN), torch.arange(3, 10).expand(2, 7)
    low = model.to(dtype)
    args = (x.to(dtype), positions)
    lowered = td.lower(torch.export.export(low, args), config=CONFIG)
    got = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        expected = low.float()(x.to(dtype).float(), positions)
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert_close(g, e, dtype=dtype)
    return lowered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_in_six_launches(dtype):
    torch.manual_seed(0)
    lowered = _run(MLA().eval(), dtype)
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert kernels == [
        "matmul",     # q_a_proj and kv_a_proj_with_mqa: one GEMM over their weights concatenated, k_pe
                      # rotated in its epilogue (its even and odd columns stored as halves; the angles,
                      # positions.float() * inv_freq, computed there too)
        "matmul",     # q_b_proj, q_a_layernorm of the first 16 columns as its prologue, q_pe rotated in its
                      # epilogue: query = cat((q_pass, q_rot)) is then its result as it is, a view
        "matmul",     # kv_b_proj, kv_a_layernorm of the next 16 columns (k_pe's 8 left) as its prologue
        "cat",        # key = new_empty, k_nope and k_pe (expanded over the heads) copied in: one launch
        "attention",  # scaled_dot_product_attention, written in o_proj's layout
        "matmul",     # o_proj
    ], kernels
    fused = lowered.reports["forward"].fused
    assert any("rope_linear, 40 of 104 columns rotated, 3 launches -> 2" in f for f in fused), fused


def test_latents_read_elsewhere_stay():
    """The normed kv latent and the rotated k_pe are also results (a KV cache stores them): the norm's
    result must be stored, so kv_a_layernorm stays a launch (q_a_layernorm still runs as a prologue),
    and k_pe comes out rotated in halves, as eager's: a view of the projection that rotated it."""
    torch.manual_seed(0)
    lowered = _run(MLA(latents=True).eval(), torch.float32)
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert kernels.count("norm") == 1 and "rotary" not in kernels, kernels


def test_halves_rotary_of_even_and_odd_columns():
    """The rewrite alone: tables given as inputs (read by the kernel as rotate_half's), odd row counts."""

    class Rotate(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return _rotate(q, cos, sin), _rotate(k, cos, sin)

    torch.manual_seed(1)
    q, k = torch.randn(3, 5, 17, 12), torch.randn(3, 1, 17, 12)
    cos, sin = torch.randn(3, 17, 12), torch.randn(3, 17, 12)
    lowered = td.lower(torch.export.export(Rotate(), (q, k, cos, sin)), config=CONFIG)
    got = lowered.load().load_method("forward")(q, k, cos, sin)
    for g, e in zip(got, Rotate()(q, k, cos, sin)):
        assert_close(g, e)
    assert any("even and odd columns" in f for f in lowered.reports["forward"].fused)
    assert [launch.kernel for launch in plan_launches(lowered)].count("rotary") == 1
