"""Interleaved rotary embeddings (GPT-J, CodeGen, Cohere): ``rotate_every_two`` pairs columns (2i, 2i + 1)
instead of (i, i + D/2). The written-out pattern becomes ``tritondelegate::rotary(..., interleaved=True)``
(passes/fuse_rotary.py), which the rotary kernel runs over x seen as [..., D/2, 2] (no copy), paired
with k like any rotary, and moves into the Q/K/V projection's epilogue as (2i, 2i + 1) column pairs
(passes/fuse_rope_linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import tritondelegate.passes.fuse as fuse
from harness import FLOAT_DTYPES, Fn, Logits, assert_close, check_dynamic, lower_resident
from tritondelegate.ops import rotary_reference

ROTARY = torch.ops.tritondelegate.rotary.default


def rotate_every_two(x):
    """GPT-J's, as transformers writes it."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def gptj_rotary(x, sin, cos):
    """x [B, S, H, D]; sin and cos [B, S, D/2], repeated for each pair (GPT-J's apply_rotary_pos_emb)."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (x * cos) + (rotate_every_two(x) * sin)


class QK(torch.nn.Module):
    def forward(self, q, k, sin, cos):
        return gptj_rotary(q, sin, cos), gptj_rotary(k, sin, cos)


def _fused(lowered) -> list[str]:
    return [f for f in lowered.reports["forward"].fused if f.startswith(("rotary", "rope"))]


def _kernels(lowered) -> list[str]:
    return [launch.kernel for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]


def test_op_reference_is_the_written_out_pattern():
    torch.manual_seed(0)
    x, cos, sin = torch.randn(2, 3, 4, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    expected = x * cos + rotate_every_two(x) * sin
    assert torch.equal(rotary_reference(x, cos, sin, interleaved=True), expected)
    assert torch.equal(ROTARY(x, cos, sin, interleaved=True), expected)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_q_and_k_rotate_in_one_launch(dtype):
    # GQA-shaped: k has fewer heads; the tables broadcast over heads with stride 0.
    torch.manual_seed(0)
    args = [torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 4), torch.randn(2, 5, 4)]
    lowered = lower_resident(QK(), [a.to(dtype) for a in args])
    # the two repeat_interleave copies of the tables (inputs here; folded when constant), one rotary
    assert _kernels(lowered) == ["pointwise", "pointwise", "rotary"]
    launch = lowered.program.methods[0].delegates[0].plan.launches[-1]
    assert launch.constexprs["PAIR"].value
    got = lowered.load().load_method("forward")(*[a.to(dtype) for a in args])
    for g, want in zip(got, QK()(*[a.to(dtype).float() for a in args])):
        assert_close(g, want, dtype=dtype)


def test_the_rewrite_names_interleaved_pairs_and_keeps_one_launch():
    torch.manual_seed(0)
    args = (torch.randn(1, 6, 4, 8), torch.randn(1, 6, 4), torch.randn(1, 6, 4))
    lowered = lower_resident(Fn(gptj_rotary), args)
    (rewrite,) = [f for f in _fused(lowered) if f.startswith("rotary embedding")]
    assert "interleaved" in rewrite
    assert _kernels(lowered).count("rotary") == 1
    assert_close(lowered.load().load_method("forward")(*args), gptj_rotary(*args))


def test_a_transposed_x_and_a_returned_intermediate():
    # x read through a transpose; the rotated half returned too: the pattern must stay written out.
    torch.manual_seed(0)

    def kept(x, sin, cos):
        x = x.transpose(1, 2)
        r = rotate_every_two(x)
        return x * cos[:, None] + r * sin[:, None], r

    args = (torch.randn(1, 4, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8))
    lowered = lower_resident(Fn(kept), args)
    assert not [f for f in _fused(lowered) if f.startswith("rotary embedding")]
    for got, want in zip(lowered.load().load_method("forward")(*args), kept(*args)):
        assert_close(got, want)


def test_not_every_two_is_not_rewritten():
    # Odd and even taken the wrong way round: (x1, -x2) is not a rotation by +angle.
    def wrong(x, cos, sin):
        return x * cos + torch.stack((x[..., ::2], -x[..., 1::2]), dim=-1).flatten(-2) * sin

    args = (torch.randn(1, 3, 8), torch.randn(3, 8), torch.randn(3, 8))
    lowered = lower_resident(Fn(wrong), args)
    assert not [f for f in _fused(lowered) if f.startswith("rotary embedding")]
    assert_close(lowered.load().load_method("forward")(*args), wrong(*args))


def test_dynamic_sequence_length():
    torch.manual_seed(0)
    seq = Dim("seq", min=2, max=16)

    def call(n):
        return (torch.randn(1, n, 4, 8), torch.randn(1, n, 2, 8), torch.randn(1, n, 4), torch.randn(1, n, 4))

    dims = {"q": {1: seq}, "k": {1: seq}, "sin": {1: seq}, "cos": {1: seq}}
    lowered, _ = check_dynamic(QK(), [call(n) for n in (2, 16, 7)], dims, example=call(5))
    assert _kernels(lowered) == ["pointwise", "pointwise", "rotary"]


def _hf(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "gptj":
        config = transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)
        return transformers.GPTJForCausalLM(config)
    if kind == "codegen":
        config = transformers.CodeGenConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                            n_positions=64, n_ctx=64)
        return transformers.CodeGenForCausalLM(config)
    config = transformers.CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.CohereForCausalLM(config)


# launches at 2 layers with every rotary written out (measured before this rewrite existed) and now (the
# partial rotary's cat of the rotated and the passed columns is a view: passes/cat_slices.py; Cohere's
# LayerNorm written out is one: passes/centered_norm.py)
HF = {"gptj": (32, 12), "codegen": (32, 12), "cohere": (34, 12)}


@pytest.mark.parametrize("kind", sorted(HF))
def test_hf_models_rotate_in_fewer_launches_and_match_eager(kind, monkeypatch):
    model = Logits(_hf(kind).eval())
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    lowered = lower_resident(model, (ids,))
    assert sum(lowered.reports["forward"].launches.values()) == HF[kind][1]
    assert lowered.reports["forward"].nodes.host == []
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(ids), model(ids))


def test_gptj_rotary_in_the_projection_epilogue_or_the_rotary_kernel(monkeypatch):
    # GPT-J rotates all of each head (rotary_dim = head): its q and k projections take the rotary in
    # their epilogue; without that pass, the rotary kernel runs it. Both match eager.
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, rotary_dim=8, n_positions=64)
    model = Logits(transformers.GPTJForCausalLM(config).eval())
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids)
    lowered = lower_resident(model, (ids,))
    assert any("rope_linear" in f for f in _fused(lowered)) and "rotary" not in _kernels(lowered)
    assert_close(lowered.load().load_method("forward")(ids), expected)
    monkeypatch.setattr(fuse, "fuse_rope_linear", lambda ep, *a: [])
    lowered = lower_resident(model, (ids,))
    assert "rotary" in _kernels(lowered)
    assert_close(lowered.load().load_method("forward")(ids), expected)


class Projection(torch.nn.Module):
    """One Q/K/V linear, heads viewed [B, S, H, D], q and k rotated interleaved (GPT-J style tables)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 3 * 32)

    def forward(self, x, sin, cos):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 8).unbind(2)
        return gptj_rotary(q, sin, cos), gptj_rotary(k, sin, cos), v


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seq", [1, 7])
def test_interleaved_pairs_in_the_projection_epilogue(seq, dtype):
    # seq 1 takes the GEMV variant, 7 the tl.dot tiles; q and k come out of the GEMM rotated.
    torch.manual_seed(0)
    model = Projection().eval()
    args = (torch.randn(2, seq, 32), torch.randn(2, seq, 4), torch.randn(2, seq, 4))
    low = [a.to(dtype) for a in args]
    lowered = lower_resident(model.to(dtype), low)
    assert any("rope_linear" in f for f in _fused(lowered))
    assert "rotary" not in _kernels(lowered)
    got = lowered.load().load_method("forward")(*low)
    with torch.no_grad():
        expected = model.float()(*[a.float() for a in low])
    for g, want in zip(got, expected):
        assert_close(g, want, dtype=dtype)


class CohereStyle(torch.nn.Module):
    """Tables computed per call from input positions, each angle repeated for its pair (Cohere's
    rotary embedding), then q and k rotated interleaved; the tables cast to q's dtype."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

    def forward(self, q, k, pos):
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        cos, sin = (emb.cos() * 0.5).to(q.dtype)[:, :, None], (emb.sin() * 0.5).to(q.dtype)[:, :, None]
        return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_tables_from_positions_are_computed_in_the_launch(dtype):
    torch.manual_seed(0)
    args = (torch.randn(2, 5, 4, 8, dtype=dtype), torch.randn(2, 5, 2, 8, dtype=dtype), torch.arange(3, 13).view(2, 5))
    lowered = lower_resident(CohereStyle(), args)
    assert any("rotary_angles" in f for f in _fused(lowered))
    kernels = _kernels(lowered)
    assert kernels.count("rotary") == 1 and len(kernels) == 2  # the angles' product, then the rotary
    (launch,) = [x for x in lowered.program.methods[0].delegates[0].plan.launches if x.kernel == "rotary"]
    assert launch.constexprs["ANGLES"].value and launch.constexprs["PAIR"].value
    got = lowered.load().load_method("forward")(*args)
    for g, want in zip(got, CohereStyle()(*args)):
        assert_close(g, want, dtype=dtype)


class ProjectionAngles(torch.nn.Module):
    """One Q/K/V linear whose q and k rotate interleaved by tables computed from input positions."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 3 * 32, bias=False)
        self.rotary = CohereStyle()

    def forward(self, x, pos):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 8).unbind(2)
        return (*self.rotary(q, k, pos), v)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seq", [1, 6])
def test_angles_of_interleaved_pairs_in_the_projection_epilogue(seq, dtype):
    torch.manual_seed(0)
    model = ProjectionAngles().eval()
    low = (torch.randn(2, seq, 32).to(dtype), torch.arange(2 * seq).view(2, seq) + 7)
    lowered = lower_resident(model.to(dtype), low)
    assert any("rope_linear" in f for f in _fused(lowered)) and "rotary" not in _kernels(lowered)
    (rope,) = [x for x in lowered.program.methods[0].delegates[0].plan.launches if x.kernel == "matmul"]
    assert rope.constexprs["ROPE"].value == "positions"  # the angles pos * inv_freq computed in the epilogue
    assert [x.kernel for x in lowered.program.methods[0].delegates[0].plan.launches].count("pointwise_chain") == 0
    got = lowered.load().load_method("forward")(*low)
    with torch.no_grad():
        expected = model.float()(low[0].float(), low[1])
    for g, want in zip(got, expected):
        assert_close(g, want, dtype=dtype)
