"""Attention logit soft-capping (Gemma 2): ``tanh(scores / cap) * cap`` before the mask, written out by
transformers' eager attention, becomes one ``tritondelegate::sdpa_softcap`` launch (the attention
kernel's ``SOFTCAP``; ``passes/eager_attention.py``), in the one-pass, packed-heads and split-keys
forms. Every case is compared with the written-out model in fp32 at the dtype's tolerance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tritondelegate as td
from harness import assert_close, plan_launches

gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True), target="h100")


class Gemma2Attention(nn.Module):
    """transformers' Gemma 2 ``eager_attention_forward``: q [B, H, Lq, E], k/v [B, Hkv, Lk, E], the
    additive mask an input; ``softcap`` None leaves the scores as they are."""

    def __init__(self, groups: int, softcap: float | None = 2.0, scaling: float = 0.5):
        super().__init__()
        self.num_key_value_groups, self.softcap, self.scaling = groups, softcap, scaling
        self.eval()

    def forward(self, q, k, v, mask):
        return gemma2.eager_attention_forward(self, q, k, v, mask, scaling=self.scaling, softcap=self.softcap)[0]


def inputs(b, hq, hkv, lq, lk, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, e, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    j, i = torch.arange(lk)[None, :], torch.arange(lq)[:, None] + (lk - lq)
    mask = torch.zeros(1, 1, lq, lk).masked_fill(j > i, torch.finfo(torch.float32).min)  # causal, HF's
    return tuple(t.to(dtype) for t in (q * 2, k * 2, v, mask))


def run(model, args):
    lowered = td.lower(torch.export.export(model, args), config=CONFIG)
    got = lowered.load("simulated").load_method("forward")(*args)
    with torch.no_grad():
        expected = model(*(a.float() for a in args))
    assert_close(got, expected, dtype=args[0].dtype)
    return lowered, plan_launches(lowered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lq, lk", [(5, 9), (1, 1000)])
def test_soft_capped_attention_is_one_launch(dtype, lq, lk):
    # (5, 9): a prefill, one pass; (1, 1000): a decode step, packed heads and split keys (plus the combine)
    lowered, launches = run(Gemma2Attention(groups=2), inputs(1, 4, 2, lq, lk, 16, dtype))
    assert [launch.kernel for launch in launches] == ["attention"] + ["attention_combine"] * (lq == 1)
    assert launches[0].constexprs["PACK"].value == 2 and launches[0].constexprs["SPLIT"].value == (lq == 1)
    assert launches[0].constexprs["SOFTCAP"].value == 2.0
    assert any("sdpa_softcap" in r for r in lowered.reports["forward"].fused)


def test_scores_near_the_cap_saturate_as_eager():
    # Scores far beyond the cap (|s| / cap up to ~50): tanh saturates to +-1 without overflow.
    q, k, v, mask = inputs(2, 2, 2, 3, 7, 8, torch.float32)
    run(Gemma2Attention(groups=1, softcap=0.5, scaling=4.0), (q * 3, k, v, mask))


def test_without_a_cap_the_attention_is_plain_sdpa():
    _, launches = run(Gemma2Attention(groups=2, softcap=None), inputs(1, 4, 2, 5, 9, 16, torch.float32))
    assert [launch.kernel for launch in launches] == ["attention"] and "SOFTCAP" not in launches[0].constexprs


class MaskFirst(Gemma2Attention):
    """The mask added before the cap: ``cap * tanh((s + mask) / cap)``, which the kernel does not compute."""

    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        s = torch.tanh(s / self.softcap) * self.softcap
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def test_a_cap_after_the_mask_stays_written_out():
    _, launches = run(MaskFirst(groups=1), inputs(1, 2, 2, 5, 9, 16, torch.float32))
    assert "attention" not in [launch.kernel for launch in launches]
