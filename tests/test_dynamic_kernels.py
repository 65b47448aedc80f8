"""Kernel families with a bounded dynamic dimension (``torch.export.Dim(..., max=N)``).

Each test exports a small function with one or two dynamic dims, lowers it once (every compute node
delegated) and runs it through one loaded program at size 1, at the bound and at primes in between,
comparing with eager (``harness.check_dynamic``). Block sizes and one-pass decisions are taken at the
bound, so a smaller size exercises the masked tails; sizes that depend on the symbols (grids, counts,
divisors, split counts) are evaluated per call.

The first call is the example export traces with: never size 1 (export specializes a dim it sees
at 1). Bounds are chosen not to coincide with any static size of the same test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from harness import Fn, check_dynamic
from tritondelegate.symbolic import Expr

aten = torch.ops.aten
BOUND = 11
SIZES = (5, 1, BOUND, 7)  # example first; then 1, the bound and a prime in between


def calls(make, sizes=SIZES):
    """One argument tuple per size: ``make(n)`` returns the arguments at size ``n``."""
    return [tuple(make(n)) for n in sizes]


def dyn(*dims_per_arg, bound=BOUND):
    """Dynamic shapes for an ``Fn``: one Dim (up to ``bound``) shared by every (arg, dim) listed;
    ``None`` for static arguments. ``dyn(0, None, (0, 1))``: dim 0 of arg 0, dims 0 and 1 of arg 2."""
    d = Dim("n", max=bound)
    specs = []
    for dims in dims_per_arg:
        if dims is None:
            specs.append(None)
        else:
            specs.append({k: d for k in ((dims,) if isinstance(dims, int) else dims)})
    return {"args": tuple(specs)}


def half(fn):
    """(model in ``dtype``, fp32 reference on the same rounded values) for fp16/bf16 variants."""
    return Fn(fn), lambda *args: fn(*(a.float() if a.is_floating_point() else a for a in args))


# --- reductions (reduce.py, rows.py) ----------------------------------------------------------------
def test_reductions_over_and_along_a_dynamic_dim():
    # x [n, 6]: reducing the dynamic dim (a dynamic column count, a dynamic divisor) and the static
    # one (a dynamic row count); full reductions over both
    fn = lambda x: (  # noqa: E731
        x.sum(0), x.mean(0), x.amax(0), x.argmax(0), torch.var(x, 0, correction=0),
        x.sum(-1), x.mean(-1, keepdim=True), x.amin(-1), *torch.var_mean(x, -1), *x.max(-1), x.argmin(-1),
        x.sum(), x.mean(), x.amax(), x.prod(0), torch.linalg.vector_norm(x, dim=0),
    )
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(n, 6)]), dyn(0))


@pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_variance_divisor_over_a_dynamic_count():
    # max(N - correction, 0) with N dynamic: over dims 1 and 2, N = 2n, so the divisor reaches 0 at
    # n = 1 (an infinite variance, as eager's)
    fn = lambda x: (torch.var(x, (0, 1)), torch.var(x, (1, 2), correction=3),  # noqa: E731
                    torch.var_mean(x, (1, 2), correction=2))
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(3, n, 2)]), dyn(1))


def test_reductions_over_a_dynamic_middle_dim_and_several_dims():
    # dims 0 and 2 of [3, n, 4]: a copy that moves the reduced dims last, then a dynamic row count;
    # dim 0: rows contiguous with each other, columns strided (the narrow, tall tile)
    fn = lambda x: (x.sum((0, 2)), x.mean((0, 2), keepdim=True), x.amax(1), x.sum(1).argmax(-1),  # noqa: E731
                    x.sum(0), x.transpose(1, 2).mean(0))
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(3, n, 4)]), dyn(1))


def test_integer_sum_over_a_dynamic_dim():
    fn = lambda x: (x.sum(0), x.sum(-1), x.sum())  # noqa: E731
    check_dynamic(Fn(fn), calls(lambda n: [torch.randint(-50, 50, (n, 3))]), dyn(0))


def test_full_reduction_split_over_a_dynamic_number_of_programs():
    # 2048 columns a row, up to 11 rows: at the bound a full reduction splits its 22528 columns over
    # programs; the split count (and the second launch's columns) follow the size
    fn = lambda x: (x.sum(), x.mean(), x.amax())  # noqa: E731
    lowered, _ = check_dynamic(Fn(fn), calls(lambda n: [torch.randn(n, 2048)]), dyn(0), scale=10)
    grids = [launch.grid for d in lowered.program.methods[0].delegates for launch in d.plan.launches
             if launch.kernel == "reduce"]
    assert len(grids) == 6  # per reduction: partials over a dynamic number of programs, then their reduction
    assert all(isinstance(grid[1], Expr) for grid in grids[::2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reductions_half(dtype):
    model, reference = half(lambda x: (x.mean(0), torch.var(x, 0, correction=0), x.sum(-1), x.amax(0)))
    check_dynamic(model, calls(lambda n: [torch.randn(n, 6, dtype=dtype)]), dyn(0), dtype=dtype,
                  reference=reference)


# --- softmax (softmax.py) ---------------------------------------------------------------------------
def test_softmax_along_and_across_dynamic_dims():
    # [b, s, 6]: along the static last dim (dynamic rows), along the dynamic dims (dynamic columns)
    fn = lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 1), torch.softmax(x, 0),  # noqa: E731
                    torch.log_softmax(x.transpose(1, 2), -1))
    b = Dim("b", max=3)
    s = Dim("s", max=BOUND)
    sizes = [(2, 5), (1, 1), (3, BOUND), (2, 7)]
    check_dynamic(Fn(fn), [(torch.randn(bb, ss, 6),) for bb, ss in sizes], {"args": ({0: b, 1: s},)})


def test_softmax_long_dynamic_rows_take_two_passes():
    # up to 4500 columns: past the one-pass block (4096), so every size takes the looping kernel
    fn = lambda x: (torch.softmax(x, -1), torch.log_softmax(x, -1))  # noqa: E731
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(2, n) * 4], sizes=(4099, 1, 4500, 13)),
                  dyn(1, bound=4500))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half(dtype):
    model, reference = half(lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 0)))
    check_dynamic(model, calls(lambda n: [torch.randn(n, 9, dtype=dtype)]), dyn(0), dtype=dtype,
                  reference=reference)


# --- normalization (norm.py) ------------------------------------------------------------------------
class Norms(torch.nn.Module):
    def __init__(self, cols=8):
        super().__init__()
        self.ln = torch.nn.LayerNorm(cols)
        self.rms = torch.nn.RMSNorm(cols, eps=1e-6)
        with torch.no_grad():
            self.ln.weight.normal_()
            self.ln.bias.normal_()
            self.rms.weight.normal_()

    def forward(self, x):
        return self.ln(x), self.rms(x), F.layer_norm(x, (x.shape[-1],))


def test_layer_norm_and_rms_norm_with_dynamic_rows():
    b, s = Dim("b", max=3), Dim("s", max=BOUND)
    sizes = [(2, 5), (1, 1), (3, BOUND), (1, 7)]
    check_dynamic(Norms().eval(), [(torch.randn(bb, ss, 8),) for bb, ss in sizes], {"x": {0: b, 1: s}})


def test_norms_over_a_dynamic_last_dim():
    # normalized over the dynamic dim itself: a dynamic column count, one pass below the block cap
    # and two passes past it
    fn = lambda x: (F.layer_norm(x, (x.shape[-1],)), F.rms_norm(x, (x.shape[-1],)))  # noqa: E731
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(3, n)]), dyn(1))
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(2, n) + 3], sizes=(4099, 1, 4500, 13)),
                  dyn(1, bound=4500))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_half(dtype):
    model = Norms().eval()
    reference = Norms().eval()
    reference.load_state_dict(model.state_dict())
    model = model.to(dtype)
    check_dynamic(model, calls(lambda n: [torch.randn(n, 8, dtype=dtype)]), {"x": {0: Dim("n", max=BOUND)}},
                  dtype=dtype, reference=lambda x: reference(x.float()))


# --- batch norm (batchnorm.py) ----------------------------------------------------------------------
class BN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4)
        self.bn1 = torch.nn.BatchNorm1d(4, affine=False)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.normal_()
            self.bn1.running_mean.normal_()

    def forward(self, x, y):
        return self.bn(x), self.bn(x.permute(0, 1, 3, 2)), self.bn1(y)


def test_batch_norm_with_dynamic_batch_and_height():
    n, h = Dim("n", max=5), Dim("h", max=BOUND)
    sizes = [(2, 5), (1, 1), (5, BOUND), (3, 7)]
    args = [(torch.randn(nn, 4, hh, 3), torch.randn(nn, 4, hh)) for nn, hh in sizes]
    check_dynamic(BN().eval(), args, {"x": {0: n, 2: h}, "y": {0: n, 2: h}})


# --- convolution (conv.py) --------------------------------------------------------------------------
class Convs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.strided = torch.nn.Conv2d(3, 4, 3, stride=2, bias=False)
        self.grouped = torch.nn.Conv2d(4, 4, (1, 3), padding=(0, 1), groups=2)

    def forward(self, x):
        return self.grouped(self.conv(x)), self.strided(x)


def test_conv2d_with_dynamic_batch_height_and_width():
    # export specializes an output dim it finds could be 1: the strided 3x3 conv needs h, w >= 5
    n, h, w = Dim("n", max=3), Dim("h", min=5, max=BOUND), Dim("w", min=5, max=9)
    sizes = [(2, 6, 7), (1, 5, 5), (3, BOUND, 9), (1, 7, 6)]
    args = [(torch.randn(nn, 3, hh, ww),) for nn, hh, ww in sizes]
    check_dynamic(Convs(), args, {"x": {0: n, 2: h, 3: w}})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv2d_half(dtype):
    torch.manual_seed(0)
    reference = Convs()
    model = Convs()
    model.load_state_dict(reference.state_dict())
    model = model.to(dtype)
    args = [(torch.randn(nn, 3, 6, 6, dtype=dtype),) for nn in (2, 1, 5, 3)]
    check_dynamic(model, args, {"x": {0: Dim("n", max=5)}}, dtype=dtype,
                  reference=lambda x: reference(x.float()))


# --- pooling (pool.py) ------------------------------------------------------------------------------
def test_pooling_with_dynamic_batch_and_spatial_dims():
    def fn(x):
        out, idx = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
        return (out, idx, F.max_pool2d(x, 2), F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
                F.avg_pool2d(x, (2, 3), padding=1), F.adaptive_avg_pool2d(x, (3, 2)), F.adaptive_avg_pool2d(x, 1))

    # export specializes an output dim it finds could be 1 (and ceil_mode on the parity of a size):
    # h, w >= 4
    n, h, w = Dim("n", max=3), Dim("h", min=4, max=BOUND), Dim("w", min=4, max=9)
    sizes = [(2, 5, 7), (1, 4, 4), (3, BOUND, 9), (1, 7, 5)]
    args = [(torch.randn(nn, 2, hh, ww),) for nn, hh, ww in sizes]
    check_dynamic(Fn(fn), args, {"args": ({0: n, 2: h, 3: w},)})


# --- indexing (index.py) ----------------------------------------------------------------------------
class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 6)

    def forward(self, ids):
        return self.embed(ids)


def test_embedding_with_dynamic_batch_and_sequence():
    b, s = Dim("b", max=3), Dim("s", max=BOUND)
    sizes = [(2, 5), (1, 1), (3, BOUND), (2, 7)]
    check_dynamic(Embed(), [(torch.randint(0, 20, (bb, ss)),) for bb, ss in sizes], {"ids": {0: b, 1: s}})


def test_gather_index_select_and_advanced_indexing_with_dynamic_sizes():
    # a dynamic number of rows to pick (idx), out of a source with a dynamic number of rows (x)
    fn = lambda x, idx, col, g: (  # noqa: E731
        x[idx - 3], x.index_select(0, idx), x[:, col], torch.gather(x, 1, g), x[idx, col], x[idx[:, None], col],
    )

    def make(n):  # negative indices wrap (index_select takes none)
        return (torch.randn(n + 5, 6), torch.randint(0, n + 5, (n,)), torch.randint(-6, 6, (n,)),
                torch.randint(0, 6, (n + 5, 4)))

    rows = Dim("n", max=BOUND)
    ds = {"args": ({0: rows + 5}, {0: rows}, {0: rows}, {0: rows + 5})}
    check_dynamic(Fn(fn), calls(make), ds)


def test_cumsum_along_and_across_a_dynamic_dim():
    fn = lambda x, i: (x.cumsum(1), x.cumsum(0), i.cumsum(1), x.transpose(0, 1).cumsum(0))  # noqa: E731
    make = lambda n: (torch.randn(3, n), torch.randint(-5, 5, (2, n)))  # noqa: E731
    check_dynamic(Fn(fn), calls(make, sizes=(300, 1, 517, 7)), dyn(1, 1, bound=517))


def test_position_ids_from_arange_and_a_padding_mask():
    # the attention-mask code of causal LMs: cumsum of a mask, arange over the dynamic sequence
    def fn(ids, mask):
        pos = mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(mask == 0, 1)
        return pos, torch.arange(ids.shape[1]).expand_as(ids) + ids

    b, s = Dim("b", max=3), Dim("s", max=BOUND)
    sizes = [(2, 5), (1, 1), (3, BOUND), (2, 7)]
    args = [(torch.randint(0, 9, (bb, ss)), torch.randint(0, 2, (bb, ss))) for bb, ss in sizes]
    check_dynamic(Fn(fn), args, {"args": ({0: b, 1: s}, {0: b, 1: s})})


# --- scatter (scatter.py) ---------------------------------------------------------------------------
def test_index_put_scatter_and_index_copy_with_dynamic_counts():
    # a dynamic number of distinct rows written into a static table, and a static update of a table
    # with a dynamic number of rows
    def fn(table, rows, vals, big):
        return (aten.index_put(table, [rows], vals), aten.index_put(table, [rows], vals, True),
                table.index_copy(0, rows, vals), aten.index_put(big, [torch.tensor([0, 2])], vals[:1]),
                torch.scatter(big, 1, torch.zeros_like(big[:, :2], dtype=torch.long), big[:, 2:4]),
                torch.scatter_add(big, 1, torch.ones_like(big[:, :3], dtype=torch.long), big[:, :3]))

    def make(n):
        return (torch.randn(13, 4), torch.randperm(13)[:n], torch.randn(n, 4), torch.randn(n + 2, 4))

    rows = Dim("n", max=BOUND)
    ds = {"args": (None, {0: rows}, {0: rows}, {0: rows + 2})}
    check_dynamic(Fn(fn), calls(make), ds)


def test_slice_and_select_scatter_of_dynamic_sizes():
    # a dynamic-length block written into a static buffer, a static block into a dynamic tensor
    def fn(buf, new, x):
        return (torch.slice_scatter(buf, new, 1, 0, new.shape[1]),
                torch.slice_scatter(x, torch.zeros_like(x[:, :2]), 1, 1, 3),
                torch.select_scatter(x, x[:, 0] * 2, 1, -1),
                torch.slice_scatter(x, x[1:] + 1, 0, 1))

    def make(n):
        return torch.randn(2, 16, 3), torch.randn(2, n, 3), torch.randn(n + 1, 4)

    d = Dim("n", max=BOUND)
    ds = {"args": (None, {1: d}, {0: d + 1})}
    check_dynamic(Fn(fn), calls(make), ds)


# --- creation (creation.py) -------------------------------------------------------------------------
def test_creation_with_dynamic_sizes():
    def fn(x):
        n = x.shape[0]
        return (torch.arange(n), torch.arange(n, dtype=torch.float32) * 0.5, torch.arange(n, 2 * n + 3, 2),
                torch.arange(1, n + 1, dtype=torch.float32), torch.zeros(n, 3), torch.full((n, 2), 2.5),
                torch.ones_like(x), torch.empty(n, 4).fill_(1.5), x.new_zeros(n, dtype=torch.int32) + 7,
                torch.full((2,), n), torch.full((n,), n - 1, dtype=torch.float16))

    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(n, 4)]), dyn(0))


# --- pointwise (elementwise.py) ---------------------------------------------------------------------
def test_pointwise_broadcasting_where_and_comparisons():
    def fn(x, y, bias):
        return (x + y, torch.where(x > y, x, y * 2), (x >= 0) & (y < 0.5), torch.clamp(x, -0.5, 0.7),
                torch.minimum(x, bias),
                (x * bias).relu().to(torch.float16), torch.maximum(x, bias), x.masked_fill(x < 0, -1.0))

    b, s = Dim("b", max=3), Dim("s", max=BOUND)
    sizes = [(2, 5), (1, 1), (3, BOUND), (2, 7)]
    args = [(torch.randn(bb, ss, 4), torch.randn(1, ss, 4), torch.randn(4)) for bb, ss in sizes]
    check_dynamic(Fn(fn), args, {"args": ({0: b, 1: s}, {1: s}, None)})


def test_pointwise_with_a_size_as_scalar_operand():
    # x * x.shape[0] and the like: the size is an integer argument evaluated per call; next to a
    # matmul it is not fused into the epilogue (which takes constant scalars only)
    def fn(x, i):
        n = x.shape[0]
        return (x * n, x / n, x + (n - 1), torch.clamp(i, max=n - 1), torch.where(i > 0, i, n), i * n,
                (x @ x.t()) * n + 1)

    rows = Dim("n", max=BOUND)
    check_dynamic(Fn(fn), calls(lambda n: [torch.randn(n, 3), torch.randint(-20, 20, (n, 3))]),
                  {"args": ({0: rows}, {0: rows})})


def test_what_no_size_of_the_range_decides_stays_on_the_host_with_the_reason():
    import tritondelegate as td

    fn = lambda x: (torch.var(x, 0, correction=0.5), x.sum(0))  # noqa: E731
    ep = torch.export.export(Fn(fn), (torch.randn(5, 3),), dynamic_shapes=dyn(0))
    lowered = td.lower(ep)
    host = {op: why for _, op, why in lowered.reports["forward"].nodes.host}
    assert set(host) == {"aten.var.correction"}
    assert "non-integer correction 0.5 over a dynamic count" in host["aten.var.correction"]
    method = lowered.load().load_method("forward")
    for n in (1, 9):
        x = torch.randn(n, 3)
        for r, e in zip(method(x), fn(x)):
            torch.testing.assert_close(r, e, atol=1e-4, rtol=1e-4, equal_nan=True)
