"""Rotary tables computed per call from input positions run inside the rotary launch
(``passes/rotary_tables.py``, ``tritondelegate::rotary_angles``/``rotary_pair_angles``, the kernel's
``ANGLES``): no cat, cos or sin launch, and eager's results."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, assert_close, check_dynamic
from tritondelegate.kernels import registry
from tritondelegate.models import export_prefill_decode, kv_cache_decoder
from tritondelegate.ops import rotary_reference as written_out  # x * cos + rotate_half(x) * sin, written out

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
ANGLES_PAIR = torch.ops.tritondelegate.rotary_pair_angles.default


class PositionsRotary(torch.nn.Module):
    """q and k rotated by tables computed from the positions ``pos`` ([T], or [B, T] with ``batched``),
    as a KV-cache decoder computes them: ``(cat(f, f).cos() * scale).to(table_dtype)``."""

    def __init__(self, head_dim: int, scale=1.0, table_dtype=None, sin_scale=None, batched=False,
                 return_tables=False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)))
        self.scale, self.sin_scale = scale, scale if sin_scale is None else sin_scale
        self.table_dtype, self.batched, self.return_tables = table_dtype, batched, return_tables

    def forward(self, q, k, pos):
        freqs = pos.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0 or self.sin_scale != 1.0:
            cos, sin = cos * self.scale, sin * self.sin_scale
        dtype = self.table_dtype or q.dtype
        cos, sin = cos.to(dtype), sin.to(dtype)
        if self.batched:  # [B, T, D] -> [B, 1, T, D] against [B, heads, T, D]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        out = (written_out(q, cos, sin), written_out(k, cos, sin))
        return out + (cos, sin) if self.return_tables else out


POSITIONS = torch.tensor([0, 3, 17, 255, 4095])  # far positions: the kernel's cos/sin reduce their range


def _lower(model, args, fold=True, partitioner=None):
    config = td.LowerConfig(propagate_device=CONFIG.propagate_device, fold_constants=fold)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, args), partitioner=partitioner, config=config)


def _launches(lowered, method="forward"):
    (m,) = [m for m in lowered.program.methods if m.name == method]
    return [launch for d in m.delegates for launch in d.plan.launches]


def _no_tables(launches) -> bool:
    """No launch computes a table (a cos, a sin or the cat of the angles)."""
    return not any(name in launch.op for launch in launches for name in ("cos", "sin", "cat"))


def _qk(dtype, batch=2, seq=5, d=8):
    torch.manual_seed(0)
    return torch.randn(batch, 4, seq, d).to(dtype), torch.randn(batch, 2, seq, d).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_tables_from_positions_run_in_the_rotary_launch(dtype):
    q, k = _qk(dtype)
    model = PositionsRotary(8)
    lowered = _lower(model, (q, k, POSITIONS))
    launches = _launches(lowered)
    (rotary,) = [launch for launch in launches if launch.kernel == "rotary"]
    assert rotary.constexprs["ANGLES"].value and rotary.constexprs["PAIR"].value
    assert _no_tables(launches), [launch.op for launch in launches]
    assert any("rotary tables of" in f for f in lowered.reports["forward"].fused)
    # eager with the tables rounded to dtype as the model stores them, the rotation in fp32
    expected = PositionsRotary(8, table_dtype=dtype)(q.float(), k.float(), POSITIONS)
    for got, want in zip(lowered.load().load_method("forward")(q, k, POSITIONS), expected):
        assert got.dtype == dtype
        assert_close(got, want, dtype=dtype)


def test_scale_table_dtype_and_batched_positions():
    """transformers' form: [B, T] positions, tables scaled (attention_scaling), cast, unsqueezed over
    the heads; fp32 q and k with fp16 tables give fp32 results, as eager's promotion does."""
    q, k = _qk(torch.float32)
    pos = torch.stack([POSITIONS, POSITIONS.flip(0) + 7])
    model = PositionsRotary(8, scale=0.75, table_dtype=torch.float16, batched=True)
    lowered = _lower(model, (q, k, pos))
    launches = _launches(lowered)
    assert _no_tables(launches) and [launch.kernel for launch in launches].count("rotary") == 1
    (rotary,) = [launch for launch in launches if launch.kernel == "rotary"]
    assert rotary.constexprs["ROUND"].value == "float16"
    for got, want in zip(lowered.load().load_method("forward")(q, k, pos), model(q, k, pos)):
        assert_close(got, want, dtype=torch.float32)


def test_tables_also_returned_are_still_computed():
    q, k = _qk(torch.float32)
    model = PositionsRotary(8, return_tables=True)
    lowered = _lower(model, (q, k, POSITIONS))
    assert any(launch.constexprs.get("ANGLES") for launch in _launches(lowered) if launch.kernel == "rotary")
    got = lowered.load().load_method("forward")(q, k, POSITIONS)
    for a, b in zip(got, model(q, k, POSITIONS)):
        assert_close(a, b, dtype=torch.float32)


def test_cos_and_sin_of_other_scales_keep_their_tables():
    q, k = _qk(torch.float32)
    model = PositionsRotary(8, scale=1.0, sin_scale=0.5)
    lowered = _lower(model, (q, k, POSITIONS))
    launches = _launches(lowered)
    assert not any(launch.constexprs.get("ANGLES") for launch in launches if launch.kernel == "rotary")
    assert not _no_tables(launches)
    for a, b in zip(lowered.load().load_method("forward")(q, k, POSITIONS), model(q, k, POSITIONS)):
        assert_close(a, b, dtype=torch.float32)


class StaticPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = PositionsRotary(8)

    def forward(self, q, k):
        return self.rotary(q, k, torch.arange(q.shape[2]))


def test_static_positions_are_left_to_constant_folding():
    """Positions that depend on no input: folding stores the tables; without folding the kernel
    computes them."""
    q, k = _qk(torch.float32)
    folded = _lower(StaticPositions(), (q, k))
    assert not any(launch.constexprs.get("ANGLES") for launch in _launches(folded) if launch.kernel == "rotary")
    assert len(_launches(folded)) == 1
    unfolded = _lower(StaticPositions(), (q, k), fold=False)
    assert any(launch.constexprs.get("ANGLES") for launch in _launches(unfolded) if launch.kernel == "rotary")
    for lowered in (folded, unfolded):
        for a, b in zip(lowered.load().load_method("forward")(q, k), StaticPositions()(q, k)):
            assert_close(a, b, dtype=torch.float32)


def test_dynamic_sequence_length():
    def call(n):
        torch.manual_seed(n)
        return torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randint(0, 2048, (n,))

    seq = Dim("seq", max=16)
    dims = {"q": {2: seq}, "k": {2: seq}, "pos": {0: seq}}
    lowered, _ = check_dynamic(PositionsRotary(8), [call(n) for n in (1, 16, 7)], dims, example=call(5))
    assert _no_tables(_launches(lowered))


def test_host_fallback_runs_the_reference(tmp_path):
    q, k = _qk(torch.float32)
    ops = [op for op in registry.OPS if op is not ANGLES_PAIR]
    lowered = _lower(PositionsRotary(8), (q, k, POSITIONS), partitioner=td.TritonPartitioner(ops=ops))
    host = [op for _, op, _ in lowered.reports["forward"].nodes.host]
    assert host == ["tritondelegate.rotary_pair_angles.default"], host
    lowered.save(tmp_path / "angles.tdp")
    expected = PositionsRotary(8)(q, k, POSITIONS)
    for method in (lowered.load().load_method("forward"), td.load(str(tmp_path / "angles.tdp")).load_method("forward")):
        for a, b in zip(method(q, k, POSITIONS), expected):
            assert torch.equal(a, b)


def test_kv_cache_decoder_computes_no_table():
    """Prefill and decode of the demo's KV-cache decoder: each layer's q and k rotated in one launch
    (its projection's epilogue: ``rope_linear``) by angles it computes from the positions, and no
    launch for the angles, a cat, a cos or a sin."""
    lowered = td.lower(export_prefill_decode(kv_cache_decoder(n_layers=2), 5), config=CONFIG)
    for method in ("prefill", "decode"):
        launches = _launches(lowered, method)
        rotaries = [launch for launch in launches if "ROPE" in launch.constexprs]
        assert [r.constexprs["ROPE"].value for r in rotaries] == ["positions", "positions"]
        assert not [launch for launch in launches if launch.kernel == "rotary"]
        assert _no_tables(launches), [launch.op for launch in launches]
