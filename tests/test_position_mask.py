"""An attention mask built per call from positions runs inside the attention launch
(``passes/position_mask.py``, ``tritondelegate::sdpa_positions``, the kernel's ``MASK="positions"``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, assert_close, check_dynamic
from tritondelegate.kernels import registry

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
SDPA_POSITIONS = torch.ops.tritondelegate.sdpa_positions.default


class CacheAttention(torch.nn.Module):
    """Queries at ``pos`` attend over a cache of S keys, those at or before their position.

    ``form``: "buffer" (the demo's ``key_positions`` buffer, [T, S] mask), "hf" (transformers' static
    cache: ``arange(S) + 0`` and [B, T] positions unsqueezed to [B, 1, T, 1], the mask expanded),
    "ge" (the comparison written the other way)."""

    def __init__(self, keys: int, form: str = "buffer", other=None):
        super().__init__()
        self.form, self.other = form, other
        self.register_buffer("key_positions", torch.arange(keys), persistent=False)

    def forward(self, q, k, v, pos):
        keys = k.shape[-2]
        if self.form == "hf":
            index = (torch.arange(keys) + 0)[None, None, None, :]
            mask = (index <= pos[:, None, :, None]).expand(q.shape[0], -1, -1, -1)
        elif self.form == "ge":
            mask = pos[:, None] >= self.key_positions[None, :]
        else:
            index = self.other(keys) if self.other is not None else self.key_positions
            mask = index[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _lower(model, args, partitioner=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, args), partitioner=partitioner, config=CONFIG)


def _launches(lowered):
    return [launch for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]


def _args(dtype, batch=1, seq=5, keys=80, pos=(3, 17, 40, 41, 79)):
    torch.manual_seed(0)
    q = torch.randn(batch, 4, seq, 16).to(dtype)
    k, v = (torch.randn(batch, 2, keys, 16).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor(pos[:seq])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mask_from_positions_runs_in_the_attention_launch(dtype):
    """80 keys over several key tiles, positions in the first, a middle and the last tile."""
    args = _args(dtype)
    model = CacheAttention(80)
    lowered = _lower(model, args)
    (launch,) = _launches(lowered)
    assert launch.kernel == "attention" and launch.constexprs["MASK"].value == "positions"
    got = lowered.load().load_method("forward")(*args)
    expected = model(*(a.float() if a.is_floating_point() else a for a in args))
    assert_close(got, expected, dtype=dtype)


@pytest.mark.parametrize("form", ["hf", "ge"])
def test_other_ways_to_write_it(form):
    args = _args(torch.float32, batch=2)
    args = args[:3] + ((torch.stack([args[3], args[3].flip(0)]) if form == "hf" else args[3]),)
    model = CacheAttention(80, form)
    lowered = _lower(model, args)
    assert [launch.kernel for launch in _launches(lowered)] == ["attention"]
    assert_close(lowered.load().load_method("forward")(*args), model(*args), dtype=torch.float32)


def test_a_row_before_every_key_gives_zeros_as_eager():
    args = _args(torch.float32, pos=(-1, 0, 2, 5, 9))
    model = CacheAttention(80)
    got = _lower(model, args).load().load_method("forward")(*args)
    expected = model(*args)
    assert torch.equal(expected[:, :, 0], torch.zeros_like(expected[:, :, 0]))
    assert_close(got, expected, dtype=torch.float32)


@pytest.mark.parametrize("other", [lambda n: torch.arange(1, n + 1), lambda n: torch.arange(n) * 2])
def test_a_mask_of_other_indices_stays_a_mask(other):
    args = _args(torch.float32)
    model = CacheAttention(80, other=other)
    lowered = _lower(model, args)
    assert not any(launch.constexprs.get("MASK") and launch.constexprs["MASK"].value == "positions"
                   for launch in _launches(lowered))
    assert_close(lowered.load().load_method("forward")(*args), model(*args), dtype=torch.float32)


def test_dynamic_query_length():
    def call(n):
        q, k, v, _ = _args(torch.float32, seq=n, pos=tuple(range(60, 76)))
        return q, k, v, torch.arange(60, 60 + n)

    seq = Dim("seq", max=16)
    lowered, _ = check_dynamic(CacheAttention(80), [call(n) for n in (1, 16, 7)],
                               {"q": {2: seq}, "k": None, "v": None, "pos": {0: seq}}, example=call(5))
    assert [launch.kernel for launch in _launches(lowered)] == ["attention"]


def test_host_fallback_runs_the_reference(tmp_path):
    args = _args(torch.float32)
    ops = [op for op in registry.OPS if op is not SDPA_POSITIONS]
    lowered = _lower(CacheAttention(80), args, partitioner=td.TritonPartitioner(ops=ops))
    assert [op for _, op, _ in lowered.reports["forward"].nodes.host] == ["tritondelegate.sdpa_positions.default"]
    lowered.save(tmp_path / "positions.tdp")
    assert torch.equal(td.load(str(tmp_path / "positions.tdp")).load_method("forward")(*args),
                       CacheAttention(80)(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_sees_exactly_the_keys_up_to_its_position(dtype):
    """One query per call (a decode step): positions on each side of a key tile's edge (tiles of 32
    or 64 keys), so a tile past the position is skipped and the one holding it is read."""
    q, k, v, _ = _args(dtype, seq=1)
    model = CacheAttention(80)
    method = _lower(model, (q, k, v, torch.tensor([5]))).load().load_method("forward")
    for position in (0, 31, 32, 63, 64, 79):
        pos = torch.tensor([position])
        expected = model(q.float(), k.float(), v.float(), pos)
        assert_close(method(q, k, v, pos), expected, dtype=dtype)
