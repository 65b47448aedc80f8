"""Short-query attention (decode): a key head's query heads packed into one program (GQA), and the
keys split over programs whose partial softmaxes ``attention_combine`` merges (flash-decoding).

Every case runs both kernels on the simulated device and compares with eager; the plan says which
variant ran (PACK, SPLIT and the grid's splits), so a case cannot pass on the one-pass kernel.
"""

import pytest
import torch
import torch.nn.functional as F

import tritondelegate as td
from harness import FLOAT_DTYPES, assert_close, check_dynamic, check_launches, check_model
from tritondelegate.generate import Generator
from tritondelegate.kernels import attention, target
from tritondelegate.models import export_prefill_decode, generate_eager, kv_cache_decoder
from test_attention import Sdpa, _f32, qkv


class Positions(torch.nn.Module):
    """A KV-cache decoder's mask: key j visible from a query at position p when j <= p."""

    def forward(self, q, k, v, pos):  # pos [B, Lq]
        mask = torch.arange(k.shape[-2])[None, None, None, :] <= pos[:, None, :, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def run(model, args, dtype):
    """Delegate vs eager in fp32; the attention launches of the plan."""
    _, plan = check_model(model, args, dtype=dtype, reference_args=(model, [_f32(a) for a in args]))
    return [launch for launch in plan.launches if launch.kernel.startswith("attention")]


def constexprs(launch) -> dict:
    return {name: arg.value for name, arg in launch.constexprs.items()}


def splits(launches) -> int:
    """How many splits the attention launch runs (1: one pass, no combine launch)."""
    (attn, *combine) = launches
    assert attn.kernel == "attention"
    split = constexprs(attn)["SPLIT"]
    assert [c.kernel for c in combine] == (["attention_combine"] if split else [])
    return attn.grid[2] if split else 1


# --- packing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lq", [1, 3])
def test_gqa_heads_share_a_program(lq, dtype):
    # 8 query heads over 2 key heads: a program per (batch, key head) holds its 4 query heads' rows.
    (launch,) = run(Sdpa(enable_gqa=True), qkv(2, 8, 2, lq, 37, 16, dtype), dtype)
    assert constexprs(launch)["PACK"] == 4 and launch.grid[:2] == (1, 2 * 2)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_packed_heads_read_their_own_mask_rows(kind):
    # A mask that differs per head and per query: each packed row must load its own.
    q, k, v = qkv(2, 6, 2, 2, 23, 16, torch.float32)
    mask = torch.rand(2, 6, 2, 23) > 0.4 if kind == "bool" else torch.randn(2, 6, 2, 23)
    mask[1, 4, 1] = False if kind == "bool" else float("-inf")  # one fully masked row: 0, as eager
    (launch,) = run(Sdpa(enable_gqa=True), (q, k, v, mask), torch.float32)
    assert constexprs(launch)["PACK"] == 3


def test_causal_and_long_queries_are_not_packed():
    (causal,) = run(Sdpa(enable_gqa=True, is_causal=True), qkv(1, 4, 2, 3, 9, 16, torch.float32), torch.float32)
    (prefill,) = run(Sdpa(enable_gqa=True), qkv(1, 4, 2, 40, 9, 16, torch.float32), torch.float32)
    assert constexprs(causal)["PACK"] == 1 and constexprs(prefill)["PACK"] == 1


# --- splitting ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_long_cache_decode_splits_its_keys(dtype):
    # One query per head over 520 keys: 2 key heads x 4 query heads would give 2 programs; the keys
    # are split (whole tiles each, the last one ragged) and merged by a second launch.
    launches = run(Sdpa(enable_gqa=True), qkv(1, 8, 2, 1, 520, 16, dtype, ev=24), dtype)
    assert splits(launches) >= 2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_splits_past_the_last_position_add_nothing(dtype):
    # Per-batch positions: batch 0 has seen 70 keys of 600 (its later splits keep no key), batch 1 all.
    q, k, v = qkv(2, 4, 2, 1, 600, 16, dtype)
    pos = torch.tensor([[69], [599]])
    (attn, combine) = [l for l in check_launches(Positions(), (q, k, v, pos), dtype) if "attention" in l.kernel]
    assert constexprs(attn)["MASK"] == "positions" and attn.grid[2] >= 2
    assert attn.args[-1].value < 600 - 70  # split_n: 70 keys are all in the first split


def test_split_rows_masked_in_whole_splits():
    # Rows whose kept keys lie in one split only, a row with none kept (0), a row of finite huge
    # negatives (eager's ordinary softmax: the mean of v), an all -inf split beside a finite one.
    q, k, v = qkv(1, 4, 4, 1, 512, 16, torch.float32)
    bias = torch.randn(1, 4, 1, 512)
    bias[0, 0, 0, 128:] = float("-inf")
    bias[0, 1, 0, :] = float("-inf")
    bias[0, 2, 0, :] = torch.finfo(torch.float32).min
    bias[0, 3, 0, :256] = float("-inf")
    bias[0, 3, 0, 256:] -= 50.0
    launches = run(Sdpa(), (q, k, v, bias), torch.float32)
    assert splits(launches) >= 2
    keep = torch.rand(1, 4, 1, 512) > 0.5
    keep[0, 1] = False
    keep[0, 2, 0, :300] = False
    launches = run(Sdpa(), (q, k, v, keep), torch.float32)
    assert splits(launches) >= 2


@pytest.mark.parametrize("lq", [1, 5])
def test_causal_short_queries_split_too(lq):
    # Top-left causal: query i sees keys 0..i only, so every split but the first keeps no key.
    launches = run(Sdpa(is_causal=True), qkv(1, 2, 2, lq, 300, 16, torch.float32), torch.float32)
    assert splits(launches) >= 2


def test_split_output_in_a_transposed_layout():
    # The result stored [B, L, H, E] (the output projection's layout): the combine writes it there.
    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(2, 1, 64)

    launches = run(Block(), qkv(2, 4, 2, 1, 300, 16, torch.float32), torch.float32)
    assert splits(launches) >= 2


def test_enough_programs_or_few_keys_take_one_pass():
    few_keys = run(Sdpa(), qkv(1, 2, 2, 1, 100, 16, torch.float32), torch.float32)
    # 24 (batch, head) programs fill a GPU of 4 SMs twice over (as 192 fill an H100's 132 SMs at 300 keys)
    with target.using(target.Target("small", 4, 99 * 1024)):
        many_heads = run(Sdpa(), qkv(3, 8, 8, 1, 300, 16, torch.float32), torch.float32)
        split_when_fewer = run(Sdpa(), qkv(1, 2, 2, 1, 300, 16, torch.float32), torch.float32)
    assert splits(few_keys) == 1 and splits(many_heads) == 1 and splits(split_when_fewer) > 1


def test_split_count_follows_the_target():
    # Two programs per SM: a GPU with 4 SMs gets fewer splits than an H100 for the same call.
    def count(gpu):
        with target.using(gpu):
            return attention.split_keys(2, 1, 4096, 16, 64)

    h100, small = count(target.TARGETS["h100"]), count(target.Target("small", 4, 99 * 1024))
    assert h100 == 64 * 4  # 64 tiles of 64 keys over 16 splits: 2 programs x 16 < 2 x 132 SMs
    assert small == 64 * 16  # 4 splits: 2 programs x 4 = 2 per SM
    assert count(target.Target("big", 1, 99 * 1024)) is None  # 2 programs already fill 1 SM


def test_dynamic_cache_length_splits_at_every_size():
    # The number of splits follows the keys each call has (grid axis 2 is symbolic).
    keys = torch.export.Dim("keys", min=2, max=640)
    model = Sdpa(enable_gqa=True)
    calls = [qkv(1, 4, 2, 1, n, 16, torch.float32) for n in (640, 300, 2)]
    lowered, _ = check_dynamic(model, calls, ({}, {2: keys}, {2: keys}))
    launches = [l for d in lowered.program.methods[0].delegates for l in d.plan.launches]
    assert [l.kernel for l in launches] == ["attention", "attention_combine"]


def test_kv_cache_generation_with_a_long_cache():
    # The demo's KV-cache decoder with a 512-position cache: prefill (24 queries x 2 heads per key
    # head: two row tiles, one pass) and decode (split) share the cache; every token and every step's
    # logits match eager.
    model = kv_cache_decoder(seed=0, vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                             max_seq_len=512)
    lowered = td.lower(export_prefill_decode(model, 24), partitioner=td.TritonPartitioner(device="cuda:0"),
                       config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    kernels = {m.name: [launch.kernel for d in m.delegates for launch in d.plan.launches]
               for m in lowered.program.methods}
    assert "attention_combine" in kernels["decode"] and "attention_combine" not in kernels["prefill"]
    prompt = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    result = Generator(lowered.load()).generate(prompt, 3, keep_logits=True)
    tokens, logits = generate_eager(model, prompt, 3)
    assert result.tokens.tolist() == tokens.tolist()
    for got, expected in zip(result.logits, logits, strict=True):
        assert_close(got, expected)


def test_dynamic_batch_of_packed_and_split_heads():
    # grid axis 1 (batch x key heads) and the partials follow each call's batch.
    batch = torch.export.Dim("batch", min=1, max=6)
    calls = [qkv(n, 4, 2, 1, 300, 16, torch.float32) for n in (6, 1, 4)]
    lowered, _ = check_dynamic(Sdpa(enable_gqa=True), calls, ({0: batch}, {0: batch}, {0: batch}))
    attn = [l for d in lowered.program.methods[0].delegates for l in d.plan.launches][0]
    assert constexprs(attn)["PACK"] == 2 and constexprs(attn)["SPLIT"]
