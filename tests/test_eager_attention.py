"""Attention written out becomes one attention launch (``passes/eager_attention.py``): transformers'
eager attention (Llama's, ``repeat_kv`` included) becomes ``aten.scaled_dot_product_attention``, and
GPT-OSS's with attention sinks ``tritondelegate::sdpa_sinks`` (the kernel's ``SINKS``), in every
variant the lowering picks (one pass, packed GQA heads, split keys with ``attention_combine``).

Each case is lowered with the public API, run on the simulated device and compared with the model in
fp32 at the dtype's tolerance; the plan must hold one attention launch and no matmul or softmax."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import tritondelegate as td
from harness import FLOAT_DTYPES, TOLERANCES, Fn, check_dynamic, export_decomposed, plan_launches
from tritondelegate.kernels import target
from tritondelegate.passes.eager_attention import eager_attention

aten = torch.ops.aten
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

MIN = torch.finfo(torch.float32).min
SPLIT = target.Target("h100-split", 132, 227 * 1024, split_attention=True)
ONE_PASS = target.Target("h100-one-pass", 132, 227 * 1024, split_attention=False)


class HF(nn.Module):
    """transformers' ``eager_attention_forward`` of Llama or GPT-OSS (``sinks``: one per query head) as
    a module: q [B, H, Lq, E], k/v [B, Hkv, Lk, E], the additive mask an input."""

    def __init__(self, heads: int, groups: int, sinks: bool = False, scaling: float = 0.3):
        super().__init__()
        self.num_key_value_groups, self.scaling, self.use_sinks = groups, scaling, sinks
        self.sinks = nn.Parameter(torch.randn(heads) * 2)
        self.eval()

    def forward(self, q, k, v, mask=None):
        attend = gpt_oss.eager_attention_forward if self.use_sinks else llama.eager_attention_forward
        return attend(self, q, k, v, mask, self.scaling)[0]


def qkv(b, hq, hkv, lq, lk, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, e, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))


def sliding_mask(lq, lk, window, start=None):
    """GPT-OSS's sliding-window mask as transformers builds it for eager attention: 0 where query i
    (at position start + i) sees key j (j <= its position, j > its position - window), else fp32 min."""
    pos = torch.arange(lq) + (lk - lq if start is None else start)
    j = torch.arange(lk)
    keep = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window)
    return torch.zeros(1, 1, lq, lk).masked_fill(~keep, MIN)


def run(model, args, dtype=torch.float32, gpu=None, fold=True):
    """``model`` and ``args`` in ``dtype`` lowered (for ``gpu``), run, and compared with the model in
    fp32; returns (the launches' kernels, the launches, the rewrites)."""
    low = copy.deepcopy(model).to(dtype)
    low_args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True), target=gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = td.lower(torch.export.export(low, low_args), config=config)
    got = lowered.load().load_method("forward")(*low_args)
    with torch.no_grad():
        expected = copy.deepcopy(low).float()(*(a.float() if a.is_floating_point() else a for a in low_args))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)
    launches = plan_launches(lowered)
    return [launch.kernel for launch in launches], launches, lowered.reports["forward"].fused


def constexprs(launch) -> dict:
    return {name: arg.value for name, arg in launch.constexprs.items()}


def one_attention(kernels, matmuls=0):
    assert kernels.count("attention") == 1 and kernels.count("matmul") == matmuls, kernels
    assert not {"softmax", "reduce"} & set(kernels), kernels


# --- plain eager attention --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_llama_eager_attention_is_one_launch(dtype, masked):
    # 4 query heads over 2 key/value heads: repeat_kv's copies become enable_gqa.
    q, k, v = qkv(2, 4, 2, 5, 9, 16)
    mask = torch.randn(2, 1, 5, 9).masked_fill(torch.rand(2, 1, 5, 9) > 0.7, MIN)
    kernels, _, fused = run(HF(4, 2), (q, k, v, mask) if masked else (q, k, v), dtype)
    assert kernels == ["attention"]
    assert any("aten.scaled_dot_product_attention" in f and "enable_gqa" in f for f in fused)


class Causal(nn.Module):
    """Attention written by hand with a causal float mask buffer (``-inf`` above the diagonal), the
    scale a division, the softmax in fp32 and the weights cast back."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("causal", torch.full((n, n), float("-inf")).triu(1))

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores + self.causal[: q.shape[-2], : k.shape[-2]]
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_causal_float_mask_and_division(dtype):
    q, k, v = qkv(1, 3, 3, 7, 7, 24)
    kernels, _, fused = run(Causal(8), (q, k, v), dtype)
    assert kernels == ["attention"]
    assert any("scale 0.204124" in f for f in fused)  # 1 / sqrt(24)


def test_scale_on_q_and_bool_masks():
    # The scale on q before the matmul; masked_fill(~keep, -inf) (keep itself the mask), masked_fill
    # of a drop condition (inverted once, for both attentions that read it) and where(keep, scores,
    # finfo.min) (a float mask where(keep, 0, min)).
    def attend(q, k, v, keep, drop):
        a = ((q * 0.25) @ k.transpose(2, 3)).masked_fill(~keep, float("-inf")).softmax(-1) @ v
        b = torch.where(keep, (q @ v.transpose(2, 3)) * 0.25, MIN).softmax(-1) @ k
        c = (k @ q.transpose(2, 3)).masked_fill(drop, float("-inf")).softmax(-1) @ v
        d = (v @ q.transpose(2, 3)).masked_fill(drop, float("-inf")).softmax(-1) @ k
        return torch.cat([a, b, c, d], -1)

    q, k, v = qkv(2, 2, 2, 6, 6, 16)
    keep = torch.rand(2, 1, 6, 6) > 0.3
    keep[..., 0] = True
    kernels, launches, fused = run(Fn(attend), (q, k, v, keep, ~keep))
    assert kernels.count("attention") == 4 and not {"matmul", "softmax"} & set(kernels)
    assert kernels.count("cat") == 1  # the four results, one launch
    masks = sorted(launch.op.rsplit("_", 1)[0] for launch in launches if launch.kernel == "pointwise")
    assert masks == ["logical_not", "where"]  # not(drop) once, where(keep, 0, min) once
    masks = [f.split(", ")[2].rstrip(")") for f in fused if "eager attention" in f]
    assert sorted(masks) == ["bool mask", "bool mask", "bool mask", "fill mask"]


# --- several additive terms: position biases, ALiBi ------------------------------------------------
class TwoLayers(nn.Module):
    """T5's and MPNet's attention in two layers: the scores (unscaled; divided) plus a position bias
    [1, H, L, L] plus the padding mask [B, 1, 1, L], both layers adding the same two terms."""

    def forward(self, q, k, v, bias, pad):
        a = ((q @ k.transpose(-1, -2)) + bias + pad).softmax(-1, dtype=torch.float32).type_as(q) @ v
        b = ((a @ k.transpose(-1, -2)) / 4 + bias + pad).softmax(-1) @ v
        return b


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_position_bias_and_mask_one_mask_shared(dtype):
    q, k, v = qkv(2, 2, 2, 5, 5, 16)
    bias = torch.randn(1, 2, 5, 5) * 3
    pad = torch.zeros(2, 1, 1, 5).masked_fill(torch.tensor([[False] * 5, [False] * 3 + [True] * 2])[:, None, None], MIN)
    kernels, launches, fused = run(Fn(TwoLayers().forward), (q, k, v, bias, pad), dtype)
    # the two terms summed once in fp32 (one pointwise launch, its cast fused), read by both attentions
    assert kernels.count("attention") == 2 and len(kernels) == 3 and not {"matmul", "softmax"} & set(kernels)
    assert sum("2 terms" in f for f in fused) == 2 and any("scale 0.25" in f for f in fused)


def bloom_attention(q, k, v, alibi, causal, heads):
    """BLOOM's attention: ``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(E))`` on [B * H, L, E] views
    (k transposed as a 3-D view), then ``masked_fill`` of a bool mask with the dtype's min."""
    b, _, lq, e = q.shape
    scores = alibi.baddbmm(q.reshape(b * heads, lq, e), k.reshape(b * heads, -1, e).transpose(1, 2),
                           beta=1.0, alpha=1 / math.sqrt(e)).view(b, heads, lq, -1)
    probs = scores.masked_fill(causal, torch.finfo(q.dtype).min).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.reshape(b * heads, lq, -1), v.reshape(b * heads, -1, e)).view(b, heads, lq, e)


def falcon_attention(q, k, v, alibi, mask):
    """Falcon's with ALiBi: ``(q @ k^T + alibi) * scale + mask``, the scale on the bias too."""
    return (((q @ k.transpose(-1, -2)) + alibi.view(1, 2, 1, -1)) * 0.25 + mask).softmax(-1) @ v


class Neo(nn.Module):
    """GPT-Neo's: ``where(causal, scores, finfo.min as a constant tensor) + mask`` (the fill before
    the term), and MPT's: ``scores * scale + bias`` then ``where(drop, min, .)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal", torch.ones(6, 6, dtype=torch.bool).tril(), persistent=False)

    def forward(self, q, k, v, bias, mask):
        fill = torch.tensor(torch.finfo(q.dtype).min, dtype=q.dtype)
        neo = torch.where(self.causal, q @ k.transpose(-1, -2), fill) + mask
        mpt = torch.where(~self.causal, MIN, (k @ q.transpose(-1, -2)) * 0.25 + bias[:, None])
        return neo.softmax(-1) @ v + mpt.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_and_fills_with_terms(dtype):
    b, h, n = 2, 2, 6
    q, k, v = qkv(b, h, h, n, n, 16)
    alibi = (torch.arange(n) * torch.tensor([0.5, 0.25])[:, None]).repeat(b, 1)[:, None]  # [B * H, 1, L]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    mask = torch.zeros(b, 1, n, n).masked_fill(torch.rand(b, 1, n, n) > 0.8, MIN)
    bloom = Fn(lambda q, k, v, alibi, mask: bloom_attention(q, k, v, alibi, causal, h)
               + falcon_attention(q, k, v, alibi[:h, 0], mask))
    kernels, _, fused = run(bloom, (q, k, v, alibi, mask), dtype)
    assert kernels.count("attention") == 2 and not {"matmul", "softmax"} & set(kernels), kernels
    assert sorted(f.split(", ")[2].rstrip(")") for f in fused if "eager attention" in f) == ["1 term and 1 condition",
                                                                                            "2 terms"]
    kernels, _, fused = run(Neo(), (q, k, v, alibi.view(b, h, 1, n)[0], mask), dtype)
    assert kernels.count("attention") == 2 and not {"matmul", "softmax"} & set(kernels), kernels
    assert sum("1 term and 1 condition" in f for f in fused) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_positions_mask_in_the_kernel(dtype):
    # transformers' static-cache eager mask where(arange(S) <= positions, 0, finfo.min) plus an ALiBi
    # term stays a float mask; alone it is compared in the kernel (position_mask): no mask launch.
    def attend(q, k, v, pos, alibi):
        keep = torch.arange(k.shape[-2])[None, None, None, :] <= pos[None, None, :, None]
        mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        plain = (q @ k.transpose(-1, -2) * 0.25 + mask).softmax(-1, dtype=torch.float32).to(q.dtype) @ v
        return plain + (q @ v.transpose(-1, -2) * 0.25 + alibi + mask).softmax(-1) @ k

    q, k, v = qkv(1, 2, 2, 3, 20, 16)
    kernels, launches, fused = run(Fn(attend), (q, k, v, torch.tensor([4, 11, 19]), torch.randn(2, 1, 20)), dtype)
    assert kernels.count("attention") == 2 and not {"matmul", "softmax"} & set(kernels), kernels
    assert sorted(constexprs(launch)["MASK"] for launch in launches if launch.kernel == "attention") == ["float",
                                                                                                       "positions"]
    assert any("sdpa_positions" in f for f in fused)


# --- GPT-OSS's attention sinks ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lq", [1, 6])
def test_gpt_oss_sinks_sliding_window(dtype, lq):
    # Decode (one query) and prefill over 11 keys, a sliding window of 4, GQA 4 over 2.
    q, k, v = qkv(1, 4, 2, lq, 11, 16)
    kernels, launches, fused = run(HF(4, 2, sinks=True), (q, k, v, sliding_mask(lq, 11, 4)), dtype, ONE_PASS)
    assert kernels == ["attention"]
    assert constexprs(launches[0])["SINKS"] and constexprs(launches[0])["MASK"] == "float"
    assert any("tritondelegate::sdpa_sinks" in f and "enable_gqa" in f for f in fused)


def test_gpt_oss_sinks_packed_heads_and_no_mask():
    # 6 query heads over 2 key heads, 2 queries: PACK 3, each packed row reads its own head's sink.
    q, k, v = qkv(2, 6, 2, 2, 13, 16)
    kernels, launches, _ = run(HF(6, 3, sinks=True), (q, k, v), gpu=ONE_PASS)
    assert kernels == ["attention"]
    assert constexprs(launches[0])["PACK"] == 3 and constexprs(launches[0])["MASK"] == "none"


def test_gpt_oss_sinks_rows_masked_out():
    # A row whose keys are all masked (fp32 min) is the sink's alone: 0, as eager gives.
    q, k, v = qkv(1, 2, 2, 3, 8, 16)
    mask = sliding_mask(3, 8, 3)
    mask[..., 1, :] = MIN
    kernels, _, _ = run(HF(2, 1, sinks=True), (q, k, v, mask), gpu=ONE_PASS)
    assert kernels == ["attention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_sinks_split_keys(dtype):
    # Decode over 520 keys at 2 key heads: the keys are split over programs and attention_combine
    # counts the sink once; the window keeps the last 40 keys only, so most splits keep none (fp32
    # min: they average their keys, weighted 0 in the combine; -inf: they store m = -inf, l = 0).
    q, k, v = qkv(1, 4, 2, 1, 520, 16)
    window = sliding_mask(1, 520, 40)
    for mask in (torch.zeros(1, 1, 1, 520), window, window.clamp(min=-1e30).masked_fill(window < -1e30, float("-inf"))):
        kernels, launches, _ = run(HF(4, 2, sinks=True), (q, k, v, mask), dtype, SPLIT)
        assert kernels == ["attention", "attention_combine"]
        attn, combine = (constexprs(launch) for launch in launches)
        assert attn["SPLIT"] and attn["SINKS"] and combine["SINKS"] and launches[0].grid[2] >= 2


def test_gpt_oss_decoder_layer_prefill_and_decode():
    # The sinks form with a whole decoder's eager attention: transformers' GPT-OSS attention module.
    config = gpt_oss.GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  num_hidden_layers=1, vocab_size=16, intermediate_size=16, num_local_experts=2,
                                  num_experts_per_tok=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = gpt_oss.GptOssAttention(config, 0).eval()
    nn.init.normal_(attn.sinks)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x, cos, sin, mask):
            return self.attn(x, (cos, sin), mask)[0]

    for lq in (1, 5):
        x, angles = torch.randn(1, lq, 32), torch.randn(1, lq, 4)
        kernels, _, _ = run(Layer(), (x, angles.cos(), angles.sin(), sliding_mask(lq, lq, 3)))
        one_attention(kernels, matmuls=2)  # the Q/K/V projections (one) and the output projection


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_gpt_oss_eager(dtype):
    # The op's reference (what the host runs) computes what GPT-OSS's eager attention computes, bit for bit.
    model = HF(4, 2, sinks=True).to(dtype)
    q, k, v = (t.to(dtype) for t in qkv(2, 4, 2, 3, 7, 16))
    mask = sliding_mask(3, 7, 4).to(dtype)
    with torch.no_grad():
        expected = model(q, k, v, mask)
        got = torch.ops.tritondelegate.sdpa_sinks(q, k, v, mask, model.sinks, 0.3, True)
    assert torch.equal(got.transpose(1, 2), expected)


def test_sinks_on_the_host():
    # A partitioner that does not take sdpa_sinks leaves it to the host, which runs the reference.
    model, args = HF(4, 2, sinks=True), (*qkv(1, 4, 2, 3, 7, 16), sliding_mask(3, 7, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = td.lower(torch.export.export(model, args), td.TritonPartitioner("cuda:0", ops=["aten.linear"]))
    assert any(op == "tritondelegate.sdpa_sinks.default" for _, op, _ in lowered.reports["forward"].nodes.host)
    with torch.no_grad():
        torch.testing.assert_close(lowered.load().load_method("forward")(*args), model(*args))


# --- refused ----------------------------------------------------------------------------------------
def _rewrites(fn, args) -> tuple[list, str, str]:
    ep = export_decomposed(Fn(fn), args)
    before = ep.graph_module.code
    done = eager_attention(ep)
    return done, before, ep.graph_module.code


def test_intermediates_read_elsewhere_stay():
    q, k, v = qkv(1, 2, 2, 3, 5, 16)

    def returns_weights(q, k, v):
        w = (q @ k.transpose(-1, -2) * 0.25).softmax(-1)
        return w @ v, w

    def scores_twice(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        return s.softmax(-1) @ v, s.amax(-1)

    def sinks_logits_twice(q, k, v):
        s = q @ k.transpose(-1, -2)
        logits = torch.cat([s, torch.zeros(1, 2, 3, 1)], -1)
        return logits.softmax(-1)[..., :-1] @ v, logits.sum()

    for fn in (returns_weights, scores_twice, sinks_logits_twice):
        done, before, after = _rewrites(fn, (q, k, v))
        assert done == [] and before == after, fn.__name__


def test_other_softmaxes_and_ops_stay():
    q, k, v = qkv(1, 2, 2, 5, 5, 16)
    for fn in (lambda q, k, v: (q @ k.transpose(-1, -2)).softmax(-2) @ v,  # over the queries
               lambda q, k, v: torch.tanh(q @ k.transpose(-1, -2)).softmax(-1) @ v,  # soft-capped
               lambda q, k, v: ((q @ k.transpose(-1, -2)) + 1.0).softmax(-1) @ v,  # a number added
               lambda q, k, v: (q @ k.transpose(-1, -2)).masked_fill(k[..., :1].transpose(-1, -2) > 0, -1e4)
               .softmax(-1) @ v):  # a finite fill that does not swallow the scores
        done, before, after = _rewrites(fn, (q, k, v))
        assert done == [] and before == after


def test_terms_refused():
    q, k, v = qkv(1, 2, 2, 5, 5, 16)
    bias, pad = torch.randn(1, 2, 5, 5), torch.zeros(3, 1, 1, 5)
    keep = torch.rand(1, 1, 5, 5) > 0.3

    def returns_weights(q, k, v):
        w = ((q @ k.transpose(-1, -2)) + bias + bias.exp()).softmax(-1)
        return w @ v, w

    for fn in (lambda q, k, v: ((q @ k.transpose(-1, -2)) + bias + pad).softmax(-1) @ v,  # a bigger batch
               lambda q, k, v: ((q @ k.transpose(-1, -2)).masked_fill(~keep, MIN) * -0.5 + bias).softmax(-1) @ v,
               returns_weights):
        done, before, after = _rewrites(fn, (q, k, v))
        assert done == [] and before == after


def test_unfused_pattern_still_runs():
    # Refused: the weights returned too; the written-out launches run as before.
    def attend(q, k, v):
        w = (q @ k.transpose(-1, -2) * 0.25).softmax(-1)
        return w @ v, w

    both = Fn(lambda q, k, v: torch.cat([t.flatten() for t in attend(q, k, v)]))
    kernels, _, fused = run(both, qkv(1, 2, 2, 3, 5, 16))
    assert "attention" not in kernels and "matmul" in kernels and not any("eager attention" in f for f in fused)


def test_dynamic_lengths():
    # Self-attention over a dynamic length: the sinks' slice [..., :-1] of a dynamic size.
    seq = torch.export.Dim("seq", min=2, max=24)
    model = HF(4, 2, sinks=True)
    calls = [qkv(1, 4, 2, n, n, 16, seed=n) for n in (24, 2, 9)]
    lowered, _ = check_dynamic(model, calls, ({2: seq}, {2: seq}, {2: seq}), scale=1.0)
    one_attention([launch.kernel for launch in plan_launches(lowered)])
