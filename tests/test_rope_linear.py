"""The rotary embedding in the epilogue of the projection that produces the query and key:
``tritondelegate::rope_linear`` (ops.py), its kernel path (kernels/matmul.py, ``ROPE``) and the rewrite
(passes/fuse_rope_linear.py), through the public API."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import tritondelegate as td
import tritondelegate.passes.fuse as fuse
from harness import FLOAT_DTYPES, Logits, assert_close, check_dynamic, plan_launches
from tritondelegate import models
from tritondelegate.kernels.traffic import method_traffic

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
# A GPU of 2 SMs: tiles of whole heads (a per-head norm in the epilogue) fill it even at these sizes;
# on an H100 (the default target) they would not, and the norms stay apart (see the test below).
SMALL_GPU = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True),
                           target=td.Target("two-sm", 2, 227 * 1024))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate(x, cos, sin, dims=None):
    """x * cos + rotate_half(x) * sin over the first ``dims`` of the last dim (all by default)."""
    if dims is None:
        return x * cos + rotate_half(x) * sin
    r, rest = x[..., :dims], x[..., dims:]
    return torch.cat((r * cos + rotate_half(r) * sin, rest), dim=-1)


class Projection(torch.nn.Module):
    """Query, key and value of an attention layer, returned rotated (q, k) and as they are (v).

    ``layout``: "separate" (three linears, grouped-query: 4 query heads, 2 key heads) or "interleaved"
    (one linear whose heads hold [q, k, v] side by side, GPT-NeoX's). ``tables``: "inputs" (cos and
    sin given per call), "positions" (computed per call from the positions given: angles), "static"
    (computed from arange: folded into constants). ``rotary_dims``: rotate only the first dims of each
    head (a partial rotary factor). ``head_norm``: q and k RMS-normalized per head before the rotation,
    written out as Qwen3 writes it (its own weight for each)."""

    def __init__(self, layout="separate", tables="positions", bias=False, rotary_dims=None, dim=32, head=8,
                 head_norm=False):
        super().__init__()
        self.layout, self.tables, self.rotary_dims, self.head = layout, tables, rotary_dims, head
        self.norms = torch.nn.ParameterList([torch.nn.Parameter(1 + 0.1 * torch.randn(head)) for _ in range(2)]
                                            if head_norm else [])
        if layout == "separate":
            self.q = torch.nn.Linear(dim, 4 * head, bias=bias)
            self.k = torch.nn.Linear(dim, 2 * head, bias=bias)
            self.v = torch.nn.Linear(dim, 2 * head, bias=bias)
        else:
            self.qkv = torch.nn.Linear(dim, 3 * 4 * head, bias=bias)
        width = rotary_dims or head
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, width, 2).float() / width))

    def _tables(self, seq, positions, cos, sin):
        if self.tables == "inputs":
            return cos, sin
        pos = positions if self.tables == "positions" else torch.arange(seq)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _heads(self, x):
        b, s, _ = x.shape
        if self.layout == "separate":
            return [t.view(b, s, -1, self.head).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x))]
        qkv = self.qkv(x).view(b, s, 4, 3 * self.head)
        return [t.transpose(1, 2) for t in qkv.split(self.head, dim=-1)]

    def _norm(self, t, k):
        if not self.norms:
            return t
        t32 = t.float()
        t32 = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norms[k] * t32.to(t.dtype)

    def forward(self, x, positions, cos, sin):
        q, k, v = self._heads(x)
        q, k = self._norm(q, 0), self._norm(k, 1)
        cos, sin = self._tables(x.shape[1], positions, cos, sin)
        return (rotate(q, cos.to(x.dtype), sin.to(x.dtype), self.rotary_dims),
                rotate(k, cos.to(x.dtype), sin.to(x.dtype), self.rotary_dims), v)


def _lower(model, args, dynamic_shapes=None, config=CONFIG):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes), config=config)


def _epilogues(lowered, method="forward") -> int:
    return sum(f.startswith("rotary in the epilogue") for f in lowered.reports[method].fused)


def _rope_launches(lowered, method: int = 0) -> list[str]:
    return [launch.constexprs["ROPE"].value for launch in plan_launches(lowered, method)
            if launch.kernel == "matmul" and "ROPE" in launch.constexprs]


def _args(model, batch=1, seq=5, dim=32, dtype=torch.float32):
    torch.manual_seed(1)
    width = model.rotary_dims or model.head
    return (torch.randn(batch, seq, dim, dtype=dtype), torch.arange(3, 3 + seq),
            torch.randn(seq, width), torch.randn(seq, width))


def _check(model, args, dtype=torch.float32, config=CONFIG):
    """Lower ``model`` in ``dtype``, run it and compare with the same rounded weights in fp32."""
    low = copy.deepcopy(model).to(dtype)
    low_args = tuple(a.to(dtype) if a.is_floating_point() and a.dim() == 3 else a for a in args)
    lowered = _lower(low, low_args, config=config)
    got = lowered.load().load_method()(*low_args)
    with torch.no_grad():
        ref_args = tuple(a.float() if a.is_floating_point() else a for a in low_args)
        expected = copy.deepcopy(low).float()(*ref_args)
    for g, e in zip(got, expected):
        assert_close(g, e, dtype=dtype)
    return lowered


# --- the rewrite over layouts, tables and dtypes ---------------------------------------------------
@pytest.mark.parametrize("layout,tables,bias,rotary_dims", [
    ("separate", "positions", False, None),   # angles computed in the epilogue
    ("separate", "inputs", True, None),       # cos and sin read as given, a bias permuted with the rows
    ("separate", "static", False, None),      # tables folded into constants
    ("interleaved", "positions", True, 4),    # GPT-NeoX: heads [q, k, v], half of each head rotated
    ("interleaved", "inputs", False, None),
])
def test_rotary_moves_into_the_projection(layout, tables, bias, rotary_dims):
    model = Projection(layout, tables, bias, rotary_dims).eval()
    lowered = _check(model, _args(model, batch=2))
    assert _epilogues(lowered) == 1
    # positions: the angles positions * inv_freq are computed in the epilogue, not in a launch of their own
    assert _rope_launches(lowered) == ["tables" if tables in ("inputs", "static") else "positions"]
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert "rotary" not in kernels and kernels.count("matmul") == 1
    assert tables != "positions" or "pointwise_chain" not in kernels, kernels  # no launch for the angles


class TwoProjections(Projection):
    """The key from another input than the query and value (a cross-attention's memory, a latent): the
    rotary pair's q and k are views of two linears (q and v share one)."""

    def _heads(self, x):
        b, s, _ = x.shape
        return [t.view(b, s, -1, self.head).transpose(1, 2) for t in (self.q(x), self.k(x.flip(-1)), self.v(x))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", ["positions", "inputs"])
def test_a_pair_over_two_projections_rotates_in_both_epilogues(dtype, tables):
    model = TwoProjections("separate", tables, bias=True).eval()
    lowered = _check(model, _args(model, batch=2), dtype)
    assert _epilogues(lowered) == 1  # one rewrite: the pair into both linears
    assert len(_rope_launches(lowered)) == 2
    assert "rotary" not in [launch.kernel for launch in plan_launches(lowered)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seq", [1, 7])  # 1: the GEMV tile of a decode step; 7: tl.dot's
@pytest.mark.parametrize("head_norm", [False, True])
def test_every_dtype(dtype, seq, head_norm):
    model = Projection("separate", "positions", bias=True, head_norm=head_norm).eval()
    lowered = _check(model, _args(model, seq=seq), dtype, SMALL_GPU)
    assert _epilogues(lowered) == 1
    norms = [launch.constexprs["NORM_E"].value for launch in plan_launches(lowered) if "NORM_E" in launch.constexprs]
    assert norms == ([model.head] if head_norm else [])
    assert "norm" not in [launch.kernel for launch in plan_launches(lowered)]


def test_head_norm_in_interleaved_heads_with_tables_given():
    """GPT-NeoX's interleaved heads with Qwen3's per-head norms: the normed heads come first in the
    GEMM's columns, whatever their place in the result."""
    model = Projection("interleaved", "inputs", head_norm=True).eval()
    lowered = _check(model, _args(model, batch=2), config=SMALL_GPU)
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert _epilogues(lowered) == 1 and kernels.count("matmul") == 1 and not {"norm", "rotary"} & set(kernels)


def test_head_norm_of_a_partial_rotation_is_not_rewritten():
    """A per-head norm over the whole head, a rotation over half of it: the epilogue normalizes whole
    rotated heads only."""
    model = Projection("separate", "positions", rotary_dims=4, head_norm=True).eval()
    lowered = _check(model, _args(model), config=SMALL_GPU)
    assert _epilogues(lowered) == 0


def test_head_norm_left_apart_when_its_tiles_would_not_fill_the_gpu():
    """8 heads in one row tile are 8 programs: on an H100's 132 SMs the norms stay out of the
    projection (it keeps GEMV tiles that stream its weight at full width) and run in the rotary's
    launch instead (test_head_norm.py)."""
    model = Projection("separate", "positions", head_norm=True).eval()
    lowered = _check(model, _args(model, seq=1))
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert _epilogues(lowered) == 0 and "norm" not in kernels and kernels.count("rotary") == 1


def test_raw_query_read_elsewhere_is_not_rewritten():
    """The query before rotation is also returned: rotating it in place would change that result."""

    class AlsoRaw(Projection):
        def forward(self, x, positions, cos, sin):
            q, k, v = self._heads(x)
            cos, sin = self._tables(x.shape[1], positions, cos, sin)
            return rotate(q, cos, sin), rotate(k, cos, sin), v, q * 2

    model = AlsoRaw().eval()
    lowered = _check(model, _args(model))
    assert _epilogues(lowered) == 0 and "rotary" in [launch.kernel for launch in plan_launches(lowered)]


def test_tables_per_head_are_not_rewritten():
    """Tables that differ per head (shape [heads, seq, D]) cannot be indexed by the result's rows alone."""

    class PerHead(Projection):
        def forward(self, x, positions, cos, sin):
            q, k, v = self._heads(x)
            return rotate(q, cos, sin), k, v

    model = PerHead(tables="inputs").eval()
    args = _args(model)
    args = (*args[:2], torch.randn(4, 5, 8), torch.randn(4, 5, 8))
    lowered = _check(model, args)
    assert _epilogues(lowered) == 0


def test_dynamic_sequence_length():
    """One program for seq 1..16 of the demo decoder: the rows' inner count is the dynamic length."""
    model, _ = models.demo_decoder(n_layers=1, max_seq_len=32, seed=0)
    calls = [(torch.randint(0, model.cfg.vocab_size, (1, n)),) for n in (1, 16, 7)]
    lowered, _ = check_dynamic(model, calls, {"input_ids": {1: Dim("seq", max=16)}}, example=(calls[2][0],))
    assert _epilogues(lowered) == 1 and len(_rope_launches(lowered)) == 1


def test_angles_over_a_dynamic_number_of_positions_are_computed_in_the_epilogue():
    """Positions of a dynamic length (a KV-cache step's, one method for prefill and decode): the inverse
    frequencies broadcast over that length take its size from the method's input, so the epilogue
    computes the angles and no launch does."""
    model = Projection("separate", "positions", bias=True).eval()
    seq = Dim("seq", max=16)
    lowered = _lower(model, _args(model), dynamic_shapes=({1: seq}, {0: seq}, {0: seq}, {0: seq}))
    method = lowered.load().load_method()
    for n in (5, 1, 16):
        args = _args(model, seq=n)
        with torch.no_grad():
            for got, expected in zip(method(*args), model(*args)):
                assert_close(got, expected, dtype=torch.float32)
    assert _rope_launches(lowered) == ["positions"]
    assert "pointwise_chain" not in [launch.kernel for launch in plan_launches(lowered)]  # no angles launch


# --- models -----------------------------------------------------------------------------------------
def test_demo_decoder_five_launches_per_layer(monkeypatch):
    """rms + qkv + rotary, attention, o + residual, rms + gate/up, down + residual: 5 per layer; the
    separate rotary launch (and its q and k round trip) is gone, and so are its modelled bytes."""
    counts, traffic = {}, {}
    for n in (1, 2):
        model, args = models.demo_decoder(n_layers=n, seed=0)
        lowered = _lower(model, args)
        counts[n] = len(plan_launches(lowered))
        assert _epilogues(lowered) == n
    assert counts[2] - counts[1] == 5 and counts[1] - 5 == 2
    with torch.no_grad():
        expected = model(*args)
    assert_close(lowered.load().load_method()(*args), expected)
    traffic["fused"] = method_traffic(lowered.program.methods[0])["bytes"]
    monkeypatch.setattr(fuse, "fuse_rope_linear", lambda ep, *a: [])
    traffic["apart"] = method_traffic(_lower(model, args).program.methods[0])["bytes"]
    assert traffic["fused"] < traffic["apart"]


@pytest.mark.parametrize("arch", ["qwen2", "phi", "gpt_neox", "qwen3", "gemma3"])
def test_hf_architectures(arch):
    """Qwen2 (a q/k/v bias), Phi (a partial rotary factor, separate projections), GPT-NeoX (heads
    interleaved in one projection, a partial rotary factor), Qwen3 and Gemma3 (q and k RMS-normalized
    per head, Gemma3's weights as 1 + w): each layer's rotary (and norms) in its projection."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **common))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **common))
    elif arch == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=16,
                                                                             sliding_window=4, **common))
    elif arch == "phi":
        model = transformers.PhiForCausalLM(transformers.PhiConfig(partial_rotary_factor=0.5, **common))
    else:
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(rotary_pct=0.5, **common))
    model = Logits(model.eval())
    args = (torch.randint(0, 64, (2, 5)),)
    lowered = _lower(model, args, config=SMALL_GPU)
    assert _epilogues(lowered) == 2 and not lowered.reports["forward"].nodes.host
    with torch.no_grad():
        expected = model(*args)
    assert_close(lowered.load().load_method()(*args), expected)


def test_kv_cache_step_five_launches_per_layer():
    """The demo's KV-cache decoder, prefill and decode: the rotated key goes to the cache from the
    projection's result (the attention launch writes the rotated view into the cache), the query to
    attention."""
    from tritondelegate.models import export_prefill_decode, kv_cache_decoder

    counts = {}
    for n in (1, 2):
        lowered = td.lower(export_prefill_decode(kv_cache_decoder(n_layers=n), 5), config=CONFIG)
        counts[n] = {m: sum(lowered.reports[m].launches.values()) for m in ("prefill", "decode")}
        assert all(_epilogues(lowered, m) == n for m in ("prefill", "decode"))
    assert all(counts[2][m] - counts[1][m] == 5 for m in ("prefill", "decode"))


def test_op_reference_matches_the_pattern():
    """The op's reference (a host fallback) is the projection followed by the rotation, pair by pair."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 16), torch.randn(12, 16), torch.randn(12)
    angles = torch.randn(3, 2)  # [seq, D / 2] for one head of D = 4 at columns 4..7; the rest pass
    pairs = torch.tensor([[4, 6, 0, 0], [5, 7, 1, 1], [0, 1, -1, -1], [2, 3, -1, -1], [8, 9, -1, -1],
                          [10, 11, -1, -1]], dtype=torch.int32)
    order = pairs[:, :2].reshape(-1)
    got = torch.ops.tritondelegate.rope_linear(x, w[order], b[order], pairs, angles, None, [-1, 0], 1.0,
                                               torch.float32)
    y = F.linear(x, w, b)
    emb = torch.cat((angles, angles), -1)
    expected = y.clone()
    expected[..., 4:8] = rotate(y[..., 4:8], emb.cos(), emb.sin())
    torch.testing.assert_close(got, expected)
