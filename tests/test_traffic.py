"""The traffic model (kernels/traffic.py): exact bytes and FLOPs of small launches, the per-kernel table
against the registry, the fields through a program file, and per-method figures next to their bound."""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import torch

import tritondelegate as td
from harness import Fn
from tritondelegate import cli
from tritondelegate.kernels.table import KERNELS
from tritondelegate.kernels.traffic import TRAFFIC, _buffer_bytes, kernel_params, method_traffic
from tritondelegate.models import demo_decoder, export_prefill_decode, kv_cache_decoder
from tritondelegate.plan import Base, TensorDesc
from tritondelegate.serialize.reader import load_program

F32 = 4
RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _lower(model, *args, config=RESIDENT):
    eps = model if isinstance(model, dict) else torch.export.export(model, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(eps, partitioner=td.TritonPartitioner(device="cuda:0"), config=config)


def _launches(fn, *args):
    lowered = _lower(Fn(fn), *args)
    (method,) = lowered.program.methods
    return [launch for d in method.delegates for launch in d.plan.launches], method


def _only(fn, *args):
    launches, method = _launches(fn, *args)
    assert len(launches) == 1, [launch.kernel for launch in launches]
    return launches[0], method


# --- the table ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_has_a_row_naming_its_own_pointers(kernel):
    """Every registered kernel has a TRAFFIC row; the row names only parameters of the kernel, and
    classifies every pointer parameter (``*_ptr``) as read, written or both."""
    assert kernel in TRAFFIC, f"kernel {kernel!r} has no row in kernels/traffic.py TRAFFIC"
    params = kernel_params(kernel)
    row = TRAFFIC[kernel]
    named = {a.param for a in row.reads + row.writes}
    assert named <= set(params), named - set(params)
    assert {p for p in params if p.endswith("_ptr")} == named
    assert row.writes, f"{kernel!r} writes nothing"
    fn = KERNELS[kernel]
    assert list(inspect.signature(getattr(fn, "fn", fn)).parameters) == params


# --- exact figures of small launches --------------------------------------------------------------
def test_mm():
    launch, method = _only(torch.mm, torch.randn(17, 33), torch.randn(33, 65))
    assert launch.kernel == "matmul"
    assert launch.bytes_read == (17 * 33 + 33 * 65) * F32
    assert launch.bytes_written == 17 * 65 * F32
    assert launch.flops == 2 * 17 * 33 * 65
    t = method_traffic(method)
    assert t["lower_bound"] == t["bytes"] == launch.bytes_read + launch.bytes_written and t["ratio"] == 1.0


def test_linear_with_bias_counts_the_bias_once_and_its_epilogue():
    launch, _ = _only(torch.nn.functional.linear, torch.randn(17, 33), torch.randn(65, 33), torch.randn(65))
    assert launch.bytes_read == (17 * 33 + 65 * 33 + 65) * F32  # the broadcast bias: 65 floats, once
    assert launch.flops == 2 * 17 * 33 * 65 + 17 * 65


def test_pointwise_after_a_matmul_fused_or_not():
    """relu(x @ w): 2MNK + MN FLOPs whether the relu runs as a matmul epilogue or a launch of its own;
    fused, the product is never written or read back."""
    launches, _ = _launches(lambda x, w: torch.relu(x @ w), torch.randn(17, 33), torch.randn(33, 65))
    assert sum(l.flops for l in launches) == 2 * 17 * 33 * 65 + 17 * 65
    extra = 0 if len(launches) == 1 else 2 * 17 * 65 * F32  # the product, written then read back
    assert sum(l.bytes_read for l in launches) == (17 * 33 + 33 * 65) * F32 + extra // 2
    assert sum(l.bytes_written for l in launches) == 17 * 65 * F32 + extra // 2


def test_broadcast_operand_counts_its_real_extent_once():
    launch, _ = _only(torch.add, torch.randn(17, 33), torch.randn(33))
    assert launch.kernel == "pointwise"
    assert launch.bytes_read == (17 * 33 + 33) * F32
    assert launch.bytes_written == 17 * 33 * F32
    assert launch.flops == 17 * 33


def test_views_of_one_buffer_are_read_once():
    launch, _ = _only(lambda x: x * x, torch.randn(17, 33))
    assert launch.bytes_read == 17 * 33 * F32
    launch, _ = _only(lambda x: x + x.t(), torch.randn(33, 33))  # a transpose covers the same bytes
    assert launch.bytes_read == 33 * 33 * F32


def test_transposed_and_strided_views():
    # a transposed operand is read in place: its bytes once
    launch, _ = _only(lambda a, b: a.t() @ b, torch.randn(33, 17), torch.randn(33, 65))
    assert launch.bytes_read == (33 * 17 + 33 * 65) * F32 and launch.flops == 2 * 17 * 33 * 65
    # every other column: its 17 x 17 elements, not the gaps between them
    launch, method = _only(lambda x: x[:, ::2] * 3.0, torch.randn(17, 33))
    assert launch.bytes_read == 17 * 17 * F32 and launch.bytes_written == 17 * 17 * F32
    assert method_traffic(method)["lower_bound_read"] == 17 * 17 * F32  # the input counts what is read


def test_softmax_row_kernel():
    launch, _ = _only(lambda x: torch.softmax(x, dim=-1), torch.randn(17, 65))
    assert launch.kernel == "softmax"
    assert launch.bytes_read == launch.bytes_written == 17 * 65 * F32
    assert launch.flops == 5 * 17 * 65


def test_gather_reads_only_the_rows_it_walks():
    table, idx = torch.randn(1000, 8), torch.tensor([3, 7, 3])
    launch, method = _only(lambda t, i: torch.index_select(t, 0, i), table, idx)
    assert launch.kernel == "gather" and launch.flops == 0
    assert launch.bytes_read == 3 * 8 * F32 + 3 * 8  # rows walked (at most) + the int64 indices
    assert launch.bytes_written == 3 * 8 * F32
    assert method_traffic(method)["lower_bound_read"] == launch.bytes_read



def test_convolution_flops_count_the_taps_that_contribute():
    conv2d, conv_t = torch.nn.functional.conv2d, torch.nn.functional.conv_transpose2d
    x = torch.randn(2, 3, 5, 7)
    # 2 * N*OH*OW output pixels * C_out * C_in*KH*KW
    launch, _ = _only(lambda x, w: conv2d(x, w, padding=1), x, torch.randn(4, 3, 3, 3))
    assert launch.kernel == "conv2d" and launch.flops == 2 * (2 * 5 * 7) * 4 * (3 * 3 * 3)
    # transposed, by stride phase: each output pixel's exact taps, (5 * 1 + 5 * 2) x (7 * 1 + 7 * 2) over
    # the [10, 14] output (even rows take tap 1, odd ones taps 0 and 2; likewise columns), as many as each
    # input pixel's 3 x 3 (2 * N*H*W * C_in * C_out*KH*KW; walking every tap would count 2 * 2 times as
    # many); the output is [2, 4, 10, 14]
    launch, _ = _only(lambda x, w: conv_t(x, w, stride=2, padding=1, output_padding=1), x, torch.randn(3, 4, 3, 3))
    assert launch.kernel == "conv2d" and launch.flops == 2 * (2 * 5 * 7) * 3 * (4 * 3 * 3)
    assert launch.bytes_read == (2 * 3 * 5 * 7 + 3 * 4 * 3 * 3) * F32
    assert launch.bytes_written == 2 * 4 * 10 * 14 * F32


def test_3d_convolution_and_pooling_flops_count_the_depth():
    conv3d, conv_t = torch.nn.functional.conv3d, torch.nn.functional.conv_transpose3d
    x = torch.randn(2, 3, 4, 5, 7)
    # 2 * N*OD*OH*OW output voxels * C_out * C_in*KD*KH*KW (padding (0, 1, 1): OD = 2)
    launch, _ = _only(lambda x, w: conv3d(x, w, padding=(0, 1, 1)), x, torch.randn(4, 3, 3, 3, 3))
    assert launch.kernel == "conv2d" and launch.flops == 2 * (2 * 2 * 5 * 7) * 4 * (3 * 3 * 3 * 3)
    # transposed k2 s2, by stride phase: one exact tap per output voxel, as many as each input voxel's
    # 2 x 2 x 2, 2 * N*D*H*W * C_in * C_out*KD*KH*KW; the output is [2, 4, 8, 10, 14]
    launch, _ = _only(lambda x, w: conv_t(x, w, stride=2), x, torch.randn(3, 4, 2, 2, 2))
    assert launch.kernel == "conv2d" and launch.flops == 2 * (2 * 4 * 5 * 7) * 3 * (4 * 2 * 2 * 2)
    assert launch.bytes_written == 2 * 4 * 8 * 10 * 14 * F32
    # one op per window tap: [2, 3, 2, 2, 3] outputs of 2 x 2 x 2 taps
    launch, _ = _only(lambda x: torch.nn.functional.avg_pool3d(x, 2), x)
    assert launch.kernel == "pool2d" and launch.flops == (2 * 3 * 2 * 2 * 3) * 8

def _desc(offset, shape, strides):
    return TensorDesc(Base.SCRATCH, 0, offset * F32, "float32", shape, strides)


def test_overlapping_views_of_one_buffer_merge():
    halves = [(_desc(0, (4, 4), (8, 1)), None), (_desc(4, (4, 4), (8, 1)), None)]  # the two column halves
    assert _buffer_bytes(halves) == 32 * F32
    overlapping = [(_desc(0, (4, 6), (8, 1)), None), (_desc(2, (4, 6), (8, 1)), None)]  # columns 0-5, 2-7
    assert _buffer_bytes(overlapping) == 32 * F32
    windows = [(_desc(0, (3, 4), (2, 1)), None)]  # a self-overlapping view: elements 0..7
    assert _buffer_bytes(windows) == 8 * F32
    indexed = [(_desc(0, (100, 8), (8, 1)), 16)]  # reached through indices: 16 elements at most
    assert _buffer_bytes(indexed) == 16 * F32


# --- the fields through a file, summary and inspect -----------------------------------------------
def test_round_trip_summary_and_inspect(tmp_path, capsys):
    lowered = _lower(Fn(lambda x, w: torch.relu(x @ w)), torch.randn(17, 33), torch.randn(33, 65))
    (method,) = lowered.program.methods
    expected = [(l.bytes_read, l.bytes_written, l.flops) for d in method.delegates for l in d.plan.launches]
    assert all(r > 0 and w > 0 for r, w, _ in expected)
    path = tmp_path / "mm.tdp"
    lowered.save(path)
    with load_program(path) as f:
        (loaded,) = f.program.methods
        assert [(l.bytes_read, l.bytes_written, l.flops) for d in loaded.delegates for l in d.plan.launches] == expected
        assert method_traffic(loaded) == method_traffic(method)
    t = method_traffic(method)
    summary = lowered.summary()
    assert "modelled traffic: " in summary and f"ratio {t['ratio']:.2f}; " in summary and ") ; FLOPs" not in summary
    assert cli.main(["inspect", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["methods"][0]["traffic"] == t
    assert cli.main(["inspect", str(path)]) == 0
    assert f"modelled traffic: {t['bytes_read']} bytes read + " in capsys.readouterr().out


def test_kv_cache_decode_writes_only_the_new_entries():
    model = kv_cache_decoder(seed=0, max_batch=1)
    lowered = _lower(export_prefill_decode(model, 8))
    decode = next(m for m in lowered.program.methods if m.name == "decode")
    plan = decode.delegates[0].plan
    cfg = model.cfg
    row = cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * F32  # one position of one cache
    # each layer's attention writes its k and v rows into the caches, and its output [1, H, 1, E]
    appends = [l for l in plan.launches if l.kernel == "attention_append"]
    assert len(appends) == cfg.n_layers and all(l.bytes_written == 2 * row + cfg.dim * F32 for l in appends)
    t = method_traffic(decode)
    assert t["lower_bound_written"] == 2 * len(appends) * row + cfg.vocab_size * F32  # cache entries + logits
    assert 1.0 <= t["ratio"] < 1.5  # decode reads its weights, little else


# --- the demo decoder: the "before fusion" baseline -----------------------------------------------
def test_demo_decoder_traffic_against_its_lower_bound():
    model, (ids,) = demo_decoder(seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for batch in (1, 8):
        lowered = _lower(model, ids.repeat(batch, 1))
        (method,) = lowered.program.methods
        launches = [l for d in method.delegates for l in d.plan.launches]
        t = method_traffic(method)
        print(f"\ndemo decoder, batch {batch}: {t['launches']} launches, "
              f"{t['bytes_read']} B read + {t['bytes_written']} B written = {t['bytes']} B, "
              f"lower bound {t['lower_bound']} B, ratio {t['ratio']:.2f}, {t['flops']} FLOPs")
        assert t["bytes_read"] == sum(l.bytes_read for l in launches)
        assert t["flops"] == sum(l.flops for l in launches) > 0
        assert all(l.bytes_written > 0 for l in launches)
        assert t["lower_bound_read"] <= t["bytes_read"] and t["lower_bound_written"] <= t["bytes_written"]
        assert t["lower_bound_written"] == batch * 16 * model.cfg.vocab_size * F32  # the logits
        # every weight but the embedding table (only the gathered rows count) is read once
        embed = model.embed.weight
        assert t["lower_bound_read"] >= weights - embed.numel() * F32
        assert t["ratio"] > 1.0
        # above the bound: the values one launch writes and the next reads, and almost nothing else
        assert 0 < t["intermediates"] <= t["bytes"] - t["lower_bound"] <= t["intermediates"] + 0.01 * t["lower_bound"]


def test_intermediates_are_the_values_between_launches():
    """cumsum(x @ w): the product is written by the matmul and read by the cumsum, once each."""
    m, k, n = 6, 8, 10
    lowered = _lower(Fn(lambda x, w: torch.cumsum(x @ w, 0)), torch.randn(m, k), torch.randn(k, n))
    (method,) = lowered.program.methods
    assert [l.kernel for d in method.delegates for l in d.plan.launches] == ["matmul", "cumsum"]
    t = method_traffic(method)
    assert t["intermediates"] == 2 * m * n * F32
    assert t["bytes"] == t["lower_bound"] + t["intermediates"]


def _window_sdpa(window: int):
    def attend(q, k, v, pos):
        index, p = torch.arange(k.shape[-2])[None, None, None, :], pos[None, None, :, None]
        keep = index <= p
        if window:
            keep = keep & (index > p - window)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(1, -1, -1, -1),
                                                                 enable_gqa=True)
    return attend


@pytest.mark.parametrize("lq", [1, 6])
def test_a_sliding_window_reads_its_window_not_the_whole_cache(lq):
    """A window attention's keys and values: the window and a tile (the kernel skips the tiles before
    it), from the first query's position to the last's (consecutive positions), of every key head."""
    keys, kv_heads, e = 512, 2, 16
    q, k, v = torch.randn(1, 4, lq, e), torch.randn(1, kv_heads, keys, e), torch.randn(1, kv_heads, keys, e)
    pos = torch.arange(300, 300 + lq)
    whole, windowed = ([l for l in _launches(_window_sdpa(w), q, k, v, pos)[0] if l.kernel == "attention"][0]
                       for w in (0, 40))  # (with the keys split over programs, then their combine)
    assert windowed.constexprs["WINDOW"].value == 40
    read = (lq - 1 + 40 + windowed.constexprs["BLOCK_N"].value - 1) * kv_heads * e * F32
    others = q.numel() * F32 + pos.numel() * 8  # the queries and the positions
    assert windowed.bytes_read == 2 * read + others
    assert whole.bytes_read == 2 * k.numel() * F32 + others
    assert windowed.flops * keys == whole.flops * (read // (kv_heads * e * F32))
