import math

import pytest
import torch
import torch.nn.functional as F

from harness import FLOAT_DTYPES, check_model, export_decomposed
from tritondelegate.kernels import attention

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Sdpa(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)


def _f32(t):
    return t.float() if t.is_floating_point() else t


def check_sdpa(model, args, dtype):
    """Run through the delegate, compare with eager in fp32, and check the sdpa node is one launch."""
    results, plan = check_model(model, args, dtype=dtype, reference_args=(model, [_f32(a) for a in args]))
    assert [launch.op for launch in plan.launches] == ["scaled_dot_product_attention"]
    assert plan.launches[0].kernel == "attention"
    return results, plan


def qkv(b, hq, hkv, lq, lk, e, dtype, ev=None):
    return (torch.randn(b, hq, lq, e, dtype=dtype), torch.randn(b, hkv, lk, e, dtype=dtype),
            torch.randn(b, hkv, lk, ev or e, dtype=dtype))


# (Lq, Lk, head dim, is_causal): odd lengths, a non-power-of-two head, causal with Lq != Lk both ways.
SHAPES = [
    (1, 1, 16, False),
    (1, 17, 64, False),
    (17, 17, 24, True),
    (33, 17, 64, True),
    (17, 33, 16, True),
    (33, 33, 24, False),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lq,lk,e,causal", SHAPES)
def test_shapes(lq, lk, e, causal, dtype):
    check_sdpa(Sdpa(is_causal=causal), qkv(2, 2, 2, lq, lk, e, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk", [(129, 200), (200, 129)])
@pytest.mark.parametrize("causal", [False, True])
def test_many_tiles(lq, lk, causal, dtype):
    # Several query blocks and key tiles: whole tiles, the causal diagonal, a ragged last tile.
    check_sdpa(Sdpa(is_causal=causal), qkv(1, 1, 1, lq, lk, 16, dtype), dtype)


# Every broadcast pattern in fp32; one pattern per low-precision dtype.
MASK_CASES = [(torch.float32, (17, 33)), (torch.float32, (2, 1, 1, 33)), (torch.float32, (1, 3, 17, 33)),
              (torch.float32, (3, 1, 33)), (torch.float16, (2, 1, 1, 33)), (torch.bfloat16, (17, 33))]


@pytest.mark.parametrize("dtype,mask_shape", MASK_CASES)
def test_bool_mask_broadcast(mask_shape, dtype):
    mask = torch.rand(mask_shape) > 0.3
    check_sdpa(Sdpa(), (*qkv(2, 3, 3, 17, 33, 24, dtype), mask), dtype)


@pytest.mark.parametrize("dtype,mask_shape", MASK_CASES + [(torch.float32, (2, 1, 17, 1))])
def test_float_mask_broadcast(mask_shape, dtype):
    mask = torch.randn(mask_shape, dtype=dtype)
    check_sdpa(Sdpa(scale=0.3), (*qkv(2, 3, 3, 17, 33, 16, dtype), mask), dtype)


def test_expanded_mask_is_read_with_zero_strides():
    # An in-graph expand (what HF builds) reaches the kernel as stride-0 dims: no copy launch.
    class Expanded(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(2, 3, 17, 33))

    args = (*qkv(2, 3, 3, 17, 33, 16, torch.float32), torch.rand(17, 33) > 0.5)
    check_sdpa(Expanded(), args, torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fully_masked_rows_give_what_eager_gives(dtype):
    # Eager's safe softmax gives 0 for a row with every key masked (bool False or -inf); a row of
    # finite huge negatives (HF's finfo.min padding) is an ordinary softmax: the mean of v.
    q, k, v = qkv(1, 2, 2, 5, 70, 16, dtype)
    keep = torch.rand(5, 70) > 0.5
    keep[1] = False
    (out,), _ = check_sdpa(Sdpa(), (q, k, v, keep), dtype)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    bias = torch.randn(5, 70, dtype=dtype)
    bias[2] = float("-inf")
    bias[3] = torch.finfo(dtype).min
    bias[4, :40] = float("-inf")  # only the second key tile is visible
    (out,), _ = check_sdpa(Sdpa(), (q, k, v, bias), dtype)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1)])
def test_gqa(hq, hkv, dtype):
    check_sdpa(Sdpa(enable_gqa=True, is_causal=True), qkv(2, hq, hkv, 17, 17, 16, dtype), dtype)


def test_kv_head_broadcast_without_gqa():
    check_sdpa(Sdpa(), qkv(1, 3, 1, 17, 9, 16, torch.float32), torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_custom_scale_and_value_head_dim(dtype):
    check_sdpa(Sdpa(scale=0.05), qkv(2, 2, 2, 17, 33, 24, dtype, ev=40), dtype)


@pytest.mark.parametrize("shapes", [
    ((3, 17, 16), (3, 9, 16), (3, 9, 24)),  # rank 3: [N, L, E]
    ((17, 16), (9, 16), (9, 16)),  # rank 2
    ((1, 2, 17, 16), (3, 2, 9, 16), (3, 2, 9, 16)),  # query broadcast over the batch
])
def test_ranks_and_batch_broadcast(shapes):
    args = [torch.randn(s) for s in shapes]
    check_sdpa(Sdpa(), args, torch.float32)


@pytest.mark.parametrize("dtype,same_shape_view", [(torch.float32, False), (torch.float16, True),
                                                   (torch.bfloat16, False)])
def test_llama_style_views_need_no_copy(dtype, same_shape_view):
    # q/k/v as `view + transpose` of [B, L, H*E] projections, GQA, and the output transposed back and
    # flattened (through a same-shape view, as HF's sdpa wrapper exports): the kernel reads the
    # strided views and writes [B, L, H, E], so the whole block is one launch, no copy either side.
    b, l, hq, hkv, e = 2, 17, 4, 2, 16

    class Block(torch.nn.Module):
        def forward(self, xq, xkv):
            q = xq.view(b, l, hq, e).transpose(1, 2)
            k = xkv[..., : hkv * e].view(b, l, hkv, e).transpose(1, 2)
            v = xkv[..., hkv * e:].view(b, l, hkv, e).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if same_shape_view:
                out = out.view(b, hq, l, e)
            return out.transpose(1, 2).reshape(b, l, hq * e)

    args = (torch.randn(b, l, hq * e, dtype=dtype), torch.randn(b, l, 2 * hkv * e, dtype=dtype))
    check_sdpa(Block(), args, dtype)


def _sdpa_node(model, args):
    ep = export_decomposed(model, args)
    return next(n for n in ep.graph.nodes if n.target == SDPA)


def test_support_refusals_say_why():
    q, k, v = qkv(1, 2, 2, 5, 5, 16, torch.float32)
    assert attention.supported(_sdpa_node(Sdpa(is_causal=True), (q, k, v))) is None
    reason = attention.supported(_sdpa_node(Sdpa(dropout_p=0.1), (q, k, v)))
    assert "dropout_p=0.1" in reason
    mask = torch.ones(5, 5, dtype=torch.bool)
    reason = attention.supported(_sdpa_node(Sdpa(is_causal=True), (q, k, v, mask)))
    assert "is_causal" in reason
    q, k, v = qkv(1, 2, 2, 5, 5, 512, torch.float32)
    assert "head dim 512" in attention.supported(_sdpa_node(Sdpa(), (q, k, v)))
    q, k, v = (t.double() for t in qkv(1, 2, 2, 5, 5, 16, torch.float32))
    assert "float64" in attention.supported(_sdpa_node(Sdpa(), (q, k, v)))


def test_block_sizes_fit_dot_and_the_sequence():
    for dtype in FLOAT_DTYPES:
        for lq, lk, e in [(1, 1, 16), (1, 4096, 128), (4096, 4096, 64), (4096, 4096, 256)]:
            bm, bn, warps, stages = attention.block_sizes(lq, lk, e, dtype)
            assert 16 <= bm <= max(16, 2 ** math.ceil(math.log2(lq))) and 16 <= bn
            assert warps in (4, 8) and stages >= 1
    assert attention.block_sizes(4096, 4096, 128, torch.float16)[:2] == (128, 64)
    # A mask tile beside 128 x 64 spills on sm_90: heads over 64 take 32 keys a tile then.
    assert attention.block_sizes(4096, 4096, 128, torch.float16, masked=True)[:2] == (128, 32)
    assert attention.block_sizes(4096, 4096, 64, torch.bfloat16, masked=True)[:2] == (128, 64)
