import pytest
import torch

from harness import FLOAT_DTYPES, Fn, check_model, run_delegated
from tritondelegate.kernels import index

INDEX_DTYPES = (torch.int64, torch.int32)
DATA_DTYPES = FLOAT_DTYPES + (torch.int64,)


def _data(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-100, 100, shape, dtype=dtype)


# --- embedding ------------------------------------------------------------------------------------
class Embed(torch.nn.Module):
    def __init__(self, num, dim, dtype):
        super().__init__()
        self.emb = torch.nn.Embedding(num, dim, padding_idx=0, dtype=dtype)

    def forward(self, ids):
        return self.emb(ids)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_embedding(dtype, index_dtype):
    ids = torch.randint(0, 129, (3, 33), dtype=index_dtype)
    _, plan = check_model(Embed(129, 33, dtype), (ids,))
    assert [launch.kernel for launch in plan.launches] == ["gather"]


def test_embedding_single_id():
    check_model(Embed(17, 1, torch.float32), (torch.tensor([16]),))


def test_embedding_of_strided_ids_and_tied_weight():
    ids = torch.randint(0, 65, (33, 4))
    model = Embed(65, 17, torch.float32)
    check_model(Fn(lambda ids: (model(ids.t()), model(ids[::2, 1]) + model.emb.weight[:17])), (ids,))


# --- index_select and gather ----------------------------------------------------------------------
# Each supported data dtype once, each index dtype twice.
DTYPE_PAIRS = [(torch.float32, torch.int64), (torch.float16, torch.int32), (torch.bfloat16, torch.int64),
               (torch.int64, torch.int32)]


@pytest.mark.parametrize("dtype,index_dtype", DTYPE_PAIRS)
def test_index_select(dtype, index_dtype):
    x = _data((17, 5, 33), dtype)
    idx = torch.randint(0, 5, (9,), dtype=index_dtype)  # in range for every dim of x and its transpose
    fn = lambda x, i: [torch.index_select(y, d, i) for y in (x, x.transpose(0, 2)) for d in (0, 1, -1)]  # noqa: E731
    check_model(Fn(fn), (x, idx))


def test_index_select_scalar_index():
    check_model(Fn(lambda x, i: torch.index_select(x, 1, i)), (torch.randn(17, 33), torch.tensor(4)))


@pytest.mark.parametrize("dtype,index_dtype", DTYPE_PAIRS)
def test_gather(dtype, index_dtype):
    x = _data((17, 6, 33), dtype)
    idx = torch.randint(0, 6, (9, 5, 21), dtype=index_dtype)  # smaller than x on every dim, as gather allows
    fn = lambda x, i: [torch.gather(y, d, j) for y, j in ((x, i), (x.permute(1, 0, 2), i[:5, :5, :6]))  # noqa: E731
                       for d in (0, 1, 2)]
    check_model(Fn(fn), (x, idx))


# --- advanced indexing (index.Tensor) -------------------------------------------------------------
CASES = {
    "first_dim": lambda x, i, j: x[i],
    "middle_dim": lambda x, i, j: x[:, i],
    "last_dim": lambda x, i, j: x[..., j],
    "two_adjacent_broadcast": lambda x, i, j: x[:, i[:, None], j[None, :4]],
    "two_separate": lambda x, i, j: x[i[:4], :, j[:4]],  # non-adjacent: the broadcast dims come first
    "three": lambda x, i, j: x[i[:3], i[:3], j[:3]],
    "negative": lambda x, i, j: x[-1 - i],
    "strided_source": lambda x, i, j: x.transpose(0, 2)[j],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_index_tensor(name):
    index_dtype = INDEX_DTYPES[sorted(CASES).index(name) % 2]
    x = torch.randn(17, 5, 33)
    i = torch.randint(0, 5, (7,), dtype=index_dtype)
    j = torch.randint(0, 17, (6,), dtype=index_dtype)
    fn = CASES[name]
    check_model(Fn(fn), (x, i, j))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.bool,))
def test_index_tensor_dtypes(dtype):
    x = torch.randn(33, 9) > 0 if dtype == torch.bool else torch.randn(33, 9, dtype=dtype)
    check_model(Fn(lambda x, i: x[i, 1:]), (x, torch.randint(0, 33, (4, 17))))


def test_index_as_in_causal_lm_masks():
    # transformers builds its causal mask with vmap-style broadcast index tensors over an expanded
    # position tensor and a cumsum of a bool tensor.
    pos = torch.arange(7)

    def fn(ids):
        cache = pos.unsqueeze(0).expand(ids.shape[0], -1)
        b = torch.arange(ids.shape[0])[:, None, None, None]
        q = pos[None, None, :, None]
        k = pos[None, None, None, :]
        seq = torch.cumsum(ids != 0, -1)
        return (cache[b, k] <= cache[b, q]) & (seq[b, q] == seq[b, k])

    check_model(Fn(fn), (torch.randint(0, 3, (2, 7)),))


def test_index_support_refusals():
    ep = torch.export.export(Fn(lambda x, m: x[m]), (torch.randn(4, 3), torch.ones(4, 3, dtype=torch.bool)))
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.index.Tensor)
    assert "boolean mask" in index.supported_index(node)
    ep = torch.export.export(Fn(lambda x, i: x[i, i, i, i]), (torch.randn(2, 2, 2, 2), torch.ones(2, dtype=torch.int64)))
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.index.Tensor)
    assert index.supported_index(node) == "4 index tensors (at most 3)"


# --- cumsum ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64, torch.int32, torch.bool))
def test_cumsum(dtype):
    shapes = [((1,), 0), ((341,), 0), ((17, 33), 1), ((17, 33), 0), ((3, 5, 7), 1)]
    xs = [(torch.randn(s) > 0) if dtype == torch.bool else _data(s, dtype) for s, _ in shapes]
    if dtype.is_floating_point:
        xs = [(x * 0.1).to(dtype) for x in xs]  # keep long sums well inside the half-precision range
    fn = lambda *xs: [torch.cumsum(x, d) for x, (_, d) in zip(xs, shapes)]  # noqa: E731
    if not dtype.is_floating_point:
        check_model(Fn(fn), xs)  # int64 results, exact
        return
    ref = lambda *xs: [torch.cumsum(x, d).to(dtype) for x, (_, d) in zip(xs, shapes)]  # noqa: E731
    # fp32 reference; the longest scan (341 terms) in half precision gets a wider tolerance.
    check_model(Fn(fn), xs, reference_args=(Fn(ref), [x.float() for x in xs]), scale=4)


def test_cumsum_strided_and_dtype():
    x = torch.randn(33, 17)
    check_model(Fn(lambda x: (torch.cumsum(x.t(), 1), torch.cumsum(x[:, 3], 0, dtype=torch.float16),
                              torch.cumsum(x > 0, 0, dtype=torch.int32))), (x,),
                reference_args=None, scale=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cummax_and_cummin_keep_eagers_indices(dtype):
    """Ties keep the later index, NaN wins and a later NaN wins over an earlier one, a row of 300 crosses
    the 256-wide chunks, and an empty scan writes nothing (Grounding DINO's text masks)."""
    x = torch.randint(-3, 4, (5, 300)).to(dtype)  # many ties
    if dtype.is_floating_point:
        x[0, 7] = x[2, 100] = x[2, 250] = float("nan")
    fn = lambda x: (torch.cummax(x, 1), torch.cummin(x, 0), torch.cummin(x.t(), 1),  # noqa: E731
                    torch.cummax(x[:, :0], 1))
    results, plan = run_delegated(Fn(fn), (x,))
    expected = torch.utils._pytree.tree_leaves(fn(x))
    assert len(results) == len(expected) == 8
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0)
    assert {launch.kernel for launch in plan.launches} == {"cumextreme"}
    assert results[0][2, 260].isnan() == dtype.is_floating_point


# --- split (layout.py; needed by GPT-2's fused qkv projection) ------------------------------------
def test_split_with_sizes_is_a_view():
    x = torch.randn(2, 7, 96)
    fn = lambda x: [p * 2 for p in torch.split(x, [32, 17, 47], dim=2)] + list(torch.chunk(x, 3, 1))  # noqa: E731
    _, plan = check_model(Fn(fn), (x,))
    assert [launch.op for launch in plan.launches][:3] == ["mul", "mul_1", "mul_2"]


def test_split_outputs_need_no_copy_kernel_of_their_own():
    results, _ = run_delegated(Fn(lambda x: torch.split(x, [1, 4])), (torch.randn(5, 3),))
    assert [r.shape for r in results] == [(1, 3), (4, 3)]


def test_indexing_results_with_more_dims_of_size_one_than_a_launch_walks():
    """``unfold`` (ConvBERT's, MobileViTv2's) decomposes into an index whose result is 6-D with size-1
    dims, and an index_put of the same; size-1 dims are dropped from the walk, so both run on the device."""
    from harness import lower_resident

    fn = lambda x: torch.nn.functional.unfold(x, (3, 1), padding=(1, 0)) * 2  # noqa: E731
    x = torch.randn(1, 16, 7, 1)
    lowered = lower_resident(Fn(fn), (x,))
    assert not lowered.reports["forward"].nodes.host
    torch.testing.assert_close(lowered.load().load_method()(x), fn(x))
    fold = lambda x: torch.nn.functional.fold(x, (7, 1), (3, 1), padding=(1, 0))  # noqa: E731
    y = torch.randn(1, 48, 7)
    lowered = lower_resident(Fn(fold), (y,))
    assert not lowered.reports["forward"].nodes.host
    torch.testing.assert_close(lowered.load().load_method()(y), fold(y))


class PatchUnfold(torch.nn.Module):
    """MobileViTv2's patches: ``unfold`` into non-overlapping 2 x 2 patches, then ``fold`` back, at a batch
    of 2: each decomposes into an index (index_put with accumulation) of six dims of size other than 1,
    whose batch and channel dims merge (the patches cover the map), so five are walked."""

    def forward(self, x):
        patches = torch.nn.functional.unfold(x, (2, 2), stride=(2, 2)) * 2.0
        return torch.nn.functional.fold(patches, x.shape[-2:], (2, 2), stride=(2, 2))


def test_indexing_of_six_dims_that_merge_into_five():
    from harness import lower_resident

    x = torch.randn(2, 3, 6, 8)
    lowered = lower_resident(PatchUnfold(), (x,))
    assert not lowered.reports["forward"].nodes.host
    torch.testing.assert_close(lowered.load().load_method()(x), PatchUnfold()(x))


def test_indexing_of_six_dims_at_a_dynamic_batch():
    from harness import check_dynamic

    batch = torch.export.Dim("batch", min=2, max=4)
    calls = [(torch.randn(n, 3, 6, 8),) for n in (2, 4, 3)]
    check_dynamic(PatchUnfold(), calls, {"x": {0: batch}})


def test_indexing_of_six_dims_that_do_not_merge_stays_on_the_host():
    """x[:, i, :, j, :, k] with i, j, k along three dims of their broadcast: the three index dims, then
    x's dims 0, 2 and 4, no two of them contiguous together (with x's strides or a contiguous copy's)."""
    fn = lambda x, i, j, k: x[:, i[:, None, None], :, j[None, :, None], :, k] * 1.0  # noqa: E731
    args = (torch.randn(2, 3, 4, 5, 6, 7), torch.tensor([0, 2, 1]), torch.tensor([1, 4]), torch.tensor([6, 0]))
    ep = torch.export.export(Fn(fn), args)
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.index.Tensor)
    assert "dims of size other than 1 that do not merge (at most 5)" in index.supported_index(node)
    from harness import lower_resident

    lowered = lower_resident(Fn(fn), args)
    assert [op for _, op, _ in lowered.reports["forward"].nodes.host] == ["aten.index.Tensor"]
    torch.testing.assert_close(lowered.load().load_method()(*args), fn(*args))
