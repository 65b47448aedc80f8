"""A mask built from positions with a sliding window, soft-capped scores or attention sinks runs inside
the attention launch (``passes/position_mask.py``: ``tritondelegate::sdpa_positions(..., window, softcap,
sinks)``, the kernel's ``MASK="positions"`` with ``WINDOW``, ``SOFTCAP`` and ``SINKS``), and a decode
step's new cache rows are written by that launch (``passes/kv_append.py``), as transformers' Gemma 2
(soft-capped, alternating sliding-window layers) and GPT-OSS (sinks, sliding layers) write them for a
static cache. Every case is compared with the written-out model in fp32 at the dtype's tolerance; the
key tiles outside the window hold NaN values, so a tile the kernel should skip and reads shows."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritondelegate as td
from harness import assert_close
from tritondelegate.kernels import registry

gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True), target="h100")
SDPA_POSITIONS = torch.ops.tritondelegate.sdpa_positions.default
TILE = 32  # key tile of an fp32 attention with heads of 16


def keep_mask(keys: int, pos: torch.Tensor, window: int, other: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' static-cache mask [1, 1, T, S]: key j kept when j <= pos (and, with a window,
    j > pos - window, written against ``other`` positions when given)."""
    index = (torch.arange(keys) + 0)[None, None, None, :]
    p = pos[None, None, :, None]
    keep = index <= p
    if window:
        low = p if other is None else other[None, None, :, None]
        keep = p.new_ones((), dtype=torch.bool) & (index > low - window) & keep
    return keep.expand(1, -1, -1, -1)


class WindowAttention(nn.Module):
    """sdpa over S keys with a sliding-window bool mask from the queries' positions."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, pos, other=None):
        mask = keep_mask(k.shape[-2], pos, self.window, other)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class CachedEagerAttention(nn.Module):
    """A static-cache layer: the new rows written at ``pos`` (``index_copy_``), then transformers' eager
    attention over the whole cache with its float mask ``where(keep, 0, finfo.min)``: Gemma 2's
    soft-capped one, or with ``sinks`` GPT-OSS's."""

    def __init__(self, heads, kv_heads, length, head_dim, dtype, window=0, softcap=None, sinks=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shape = (1, kv_heads, length, head_dim)
        self.register_buffer("k_cache", torch.randn(shape, generator=g).to(dtype))
        self.register_buffer("v_cache", torch.randn(shape, generator=g).to(dtype))
        self.sinks = nn.Parameter(torch.randn(heads, generator=g).to(dtype)) if sinks else None
        self.num_key_value_groups, self.window, self.softcap = heads // kv_heads, window, softcap
        self.scaling = head_dim ** -0.5
        self.eval()

    def forward(self, q, k, v, pos):
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        keep = keep_mask(self.k_cache.shape[2], pos, self.window)
        mask = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        if self.sinks is not None:
            out = gpt_oss.eager_attention_forward(self, q, self.k_cache, self.v_cache, mask, scaling=self.scaling)
        else:
            out = gemma2.eager_attention_forward(self, q, self.k_cache, self.v_cache, mask, scaling=self.scaling,
                                                 softcap=self.softcap)
        return out[0]


def _lower(eps, partitioner=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(eps, partitioner=partitioner, config=CONFIG)


def _launches(lowered, name="forward"):
    (method,) = [m for m in lowered.program.methods if m.name == name]
    return [launch for d in method.delegates for launch in d.plan.launches]


def _qkv(dtype, lq, keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, lq, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, keys, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _poisoned(v, position: int, window: int):
    """``v`` with NaN in the key tiles wholly before ``position``'s window and wholly past it."""
    lo = max(position - window + 1, 0) // TILE * TILE
    v = v.clone()
    v[:, :, :lo] = float("nan")
    v[:, :, (position // TILE + 1) * TILE:] = float("nan")
    return v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_mask_runs_in_the_attention_launch(dtype):
    q, k, v = _qkv(dtype, 5, 80)
    pos = torch.tensor([3, 17, 40, 41, 79])
    model = WindowAttention(20)
    lowered = _lower(torch.export.export(model, (q, k, v, pos)))
    (launch,) = _launches(lowered)
    assert launch.kernel == "attention" and launch.constexprs["MASK"].value == "positions"
    assert launch.constexprs["WINDOW"].value == 20
    assert any("window 20" in f for f in lowered.reports["forward"].fused)
    got = lowered.load().load_method("forward")(q, k, v, pos)
    assert_close(got, model(q.float(), k.float(), v.float(), pos), dtype=dtype)


def test_decode_reads_only_the_tiles_of_its_window():
    """One query per call; the window's first key on each side of a tile's edge, and positions before
    the window fills (it starts at key 0)."""
    q, k, v = _qkv(torch.float32, 1, 80)
    model = WindowAttention(20)
    method = _lower(torch.export.export(model, (q, k, v, torch.tensor([5])))).load().load_method("forward")
    for position in (0, 19, 50, 51, 52, 63, 64, 79):
        pos = torch.tensor([position])
        got = method(q, k, _poisoned(v, position, 20), pos)
        assert_close(got, model(q, k, v, pos), dtype=torch.float32)


def test_split_keys_before_the_window_add_nothing():
    # 512 keys: the keys are split over programs (flash-decoding); splits wholly before the window read no tile.
    q, k, v = _qkv(torch.float32, 1, 512)
    model = WindowAttention(40)
    lowered = _lower(torch.export.export(model, (q, k, v, torch.tensor([5]))))
    launch, combine = _launches(lowered)
    assert launch.constexprs["SPLIT"].value and launch.grid[2] >= 2 and combine.kernel == "attention_combine"
    method = lowered.load().load_method("forward")
    for position in (30, 300, 511):
        pos = torch.tensor([position])
        assert_close(method(q, k, _poisoned(v, position, 40), pos), model(q, k, v, pos), dtype=torch.float32)


def _run_cache(lowered, model, calls):
    """Run ``calls`` ((method, first position, rows)) on the program and on an fp32 copy of ``model``;
    the outputs compared at the dtype's tolerance."""
    program = lowered.load("simulated")
    reference = CachedEagerAttention(4, 2, *model.k_cache.shape[2:], torch.float32, model.window, model.softcap,
                                     model.sinks is not None)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    methods = {name: program.load_method(name) for name in {c[0] for c in calls}}
    for step, (name, first, rows) in enumerate(calls):
        q, k, v = (t.to(model.k_cache.dtype) * 2 for t in _qkv(torch.float32, rows, rows, seed=step + 1))
        pos = torch.arange(first, first + rows)
        with torch.no_grad():
            expected = reference(q.float(), k.float(), v.float(), pos)
        assert_close(methods[name](q, k, v, pos), expected, dtype=q.dtype)


def _cache_program(model):
    eps = {}
    for name, rows in (("prefill", 5), ("decode", 1)):
        q, k, v = (t.to(model.k_cache.dtype) for t in _qkv(torch.float32, rows, rows))
        eps[name] = torch.export.export(model, (q, k, v, torch.arange(rows)))
    return _lower(eps)


@pytest.mark.parametrize("window, dtype", [(0, torch.float32), (12, torch.bfloat16)])
def test_gemma2_static_cache_attention_is_one_launch_that_appends(window, dtype):
    # Gemma 2's soft-capped eager attention (a full layer, or a sliding one): prefill (5 rows of 2 packed
    # heads, one query block) and decode each one attention launch that writes the cache rows first.
    model = CachedEagerAttention(4, 2, 40, 16, dtype, window=window, softcap=2.0)
    lowered = _cache_program(model)
    for name in ("prefill", "decode"):
        (launch,) = _launches(lowered, name)
        assert launch.kernel == "attention_append" and launch.constexprs["MASK"].value == "positions"
        assert launch.constexprs["SOFTCAP"].value == 2.0
        assert launch.constexprs["WINDOW"].value == window if window else "WINDOW" not in launch.constexprs
    _run_cache(lowered, model, [("prefill", 0, 5), ("decode", 5, 1), ("decode", 6, 1), ("prefill", 20, 5),
                                ("decode", 25, 1)])


def test_gpt_oss_sinks_with_a_window_are_one_launch_that_appends():
    model = CachedEagerAttention(4, 2, 40, 16, torch.float32, window=12, sinks=True)
    lowered = _cache_program(model)
    (launch,) = _launches(lowered, "decode")
    assert launch.kernel == "attention_append" and launch.constexprs["SINKS"].value
    assert launch.constexprs["WINDOW"].value == 12
    _run_cache(lowered, model, [("prefill", 0, 5), ("decode", 5, 1), ("decode", 30, 1)])


def test_host_fallback_runs_the_reference(tmp_path):
    # sdpa_positions with a window and its sinks (a tensor argument by keyword) left to the host.
    model = CachedEagerAttention(4, 2, 40, 16, torch.float32, window=12, sinks=True)
    q, k, v = _qkv(torch.float32, 1, 1)
    ops = [op for op in registry.OPS if op is not SDPA_POSITIONS]
    lowered = _lower(torch.export.export(model, (q, k, v, torch.tensor([7]))), td.TritonPartitioner(ops=ops))
    assert [op for _, op, _ in lowered.reports["forward"].nodes.host] == ["tritondelegate.sdpa_positions.default"]
    lowered.save(tmp_path / "window.tdp")
    got = td.load(str(tmp_path / "window.tdp")).load_method("forward")(q, k, v, torch.tensor([7]))
    assert_close(got, model(q, k, v, torch.tensor([7])), dtype=torch.float32)


@pytest.mark.parametrize("window, other", [(20, True), (0, False)])
def test_other_lower_bounds_stay_a_mask(window, other):
    # A lower bound from other positions than the upper one, or ``index > pos - 0`` (no window: the
    # pass reads ``> pos`` as no lower bound only through a window of at least 1), stays a mask.
    q, k, v = _qkv(torch.float32, 5, 80)
    pos = torch.tensor([3, 17, 40, 41, 79])
    args = (q, k, v, pos, pos - 2) if other else (q, k, v, pos)
    model = WindowAttention(window) if window else ZeroWindow()
    lowered = _lower(torch.export.export(model, args))
    assert not any(launch.constexprs.get("MASK") and launch.constexprs["MASK"].value == "positions"
                   for launch in _launches(lowered))
    assert_close(lowered.load().load_method("forward")(*args), model(*args), dtype=torch.float32)


class ZeroWindow(nn.Module):
    """``index > pos - 0`` and ``index <= pos``: no key is kept (a row before every key gives 0)."""

    def forward(self, q, k, v, pos):
        index = torch.arange(k.shape[-2])[None, None, None, :]
        p = pos[None, None, :, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(index > p - 0) & (index <= p), enable_gqa=True)
