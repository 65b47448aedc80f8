"""A Mixture-of-Experts layer's dispatch in fewer launches (passes/expert_dispatch.py): the token rows
read through the expert order in the grouped GEMM's loads (``ROWS`` in kernels/grouped_mm.py), the
offsets per expert as one cumulative histogram (``CUMULATIVE``/``CAST`` in kernels/histogram.py), and
the unsort as one scatter. Each against eager on the same inputs: every dtype, both GEMM variants,
negative and repeated rows, values outside the bins; and what must stay as it is stays."""

from __future__ import annotations

import pytest
import torch

from harness import FLOAT_DTYPES, TOLERANCES, Fn, lower_resident, plan_launches

pytest.importorskip("transformers.integrations.moe")
GMM = torch.ops.transformers.grouped_mm_fallback
F = torch.nn.functional


def _kernels(lowered) -> list[str]:
    return [launch.kernel for launch in plan_launches(lowered)]


def _fused(lowered) -> str:
    return "\n".join(d for report in lowered.reports.values() for d in report.fused)


def _run(fn, args, expected=None, atol=0.0, rtol=0.0):
    lowered = lower_resident(Fn(fn), args)
    out = lowered.load().load_method()(*args)
    torch.testing.assert_close(out, fn(*args) if expected is None else expected, atol=atol, rtol=rtol)
    return lowered


# --- rows read through the expert order ------------------------------------------------------------
class Dispatch(torch.nn.Module):
    """transformers' grouped_mm experts: tokens sorted by expert, rows gathered, gate/up, down."""

    def __init__(self, E, K, N, dtype, k=2, gated=True):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(E, (2 if gated else 1) * N, K).to(dtype) / K ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(E, K, N).to(dtype) / N ** 0.5)
        self.E, self.k, self.gated = E, k, gated

    def forward(self, hidden, top_k_index, offs):
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # ties in token order, as the kernel
        rows = hidden[perm // self.k]
        y = GMM(rows, self.gate_up.transpose(1, 2), offs)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = torch.clamp(y, -1, 1) * torch.sigmoid(y)  # GPT-OSS gates its own way: no GLU match
        return GMM(y, self.down.transpose(1, 2), offs), ids


def _routing(tokens, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    offs = torch.bincount(index.reshape(-1), minlength=E).cumsum(0).to(torch.int32)
    return index, offs


@pytest.mark.parametrize("tokens", [2, 19])  # per-row tiles (decode) and segment tiles (prefill)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_the_experts_read_token_rows_in_place(tokens, gated, dtype):
    torch.manual_seed(0)
    model = Dispatch(4, 16, 12, dtype, gated=gated).eval()
    index, offs = _routing(tokens, 4, 2, seed=tokens)
    args = (torch.randn(tokens, 16).to(dtype), index, offs)
    lowered = lower_resident(model, args)
    assert "grouped_mm" in _kernels(lowered) and "gather" not in _kernels(lowered), _kernels(lowered)
    kind = "glu_grouped_mm" if gated else "gathered_grouped_mm"
    assert "// 2 -> " in _fused(lowered) and f"tritondelegate::{kind}" in _fused(lowered), _fused(lowered)
    grouped = [l for l in plan_launches(lowered) if l.kernel == "grouped_mm"]
    assert [l.constexprs["ROWS"].value for l in grouped] == [True, False]
    with torch.no_grad():  # against the same rounded operands in fp32
        expected = Dispatch(4, 16, 12, torch.float32, gated=gated)
        expected.load_state_dict({n: p.float() for n, p in model.state_dict().items()})
        want = expected(args[0].float(), index, offs)
    out, ids = lowered.load().load_method()(*args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), want[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(ids, want[1])


def test_rows_as_given_negative_ones_from_the_end():
    torch.manual_seed(1)
    w = torch.randn(3, 8, 5)

    def fn(hidden, rows, offs):  # rows straight from an input: -1 is the last row, rows repeat
        return GMM(hidden[rows], w, offs)

    args = (torch.randn(6, 8), torch.tensor([-1, 0, 5, -6, 2, 2, -3]), torch.tensor([2, 2, 7], dtype=torch.int32))
    lowered = _run(fn, args, atol=1e-5, rtol=1e-5)
    assert _kernels(lowered) == ["grouped_mm"]


def test_gathered_rows_read_twice_stay_gathered():
    torch.manual_seed(2)
    w = torch.randn(2, 8, 4)

    def fn(hidden, rows, offs):  # the gathered rows are also returned: they must be written
        x = hidden[rows // 3]
        return GMM(x, w, offs), x

    args = (torch.randn(5, 8), torch.tensor([0, 14, 3, 7]), torch.tensor([1, 4], dtype=torch.int32))
    lowered = _run(fn, args, atol=1e-5, rtol=1e-5)
    assert "expert rows" not in _fused(lowered)
    assert _kernels(lowered).count("gather") == 1


# --- offsets per expert in one launch -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offsets_per_expert_are_one_cumulative_histogram(dtype):
    def fn(ids):  # transformers' offsets from the sorted expert ids; -1 and 300 fall outside the bins
        return torch.cumsum(torch.histc(ids.float(), bins=200, min=0, max=199), dim=0, dtype=dtype)

    ids = torch.cat([torch.randint(0, 200, (517,)), torch.tensor([-1, 300, 199, 0])]).sort().values
    lowered = _run(fn, (ids,))
    assert _kernels(lowered) == ["histc"]  # the cast, the counts and the running sum: one launch
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["CUMULATIVE"].value and launch.constexprs["CAST"].value
    assert launch.grid == (2,)  # 200 bins over two programs, each counting the bins up to its own


@pytest.mark.parametrize("fn", [
    lambda x: torch.histc(x, 7, -1.5, 2).cumsum(0),  # no cast: fp32 running sums
    lambda x: torch.histc(x.double(), 5).cumsum(-1, dtype=torch.int64),  # the data's own range
    lambda x: torch.histc(x[::2].abs().float(), 4, 0, 1).cumsum(0),  # a strided, computed input
])
def test_cumulative_histograms_of_floats_match_eager(fn):
    x = torch.randn(41)
    lowered = _run(fn, (x,))
    assert "expert offsets in one launch" in _fused(lowered)


def test_counts_read_elsewhere_or_in_half_precision_stay_apart():
    def shared(x):  # the counts are returned too
        h = torch.histc(x, 4, -1, 1)
        return h.cumsum(0), h

    def half(x):  # fp16 running sums round: the kernel counts exactly, so no merge
        return torch.histc(x.half(), 4, -1, 1).cumsum(0)

    x = torch.randn(30)
    for fn in (shared, half):
        lowered = _run(fn, (x,))
        assert "expert offsets" not in _fused(lowered), fn.__name__
        assert _kernels(lowered).count("cumsum") == 1


# --- the unsort as one scatter --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6,), (6, 5), (6, 2, 3)])
def test_rows_go_back_in_token_order_by_one_scatter(shape):
    def fn(keys, y):
        _, perm = torch.sort(keys)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv]

    args = (torch.tensor([3, 0, 2, 3, 1, 0]), torch.randn(shape))
    lowered = _run(fn, args)
    assert "expert unsort" in _fused(lowered)
    assert _kernels(lowered) == ["rank", "scatter"]


def test_an_inverse_of_indices_that_are_not_a_sort_stays_an_inverse():
    def fn(perm, y):  # perm is an input: nothing says it is a permutation, so y[inv] keeps its meaning
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv], inv

    perm = torch.tensor([2, 0, 3, 1])
    lowered = _run(fn, (perm, torch.randn(4, 3)))
    assert "expert unsort" not in _fused(lowered)


# --- the rows stored in token order by the GEMM ------------------------------------------------------
def _unsorted(y, perm):
    """transformers' unsort: the inverse order, then the rows gathered by it."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))
    return y[inv]


class Experts(torch.nn.Module):
    """One grouped GEMM per (token, slot) row in expert order, weighted and put back in token order; with
    ``bias``, a per-expert bias gathered by the sorted expert ids (GPT-OSS's), with ``gather`` the rows
    read through the sort (``hidden[perm // k]``)."""

    def __init__(self, E, K, N, dtype, bias=False, gather=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(E, N, K).to(dtype) / K ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(E, N).to(dtype)) if bias else None
        self.gather = gather

    def forward(self, x, top_k_index, top_k_weights):
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        experts = self.w.shape[0]
        offs = torch.cumsum(torch.histc(ids.float(), bins=experts, min=0, max=experts - 1), 0, dtype=torch.int32)
        rows = x[perm // top_k_index.shape[1]] if self.gather else x
        y = GMM(rows, self.w.transpose(1, 2), offs)
        if self.b is not None:
            y = y + self.b[ids]
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        return _unsorted(y, perm).view(top_k_index.shape[0], top_k_index.shape[1], -1).sum(1)


@pytest.mark.parametrize("tokens", [3, 21])  # per-row tiles (decode) and segment tiles (prefill)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bias,gather", [(False, False), (True, False), (False, True), (True, True)])
def test_the_experts_rows_are_stored_in_token_order(tokens, dtype, bias, gather):
    torch.manual_seed(4)
    E, K, N, k = 5, 16, 12, 2
    model = Experts(E, K, N, dtype, bias, gather).eval()
    index, _ = _routing(tokens, E, k, seed=tokens)
    weights = torch.softmax(torch.randn(tokens, k), -1).to(dtype)
    x = torch.randn(tokens if gather else tokens * k, K).to(dtype)
    args = (x, index, weights)
    lowered = lower_resident(model, args)
    assert "expert rows stored in token order" in _fused(lowered), _fused(lowered)
    kernels = _kernels(lowered)
    assert "scatter" not in kernels and "gather" not in kernels, kernels  # the bias read per expert in the GEMM
    assert kernels.count("sort_offsets") == 1, kernels  # the order and the offsets
    (launch,) = [l for l in plan_launches(lowered) if l.kernel == "grouped_mm"]
    assert launch.constexprs["DEST"].value and launch.constexprs["ROWS"].value == gather
    assert launch.constexprs["EPILOGUE"].value == 1  # the routing weights
    assert launch.constexprs.get("HAS_BIAS") is None or launch.constexprs["HAS_BIAS"].value == bias
    assert ("experts' biases in the GEMM" in _fused(lowered)) == bias
    with torch.no_grad():  # against the same rounded operands in fp32
        expected = Experts(E, K, N, torch.float32, bias, gather)
        expected.load_state_dict({n: p.float() for n, p in model.state_dict().items()})
        want = expected(x.float(), index, weights.float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(lowered.load().load_method()(*args).float(), want, atol=atol, rtol=rtol)


def test_rows_past_the_last_expert_and_dests_from_the_end():
    """The op itself: rows past offs[-1] are stored as 0 at their rows; a dest of -1 is the last row
    (as index_put counts)."""
    torch.manual_seed(5)
    w = torch.randn(2, 8, 4)

    def fn(x, dest, offs):
        return torch.ops.tritondelegate.scattered_grouped_mm(x, w, offs, dest) * 2.0

    dest = torch.tensor([4, 1, -6, 5, -4, 3])
    args = (torch.randn(6, 8), dest, torch.tensor([2, 4], dtype=torch.int32))
    lowered = _run(fn, args, atol=1e-5, rtol=1e-5)
    assert _kernels(lowered) == ["grouped_mm"]  # the doubling in its epilogue
    assert torch.all(fn(*args)[[2, 3]] == 0)  # the two rows past offs[-1], stored at dest -4 and 3


def test_rows_read_elsewhere_or_weighted_in_expert_order_stay_scattered():
    torch.manual_seed(6)
    w = torch.randn(3, 8, 4)

    def shared(x, keys, extra, offs):  # the GEMM's rows are returned too: they must be written in order
        _, perm = torch.sort(keys)
        y = GMM(x, w, offs)
        return _unsorted(y * 2, perm), y

    def sorted_operand(x, keys, extra, offs):  # extra is given in expert order: no token-order view of it
        _, perm = torch.sort(keys)
        return _unsorted(GMM(x, w, offs) * extra, perm)

    args = (torch.randn(5, 8), torch.tensor([2, 0, 1, 2, 0]), torch.randn(5, 4), torch.tensor([2, 3, 5]))
    for fn in (shared, sorted_operand):
        lowered = _run(fn, args, atol=1e-5, rtol=1e-5)
        assert "expert rows stored" not in _fused(lowered), fn.__name__
        assert _kernels(lowered).count("scatter") == 1, fn.__name__


# --- the norm in front of the experts as their prologue ---------------------------------------------
class NormedExperts(torch.nn.Module):
    """A MoE layer's front: the norm, the router's linear and the experts' gate/up, both reading the
    normalized token rows (the experts through the expert order)."""

    def __init__(self, E, K, N, dtype, layer_norm=False):
        super().__init__()
        self.norm = (torch.nn.LayerNorm(K) if layer_norm else torch.nn.RMSNorm(K, eps=1e-6)).to(dtype)
        torch.nn.init.normal_(self.norm.weight, 1.0, 0.1)
        self.router = torch.nn.Linear(K, E, bias=False).to(dtype)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * N, K).to(dtype) / K ** 0.5)

    def forward(self, x, top_k_index, offs):
        h = self.norm(x)
        _, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        gate, up = GMM(h[perm // top_k_index.shape[1]], self.gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
        return self.router(h), F.silu(gate) * up


@pytest.mark.parametrize("tokens", [2, 19])  # per-row tiles (decode) and segment tiles (prefill)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_the_norm_before_the_experts_runs_in_their_loads(tokens, dtype):
    torch.manual_seed(7)
    model = NormedExperts(4, 24, 10, dtype).eval()
    index, offs = _routing(tokens, 4, 2, seed=tokens)
    args = (3 * torch.randn(tokens, 24).to(dtype), index, offs)
    lowered = lower_resident(model, args)
    kernels = _kernels(lowered)
    assert "norm" not in kernels, kernels  # the router's linear and the experts both take it
    (launch,) = [l for l in plan_launches(lowered) if l.kernel == "grouped_mm"]
    assert launch.constexprs["PROLOGUE"].value == "rms" and launch.constexprs["HAS_PW"].value
    with torch.no_grad():  # against the same rounded operands in fp32
        expected = NormedExperts(4, 24, 10, torch.float32)
        expected.load_state_dict({n: p.float() for n, p in model.state_dict().items()})
        want = expected(args[0].float(), index, offs)
    atol, rtol = TOLERANCES[dtype]
    for got, ref in zip(lowered.load().load_method()(*args), want):
        torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)


def test_a_layer_norm_or_a_returned_norm_stays_a_launch():
    torch.manual_seed(8)
    index, offs = _routing(5, 4, 2, seed=1)
    layer = NormedExperts(4, 16, 6, torch.float32, layer_norm=True).eval()

    class Returned(NormedExperts):
        def forward(self, x, top_k_index, offs):
            return *super().forward(x, top_k_index, offs), self.norm(x)  # the normalized rows are an output

    for model in (layer, Returned(4, 16, 6, torch.float32).eval()):
        args = (torch.randn(5, 16), index, offs)
        lowered = _run(model, args, atol=1e-5, rtol=1e-5)
        assert _kernels(lowered).count("norm") == 1, type(model).__name__


# --- a whole layer ---------------------------------------------------------------------------------
def test_a_transformers_moe_layer_dispatches_without_gathers_counts_or_inverse():
    """Qwen3-MoE: per layer one launch for the sort and the offsets remains of the dispatch; no rows gathered,
    no cast, histc or cumsum apart, no inverse order, no routing weights gathered, no scatter (the
    down GEMM stores its rows in token order, times their routing weights)."""
    transformers = pytest.importorskip("transformers")
    from harness import Logits
    from test_grouped_mm import _moe

    torch.manual_seed(3)
    model = Logits(_moe(transformers, "qwen3_moe").eval())
    args = (torch.randint(0, 96, (1, 9)),)
    lowered = lower_resident(model, args)
    fused = _fused(lowered)
    for what in ("expert rows read in place", "expert offsets in one launch", "expert unsort as one scatter",
                 "expert rows stored in token order"):
        assert fused.count(what) == 2, fused  # each of the 2 layers
    kernels = _kernels(lowered)
    counts = [kernels.count(k) for k in ("histc", "cumsum", "scatter", "grouped_mm", "rank", "sort_offsets")]
    assert counts == [0, 0, 0, 4, 0, 2] and kernels.count("gather") == 1, kernels  # gather: the embedding
    stored = [l for l in plan_launches(lowered) if l.kernel == "grouped_mm" and l.constexprs["DEST"].value]
    assert len(stored) == 2 and all(l.constexprs["EPILOGUE"].value == 1 for l in stored)  # the weights
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(lowered.load().load_method()(*args), expected, atol=1e-4, rtol=1e-4)


class BiasedExperts(torch.nn.Module):
    """GPT-OSS's experts: gate/up with a per-expert bias gathered by the sorted ids, its own clamped
    gating (no GLU rewrite), down with a per-expert bias, weighted and put back in token order."""

    def __init__(self, E, K, N):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(E, K, 2 * N) / K ** 0.5)
        self.gate_up_bias = torch.nn.Parameter(torch.randn(E, 2 * N) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(E, N, K) / N ** 0.5)
        self.down_bias = torch.nn.Parameter(torch.randn(E, K) * 0.1)

    def forward(self, x, top_k_index, top_k_weights):
        E, k = self.gate_up.shape[0], top_k_index.shape[1]
        ids, perm = torch.sort(top_k_index.reshape(-1))
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        y = GMM(x[perm // k], self.gate_up, offs) + self.gate_up_bias[ids]
        gate, up = y[..., ::2].clamp(max=7.0), y[..., 1::2].clamp(-7.0, 7.0)
        y = GMM((up + 1) * gate * torch.sigmoid(gate * 1.702), self.down, offs) + self.down_bias[ids]
        y = _unsorted(y * top_k_weights.reshape(-1)[perm].unsqueeze(-1), perm)
        return y.view(x.shape[0], k, -1).sum(1)


@pytest.mark.parametrize("tokens", [3, 21])
def test_both_experts_biases_are_read_in_their_gemms(tokens):
    torch.manual_seed(9)
    model = BiasedExperts(4, 16, 8).eval()
    index, _ = _routing(tokens, 4, 2, seed=tokens)
    args = (torch.randn(tokens, 16), index, torch.softmax(torch.randn(tokens, 2), -1))
    lowered = _run(model, args, atol=1e-5, rtol=1e-5)
    assert _fused(lowered).count("experts' biases in the GEMM") == 2, _fused(lowered)
    assert "gather" not in _kernels(lowered), _kernels(lowered)
    assert [l.constexprs["HAS_BIAS"].value for l in plan_launches(lowered) if l.kernel == "grouped_mm"] == [True] * 2


class GptOssExperts(BiasedExperts):
    """GPT-OSS's own gating (``_apply_gate``): its clamps and scaled sigmoid run in the gate/up GEMM."""

    def forward(self, x, top_k_index, top_k_weights):
        E, k = self.gate_up.shape[0], top_k_index.shape[1]
        ids, perm = torch.sort(top_k_index.reshape(-1))
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        y = GMM(x[perm // k], self.gate_up, offs) + self.gate_up_bias[ids]
        gate, up = y[..., ::2], y[..., 1::2]
        gate, up = gate.clamp(min=None, max=7.0), up.clamp(min=-7.0, max=7.0)
        y = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
        y = GMM(y, self.down, offs) + self.down_bias[ids]
        y = _unsorted(y * top_k_weights.reshape(-1)[perm].unsqueeze(-1), perm)
        return y.view(x.shape[0], k, -1).sum(1)


@pytest.mark.parametrize("tokens", [3, 21])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gpt_oss_gating_runs_in_the_gate_up_gemm(tokens, dtype):
    torch.manual_seed(10)
    model = GptOssExperts(4, 16, 8).eval()
    model.gate_up.data *= 2.5  # gates and ups past the clamps' limit, both ways
    model.down.data *= 0.1  # and results of order one again
    model = model.to(dtype)
    index, _ = _routing(tokens, 4, 2, seed=tokens)
    args = (torch.randn(tokens, 16).to(dtype), index, torch.softmax(torch.randn(tokens, 2), -1).to(dtype))
    lowered = lower_resident(model, args)
    assert "GPT-OSS's gating in the experts' GEMM" in _fused(lowered), _fused(lowered)
    assert _kernels(lowered) == ["sort_offsets", "grouped_mm", "grouped_mm", "reduce"], _kernels(lowered)
    with torch.no_grad():  # against the same rounded operands in fp32
        expected = GptOssExperts(4, 16, 8)
        expected.load_state_dict({n: p.float() for n, p in model.state_dict().items()})
        x = args[0].float()
        gate_up = torch.ops.transformers.grouped_mm_fallback(x[torch.sort(index.reshape(-1)).indices // 2],
                                                             expected.gate_up, torch.bincount(index.reshape(-1),
                                                             minlength=4).cumsum(0).to(torch.int32))
        assert (gate_up.abs() > 7).any()  # the clamps bite
        want = expected(x, index, args[2].float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(lowered.load().load_method()(*args).float(), want, atol=atol, rtol=rtol)
