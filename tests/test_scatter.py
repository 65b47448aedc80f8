"""Scatter-family kernels (kernels/scatter.py): index_put, index_copy, scatter, scatter_add,
slice_scatter, select_scatter and copy against eager, functional and in place (``td_inplace``) with
the delegate output aliased to the updated input."""

import math

import pytest
import torch

from harness import (FLOAT_DTYPES, Buffered, Fn, check_dynamic, check_model, check_state_updates, export_decomposed,
                     lower_resident, plan_launches, run_delegated)
from tritondelegate.backend import build_plan
from tritondelegate.dtypes import parse_dtype
from tritondelegate.kernels import registry
from tritondelegate.plan import Base, KernelArgKind

aten = torch.ops.aten
# Each supported data dtype once, each index dtype twice.
DTYPE_PAIRS = [(torch.float32, torch.int64), (torch.float16, torch.int32), (torch.bfloat16, torch.int64),
               (torch.int64, torch.int32)]


def _data(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-100, 100, shape, dtype=dtype)


def _distinct(n, size, dtype=torch.int64):
    """``n`` distinct positions in [0, size): no two writes land on one element."""
    return torch.randperm(size)[:n].to(dtype)


def kernels(plan):
    return [launch.kernel for launch in plan.launches]


# --- index_put ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,index_dtype", DTYPE_PAIRS)
def test_index_put_kv_cache(dtype, index_dtype):
    # cache [b, h, S, d] updated at positions [None, None, pos]: prefill (3 positions, one negative)
    # and decode (1 position)
    cache, v3, v1 = _data((2, 3, 17, 5), dtype), _data((2, 3, 3, 5), dtype), _data((2, 3, 1, 5), dtype)
    pos3, pos1 = torch.tensor([4, -1, 0], dtype=index_dtype), torch.tensor([9], dtype=index_dtype)
    fn = Fn(lambda c, p3, v3, p1, v1: (aten.index_put(c, [None, None, p3], v3),
                                         aten.index_put(c, [None, None, p1], v1)))
    _, plan = check_model(fn, (cache, pos3, v3, pos1, v1))
    assert kernels(plan) == ["pointwise", "scatter"] * 2


X = (5, 6, 7, 4)
# name -> (indices for an [5, 6, 7, 4] tensor, shape of the values)
LAYOUTS = {
    "first_dim": (lambda: [_distinct(3, 5)], (3, 6, 7, 4)),
    "last_dim_values_broadcast": (lambda: [None, None, None, _distinct(2, 4)], (7, 1)),
    "two_adjacent_broadcast": (lambda: [None, _distinct(4, 6)[:, None], _distinct(3, 7)[None, :]],
                               (5, 4, 3, 4)),
    "two_separate": (lambda: [_distinct(3, 5), None, _distinct(3, 7)], (3, 6, 4)),  # broadcast dims first
    "three_broadcast": (lambda: [_distinct(2, 5)[:, None], _distinct(3, 6)[None, :], torch.tensor([-2])],
                        (2, 3, 4)),
    "negative": (lambda: [None, -1 - _distinct(4, 6)], (4, 7, 4)),
    "scalar_values": (lambda: [None, _distinct(2, 6), None, torch.tensor([3, -1])], ()),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_index_put_layouts(layout):
    make, values_shape = LAYOUTS[layout]
    indices = make()
    tensors = [i for i in indices if i is not None]
    fn = Fn(lambda x, v, *idx: aten.index_put(x, _fill(indices, idx), v))
    check_model(fn, (torch.randn(X), torch.randn(values_shape), *tensors))


def _fill(pattern, tensors):
    """``pattern`` (tensors and None) with its tensors replaced by ``tensors``, in order."""
    it = iter(tensors)
    return [None if p is None else next(it) for p in pattern]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64,))
def test_index_put_accumulate_duplicates(dtype):
    # Duplicate positions add up (atomics); fp16/bf16 accumulate in an fp32 copy, judged against fp32.
    x, v = _data((4, 9, 5), dtype), _data((6, 4, 5), dtype)
    rows, cols = torch.tensor([1, 3, 1, 1, -8, 0]), torch.tensor([2, 0, 2, 2, 2, 1])
    fn = Fn(lambda x, v, i, j: (aten.index_put(x, [None, i], v.transpose(0, 1), True),
                                aten.index_put(x, [j[:4], i[:4]], v[:4, 0], True)))  # two indices
    if dtype in (torch.float16, torch.bfloat16):
        reference = (fn, (x.float(), v.float(), rows, cols))
        _, plan = check_model(fn, (x, v, rows, cols), reference_args=reference)
        # self -> fp32 copy, scatter there, cast back into the output
        assert kernels(plan) == ["pointwise", "scatter", "pointwise"] * 2
    else:
        _, plan = check_model(fn, (x, v, rows, cols))
        assert kernels(plan) == ["pointwise", "scatter"] * 2
    accumulating = [launch for launch in plan.launches if launch.kernel == "scatter"]
    assert all(launch.constexprs["ACCUMULATE"].value for launch in accumulating)


def test_index_put_out_of_range_index_writes_nothing():
    # An out-of-range index (an error in eager) is skipped: nothing outside the tensor is written.
    x, v = torch.randn(3, 17, 5), torch.randn(3, 2, 5)
    fn = Fn(lambda x, p, v: aten.index_put(x, [None, p], v))
    (out,), _ = run_delegated(fn, (x, torch.tensor([2, 17]), v))
    expected = aten.index_put(x, [None, torch.tensor([2])], v[:, :1])
    assert torch.equal(out, expected)


# --- index_copy, scatter, scatter_add -------------------------------------------------------------
KEEP = (aten.index_copy.default, aten.select_scatter.default)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64,))
def test_index_copy(dtype):  # eager takes int64 indices only, and no negative ones
    x, src = _data((5, 7, 3), dtype), _data((5, 4, 3), dtype)
    idx, last, whole = _distinct(4, 7), _distinct(3, 3), _data((5, 7, 3), dtype)
    fn = Fn(lambda x, i, j, s, w: (x.index_copy(1, i, s),
                                   x.transpose(1, 2).index_copy(2, i, s.transpose(1, 2)), x.index_copy(-1, j, w)))
    _, plan = check_model(fn, (x, idx, last, src, whole), keep=KEEP)
    assert kernels(plan).count("scatter") == 3


def _scatter_index(shape, size, dim):
    """A scatter index of ``shape`` whose entries along ``dim`` are distinct, in [0, size)."""
    perm = torch.argsort(torch.rand(*shape[:dim], size, *shape[dim + 1:]), dim=dim)
    return perm.narrow(dim, 0, shape[dim])


@pytest.mark.parametrize("dtype,index_dtype", DTYPE_PAIRS)
def test_scatter_src_and_value(dtype, index_dtype):
    x, src = _data((4, 9, 5), dtype), _data((5, 6, 5), dtype)  # src larger than the index, as allowed
    idx = _scatter_index((3, 4, 5), 9, 1).to(index_dtype)
    first = _scatter_index((5, 4, 3), 5, 0).to(index_dtype)  # for the permuted [5, 9, 4] view
    fn = Fn(lambda x, i, j, s: (x.scatter(1, i, s), x.scatter(1, i, 3),
                                x.permute(2, 1, 0).scatter(0, j, s.permute(2, 1, 0))))
    _, plan = check_model(fn, (x, idx, first, src))
    scalar = [launch.constexprs["SRC_SCALAR"].value for launch in plan.launches if launch.kernel == "scatter"]
    assert scalar == [False, True, False]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64,))
def test_scatter_add(dtype):
    x, src = _data((4, 9, 5), dtype), _data((4, 11, 5), dtype)
    idx = torch.randint(0, 9, (4, 11, 5))  # duplicates along dim 1
    fn = Fn(lambda x, i, s: x.scatter_add(1, i, s))
    reference = (fn, (x.float(), idx, src.float())) if dtype in (torch.float16, torch.bfloat16) else None
    check_model(fn, (x, idx, src), reference_args=reference)


# --- slice_scatter, select_scatter, copy ----------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.int64,))
def test_slice_select_scatter_and_copy(dtype):
    x, s = _data((5, 17, 3), dtype), _data((5, 4, 3), dtype)
    fn = Fn(lambda x, s: (x.slice_scatter(s, 1, 3, 7), x.slice_scatter(s, 1, 2, 17, 4),
                          x.select_scatter(s[:, 1], 1, -2),
                          aten.copy(x, s[:, :1]), aten.copy(x, s[:, :1].float())))  # broadcast, cast
    _, plan = check_model(fn, (x, s), keep=KEEP)
    assert set(kernels(plan)) <= {"pointwise", "pointwise_chain"}  # copies, a cast fused into one


# --- refusals -------------------------------------------------------------------------------------
def test_refusals_have_reasons():
    x, v = torch.randn(4, 9, 5), torch.randn(4, 9, 5)
    i = torch.randint(0, 9, (4, 9, 5))

    def fn(b, x, v, i):
        b[x > 0] = 1.0  # a boolean mask
        return (x.scatter(1, i, v, reduce="add"), x.scatter_reduce(1, i, v, "amax"),
                aten.index_put(x > 0, [None, i[0, :, 0]], v[:, :9] > 0, True))  # accumulating bools

    ep = export_decomposed(Buffered(fn, torch.randn(4, 9, 5)), (x, v, i))
    reasons = {}
    for n in ep.graph_module.graph.nodes:
        spec = registry.lookup(n.target) if n.op == "call_function" else None
        if spec is not None:
            reasons.setdefault(n.target, []).append(spec.support(n))
    mask, accumulate_bool = reasons[aten.index_put.default]
    assert "boolean mask" in mask
    assert accumulate_bool.startswith("accumulating: the result has dtype torch.bool")
    assert "reduce='add' is not supported" in reasons[aten.scatter.reduce][0]
    assert "reduce='amax' is not supported" in reasons[aten.scatter_reduce.two][0]


# --- in place: the update writes the state buffer, the output aliases it --------------------------
def _copies_out(plan, input_position):
    """Launches that copy the whole of delegate input ``input_position`` into an output buffer."""
    def whole(d):
        nbytes = math.prod(d.shape) * parse_dtype(d.dtype).itemsize
        return d.base == Base.INPUT and d.index == input_position and nbytes == plan.input_nbytes[input_position]

    found = []
    for launch in plan.launches:
        descs = [plan.tensors[a.value] for a in launch.args if a.kind == KernelArgKind.TENSOR]
        op = launch.constexprs["OP"].value if launch.kernel == "pointwise" else None
        if op == "copy" and descs[0].base == Base.OUTPUT and whole(descs[1]):
            found.append(launch)
    return found


def _check_aliased(run):
    """Each in-place-updated buffer's output aliases its input: no output buffer, no copy out."""
    assert run.aliases == run.expected_aliases and run.aliases
    assert len(run.plan.output_nbytes) == run.num_outputs - len(run.aliases)
    for position in run.aliases.values():
        assert not _copies_out(run.plan, position)


def _kv_update(cache, pos, v):
    cache[:, :, pos] = v
    return cache.sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_kv_cache_index_put(dtype):
    # Two calls (prefill 2 positions, then 2 more): the second sees the first's update in the buffer.
    calls = [(torch.tensor([0, 1]), _data((1, 3, 2, 5), dtype)), (torch.tensor([2, -1]), _data((1, 3, 2, 5), dtype))]
    cache = _data((1, 3, 17, 5), dtype)
    put = {aten.index_put.default}
    run = check_state_updates(Buffered(_kv_update, cache), calls, in_place=put, dtype=dtype)
    _check_aliased(run)
    assert kernels(run.plan) == ["scatter", "reduce"]  # no copy of the cache, before or after
    # Without aliases the same in-place plan copies the updated cache out (today's contract).
    run = check_state_updates(Buffered(_kv_update, cache), calls, in_place=put, aliases=False, dtype=dtype)
    assert run.aliases is None and _copies_out(run.plan, 0)


def test_in_place_accumulate_half():
    # bf16 accumulation in place: cache -> fp32 copy, atomics there, cast back into the cache.
    def fn(buf, i, v):
        aten.index_put_(buf, [None, None, i], v, True)
        return buf * 2

    calls = [(torch.tensor([1, 1, -1]), torch.randn(3, 5).bfloat16())]  # values broadcast
    model = Buffered(fn, torch.randn(1, 3, 17, 5).bfloat16())
    run = check_state_updates(model, calls, in_place={aten.index_put.default}, dtype=torch.bfloat16)
    _check_aliased(run)
    assert kernels(run.plan) == ["pointwise", "scatter", "pointwise", "pointwise"]


def test_in_place_index_copy_and_scatter():
    def fn(buf, pos, v, idx, src):
        buf.index_copy_(2, pos, v)
        buf.scatter_(3, idx, src)
        return buf[:, :, :4] + 1

    idx = _scatter_index((1, 3, 17, 2), 5, 3)
    calls = [(torch.tensor([3, 16]), torch.randn(1, 3, 2, 5), idx, torch.randn(1, 3, 17, 2))]
    run = check_state_updates(Buffered(fn, torch.randn(1, 3, 17, 5)), calls, keep=KEEP,
                              in_place={aten.index_copy.default, aten.scatter.src})
    # Only the last update is written back: the pass would mark that one; here both write in place.
    _check_aliased(run)
    assert kernels(run.plan)[:2] == ["scatter", "scatter"]


@pytest.mark.parametrize("marked", ["slice_scatter", "copy_and_slice_scatter"])
def test_in_place_slice_copy(marked):
    # buf[:, :, 3:5] = v exports as copy(slice(buf), v) -> slice_scatter(buf, copy): one copy launch
    # either way, into the slice of the buffer.
    def fn(buf, v):
        buf[:, :, 3:5] = v
        return buf.sum(-1)

    in_place = {aten.slice_scatter.default} | ({aten.copy.default} if marked != "slice_scatter" else set())
    calls = [(torch.randn(1, 3, 2, 5).half(),), (torch.randn(1, 3, 2, 5).half(),)]  # cast to fp32 on the way
    run = check_state_updates(Buffered(fn, torch.randn(1, 3, 17, 5)), calls, in_place=in_place)
    _check_aliased(run)
    assert kernels(run.plan)[0] in ("pointwise", "pointwise_chain") and kernels(run.plan)[1] == "reduce"


def test_untouched_passthrough_input_is_copied_not_aliased():
    x = torch.randn(3, 5)
    ep = export_decomposed(Fn(lambda x: (x, x + 1)), (x,))
    graph = ep.graph_module.graph
    aliases = {}
    plan = build_plan([n for n in graph.nodes if n.op == "call_function"],
                      [n for n in graph.nodes if n.op == "placeholder"],
                      list(next(n for n in graph.nodes if n.op == "output").args[0]), aliases=aliases)
    assert aliases == {} and len(plan.output_nbytes) == 2 and _copies_out(plan, 0)


# --- pairs: a layer's k and v cache writes in one launch (fusion.pair_scatters) --------------------
class KVPair(torch.nn.Module):
    """Two caches updated at the same positions: k from a [b, h, s, d] tensor, v from a [b, s, h, d]
    one (a projection's layout), through ``index_put`` (``cache[:, :, pos] = x``) or ``index_copy_``.
    ``between`` reads the k cache between the two writes; ``other`` writes v at other positions."""

    def __init__(self, dtype, how="index_put", between=False, other=False):
        super().__init__()
        self.register_buffer("k", _data((1, 3, 17, 5), dtype))
        self.register_buffer("v", _data((1, 3, 17, 5), dtype))
        self.how, self.between, self.other = how, between, other

    def forward(self, pos, k, v, pos2=None):
        v, vpos = v.transpose(1, 2), pos2 if self.other else pos
        if self.how == "index_put":
            self.k[:, :, pos] = k
            seen = self.k.sum(-1) if self.between else None
            self.v[:, :, vpos] = v
        else:
            self.k.index_copy_(2, pos, k)
            seen = self.k.sum(-1) if self.between else None
            self.v.index_copy_(2, vpos, v)
        out = self.k[:, :, :4] * 2 + self.v[:, :, :4]
        return out if seen is None else (out, seen)


def _pair_calls(dtype):
    return [(torch.tensor(p), _data((1, 3, 2, 5), dtype), _data((1, 2, 3, 5), dtype), torch.tensor(q))
            for p, q in (([0, 1], [5, 6]), ([2, 16], [3, 4]))]


def _scatters(plan):
    return [launch for launch in plan.launches if launch.kernel == "scatter"]


@pytest.mark.parametrize("how", ["index_put", "index_copy"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_kv_pair_in_one_launch(dtype, how):
    in_place = {aten.index_put.default, aten.index_copy.default}
    run = check_state_updates(KVPair(dtype, how), _pair_calls(dtype), in_place=in_place, keep=KEEP, dtype=dtype)
    _check_aliased(run)
    (pair,) = _scatters(run.plan)
    assert pair.constexprs["PAIR"].value and pair.grid[1] == 2 and "+" in pair.op


@pytest.mark.parametrize("case", ["read_between", "other_positions"])
def test_kv_writes_that_must_not_pair(case):
    model = KVPair(torch.float32, between=case == "read_between", other=case == "other_positions")
    run = check_state_updates(model, _pair_calls(torch.float32), in_place={aten.index_put.default})
    scatters = _scatters(run.plan)
    assert len(scatters) == 2 and not any(s.constexprs.get("PAIR") for s in scatters)


def test_kv_pair_with_a_dynamic_prompt_length():
    # Prompts of 1..9 positions through one program (a symbolic grid), the state carried call to call.
    seq = torch.export.Dim("seq", min=1, max=9)
    model = KVPair(torch.float32)
    calls = [(torch.arange(n) + start, _data((1, 3, n, 5), torch.float32), _data((1, n, 3, 5), torch.float32))
             for n, start in ((3, 0), (9, 3), (1, 16))]
    lowered, _ = check_dynamic(model, calls, {"pos": {0: seq}, "k": {2: seq}, "v": {1: seq}})
    (method,) = lowered.program.methods
    (pair,) = _scatters(method.delegates[0].plan)
    assert pair.constexprs["PAIR"].value and pair.grid[1] == 2


def test_an_index_put_into_an_empty_tensor_copies_nothing():
    """A Mixture-of-Experts router's inverse order: ``empty_like(perm).index_put_((perm,), arange)``.
    The empty tensor's contents are undefined, so neither folded into a constant nor copied: one
    scatter launch (arange is folded)."""
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    fn = lambda p: torch.empty_like(p).index_put_((p,), torch.arange(11))  # noqa: E731
    lowered = lower_resident(Fn(fn), (perm,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["scatter"]
    assert lowered.reports["forward"].folded == ["arange"]
    torch.testing.assert_close(lowered.load().load_method()(perm), torch.argsort(perm))
