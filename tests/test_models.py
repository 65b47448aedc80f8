"""End to end through the public API: export -> lower -> save -> load -> call, against eager."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import tritondelegate as td
from tritondelegate.models import MLP, demo_decoder

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def lower_save_load(model, args, tmp_path, config=RESIDENT, **lower_kwargs):
    ep = torch.export.export(model, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(ep, config=config, **lower_kwargs)
    path = tmp_path / "model.tdp"
    lowered.save(path)
    method = td.load(path, devices="simulated").load_method("forward")
    return lowered, method


def delegated_share(lowered, method="forward") -> float:
    nodes = lowered.reports[method].nodes
    return nodes.delegated / nodes.total


def test_mlp(tmp_path):
    torch.manual_seed(0)
    model = MLP([33, 64, 17, 5]).eval()
    x = torch.randn(7, 33)
    lowered, method = lower_save_load(model, (x,), tmp_path)
    with torch.no_grad():
        expected = model(x)
    for _ in range(2):
        torch.testing.assert_close(method(x), expected, atol=1e-5, rtol=1e-5)
    assert delegated_share(lowered) == 1.0
    # Weights are resident: each call copies only x in and the logits out.
    assert method.stats.call_h2d_bytes == x.numel() * 4
    assert method.stats.call_d2h_bytes == expected.numel() * 4
    assert method.stats.load_h2d_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_llama_style_decoder(tmp_path, attention):
    model, args = demo_decoder(attention=attention, n_layers=1)
    lowered, method = lower_save_load(model, args, tmp_path)
    with torch.no_grad():
        expected = model(*args)
        out = method(*args)
    assert (out - expected).abs().max().item() < 1e-3
    assert delegated_share(lowered) >= 0.9, lowered.summary()


class GPT2Block(nn.Module):
    """A GPT-2 block written the way GPT-2 does: Conv1D as addmm, tanh GELU, a boolean causal mask."""

    def __init__(self, dim=48, heads=4, ctx=32):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_attn_w = nn.Parameter(torch.randn(dim, 3 * dim) * 0.1)
        self.c_attn_b = nn.Parameter(torch.randn(3 * dim) * 0.1)
        self.c_proj_w = nn.Parameter(torch.randn(dim, dim) * 0.1)
        self.c_proj_b = nn.Parameter(torch.randn(dim) * 0.1)
        self.fc_w = nn.Parameter(torch.randn(dim, 4 * dim) * 0.1)
        self.fc_b = nn.Parameter(torch.randn(4 * dim) * 0.1)
        self.proj_w = nn.Parameter(torch.randn(4 * dim, dim) * 0.1)
        self.proj_b = nn.Parameter(torch.randn(dim) * 0.1)
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)).view(1, 1, ctx, ctx))

    @staticmethod
    def conv1d(x, w, b):
        shape = x.shape[:-1] + (w.shape[1],)
        return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(shape)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.conv1d(self.ln_1(x), self.c_attn_w, self.c_attn_b).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        mask = self.bias[:, :, :t, :t]
        scores = torch.where(mask, scores, torch.tensor(torch.finfo(scores.dtype).min))
        attn = scores.softmax(-1) @ v
        attn = attn.transpose(1, 2).reshape(b, t, c)
        x = x + self.conv1d(attn, self.c_proj_w, self.c_proj_b)
        h = nn.functional.gelu(self.conv1d(self.ln_2(x), self.fc_w, self.fc_b), approximate="tanh")
        return x + self.conv1d(h, self.proj_w, self.proj_b)


def test_gpt2_style_block(tmp_path):
    torch.manual_seed(0)
    model = GPT2Block().eval()
    x = torch.randn(2, 17, 48)
    lowered, method = lower_save_load(model, (x,), tmp_path)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(method(x), expected, atol=1e-4, rtol=1e-4)
    assert delegated_share(lowered) >= 0.9, lowered.summary()


class Untuned(nn.Module):
    """Ops in an order nobody tuned for: broadcasting, slicing, reductions, concatenation."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(12)

    def forward(self, x, y):
        h = self.proj(self.norm(x))
        a, b = h[..., :12], h[..., 12:]
        gate = torch.sigmoid(a) * torch.tanh(b) + y.unsqueeze(1)
        pooled = gate.mean(dim=1, keepdim=True)
        return torch.cat([gate - pooled, pooled.expand_as(gate)], dim=-1).log_softmax(-1), gate.sum(-1)


def test_untuned_model_matches_eager(tmp_path):
    torch.manual_seed(1)
    model = Untuned().eval()
    args = (torch.randn(3, 5, 12), torch.randn(3, 12))
    lowered, method = lower_save_load(model, args, tmp_path)
    with torch.no_grad():
        expected = model(*args)
    out = method(*args)
    assert isinstance(out, tuple) and len(out) == 2
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, atol=1e-4, rtol=1e-4)


def test_two_methods_share_constants(tmp_path):
    torch.manual_seed(0)
    model = MLP([16, 32, 8]).eval()
    prefill = torch.export.export(model, (torch.randn(6, 16),))
    decode = torch.export.export(model, (torch.randn(1, 16),))
    lowered = td.lower({"prefill": prefill, "decode": decode}, config=RESIDENT)
    assert len(lowered.program.constants) == 4
    path = tmp_path / "two.tdp"
    lowered.save(path)
    program = td.load(path, devices="simulated")
    assert sorted(program.method_names) == ["decode", "prefill"]
    for name, x in (("prefill", torch.randn(6, 16)), ("decode", torch.randn(1, 16))):
        with torch.no_grad():
            torch.testing.assert_close(program.load_method(name)(x), model(x), atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_input(tmp_path):
    model = MLP([8, 4]).eval()
    _, method = lower_save_load(model, (torch.randn(2, 8),), tmp_path)
    with pytest.raises(td.InputError, match=r"input 0 \('x'\).*shape \[2, 8\], got \[3, 8\]"):
        method(torch.randn(3, 8))
    with pytest.raises(td.InputError, match=r"input 0 \('x'\).*dtype float32, got float16"):
        method(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(td.InputError, match="takes 1 tensor input"):
        method(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(td.InputError, match="must be a tensor"):
        method("not a tensor")
