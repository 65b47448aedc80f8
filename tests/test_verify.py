"""The load-time plan verifier (``runtime/verify.py``): a program whose launch plans or memory plan are
damaged (with every checksum valid) is refused with a ProgramError naming the method, delegate, launch,
kernel and value before anything runs; an undamaged program loads."""

from __future__ import annotations

import copy
import itertools
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import tritondelegate as td
from tritondelegate.kernels.table import KERNELS
from tritondelegate.plan import Arg, KernelArgKind, Base
from tritondelegate.program import InstrKind
from tritondelegate.runtime.loader import InMemorySource, LoadedProgram
from tritondelegate.runtime.footprints import RULES, _unravel, kernel_parameters
from tritondelegate.runtime.verify import _first_overlap
from tritondelegate.symbolic import Expr

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class Zoo(torch.nn.Module):
    """One delegate over most kernel families: gather, norm, matmul, attention, softmax, cumsum, conv
    with an epilogue and a max pooling, batch norm, an average pooling, padding, a pointwise chain, a
    norm with a prologue, a reduction with an epilogue, a scatter, a top-k, a histogram, a router's top-k
    of a softmax, a cat of two parts, a bilinear resize, a grid sample, an embedding bag, a cdist, a
    depthwise conv, a depthwise conv in a 1x1 conv's launch, a cummax and a group norm with its SiLU."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(2)
        self.bag = torch.nn.EmbeddingBag(10, 8, mode="mean")
        self.dw = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.separable = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3, padding=1, groups=2), torch.nn.ReLU6(),
                                             torch.nn.Conv2d(2, 3, 1))
        self.gn = torch.nn.GroupNorm(2, 4)

    def forward(self, ids, img):
        h = self.fc(self.ln(self.emb(ids)))[None]
        s = torch.softmax(F.scaled_dot_product_attention(h, h, h, is_causal=True) * 2.0, -1)
        y = F.max_pool2d(torch.relu(self.conv(img)), 2)
        # a batch norm of computed statistics (constant ones become a scale and shift per channel)
        normed = F.batch_norm(img, img.mean((0, 2, 3)), img.var((0, 2, 3)), self.bn.weight, self.bn.bias)
        p = F.layer_norm(torch.sigmoid(F.pad(normed, (1, 1))) * 3.0 + 1.0, (8,))
        z = torch.zeros(6, 8).index_copy(0, ids[:2], h[0, :2])
        # p's chain is the norm's prologue, amax's chain its epilogue; p.exp() * 0.5 a chain of its own
        return (s, torch.cumsum(ids, 0), y, p, s.amax(-1) * 2.0 - 1.0, z, *torch.topk(s[0], 3),
                torch.histc(p, 5, -1, 1), *torch.topk(torch.softmax(h[0], -1), 2), p.exp() * 0.5,
                torch.cat((h[0], s[0]), -1), F.interpolate(y, scale_factor=1.5, mode="bilinear"),
                F.grid_sample(img, torch.tanh(h[:, :3, :4].reshape(1, 3, 2, 2)), align_corners=False),
                self.bag(ids.view(2, 2)), torch.cdist(h[0], s[0]), self.dw(y), *torch.cummax(p, -1),
                F.avg_pool2d(img, 3), self.separable(img), F.silu(self.gn(y)))


def _zoo_args():
    return torch.tensor([1, 3, 5, 7]), torch.randn(1, 2, 6, 6)


@pytest.fixture(scope="module")
def zoo():
    torch.manual_seed(0)
    model = Zoo().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, _zoo_args()), config=RESIDENT)
    return model, lowered


def _load(lowered, program=None, name="forward"):
    source = InMemorySource(program or lowered.program, lowered.constant_data)
    return LoadedProgram(source, devices="simulated").load_method(name)


def _launches(program):
    """(delegate index, launch index, launch) of the first method, in order."""
    return [(d, k, launch) for d, delegate in enumerate(program.methods[0].delegates)
            for k, launch in enumerate(delegate.plan.launches)]


def _arg(launch, name: str) -> int:
    """The position of parameter ``name`` among the launch's arguments."""
    return kernel_parameters(KERNELS[launch.kernel])[0].index(name)


def _refused(lowered, program, match: str):
    with pytest.raises(td.ProgramError, match=match):
        _load(lowered, program)


def test_every_kernel_has_a_footprint_rule_for_its_parameters():
    """A kernel added to the runtime table without a rule (or whose constexprs changed) fails here; at
    load its launches would be refused."""
    assert set(RULES) == set(KERNELS)
    for name, kernel in KERNELS.items():
        runtime, constexprs = kernel_parameters(kernel)
        assert set(RULES[name].constexprs) == set(constexprs), name
        for tile in RULES[name].tiles:
            assert set(tile) <= set(constexprs), name


def test_the_undamaged_program_loads_and_runs(zoo):
    model, lowered = zoo
    assert {launch.kernel for _, _, launch in _launches(lowered.program)} >= {
        "gather", "norm", "matmul", "attention", "softmax", "cumsum", "conv2d", "batch_norm", "pool2d", "pad",
        "pointwise_chain", "reduce", "scatter", "rank", "histc", "router", "resize", "grid_sample",
        "embedding_bag", "cdist", "depthwise_conv", "cumextreme"}
    args = _zoo_args()
    with torch.no_grad():
        expected = model(*args)
    for got, want in zip(_load(lowered)(*args), expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _matmul(program):
    return next((d, k, launch) for d, k, launch in _launches(program) if launch.kernel == "matmul")


def _set_int(name, value):
    def edit(launch):
        launch.args[_arg(launch, name)] = Arg(KernelArgKind.INT, value)
    return edit


def _set_grid(*grid):
    def edit(launch):
        launch.grid = grid
    return edit


def _set_constexpr(name, value):
    def edit(launch):
        launch.constexprs[name] = Arg.of(value)
    return edit


def _pointer_to_int(launch):
    launch.args[_arg(launch, "a_ptr")] = Arg(KernelArgKind.INT, 0)


def _float_size(launch):
    launch.args[_arg(launch, "M")] = Arg(KernelArgKind.FLOAT, 4.0)


def _rename(launch):
    launch.kernel = "matmul_v2"


MATMUL_DAMAGE = [
    ("stride 8 -> 100000", _set_int("stride_am", 100000), r"argument 'a_ptr' reaches elements \[0, 300007\]"),
    ("M 4 -> 64", _set_int("M", 64), r"argument 'a_ptr' reaches elements \[0, 511\] .* spans 32 elements"),
    ("N 8 -> 0", _set_int("N", 0), "argument 'N' is 0; the kernel divides by it"),
    ("negative stride", _set_int("stride_bn", -1), r"argument 'b_ptr' reaches elements \[-7, 7\]"),
    ("grid x too big", _set_grid(1000, 1), "grid axis 0 has 1000 programs, but the launch's sizes need 1"),
    ("grid y 70000", _set_grid(1, 70000), r"grid \[1, 70000\] must have 1 to 3 axes"),
    ("grid x 2**31", _set_grid(2**31, 1), r"grid \[2147483648, 1\]"),
    ("grid y past the batch", _set_grid(1, 2), r"argument 'c_ptr' reaches elements \[0, 63\]"),
    ("block not a power of two", _set_constexpr("BLOCK_M", 24), "constexpr BLOCK_M=24 is not allowed"),
    ("block too small for tl.dot", _set_constexpr("BLOCK_K", 8), "constexpr BLOCK_K=8 is not allowed"),
    ("unknown epilogue op", _set_constexpr("EOP0", "system"), "constexpr EOP0='system' is not allowed"),
    ("flag not a bool", _set_constexpr("HAS_BIAS", 2), "constexpr HAS_BIAS=2 is not allowed"),
    ("unknown constexpr", _set_constexpr("EVIL", 1), "'EVIL' is not a constexpr or launch option"),
    ("bad launch option", _set_constexpr("num_warps", 3), "constexpr num_warps=3 is not allowed"),
    ("pointer turned into an int", _pointer_to_int, "argument 'a_ptr' is passed as INT; the kernel takes a tensor"),
    ("size turned into a float", _float_size, "argument 'M' must be an integer"),
    ("unknown kernel", _rename, "this runtime has no kernel 'matmul_v2' with a footprint rule"),
]


@pytest.mark.parametrize("edit, match", [d[1:] for d in MATMUL_DAMAGE], ids=[d[0] for d in MATMUL_DAMAGE])
def test_damaged_launch_is_refused_naming_it(zoo, edit, match):
    _, lowered = zoo
    program = copy.deepcopy(lowered.program)
    d, k, launch = _matmul(program)
    edit(launch)
    kernel = "matmul_v2" if edit is _rename else "matmul"
    _refused(lowered, program, rf"method 'forward' delegate {d} \('triton_0'\) launch {k} \('{kernel}', "
                               rf"node '[^']+'\): .*{match}")


def test_a_kernel_that_writes_a_constant_is_refused(zoo):
    """The matmul's result redirected onto the embedding table (a resident constant, big enough)."""
    _, lowered = zoo
    program = copy.deepcopy(lowered.program)
    method = program.methods[0]
    instr = _call(method)
    table = instr.inputs.index(_values(method, name="emb.weight")[0])
    plan = method.delegates[instr.delegate].plan
    _, k, launch = _matmul(program)
    c = plan.tensors[launch.args[_arg(launch, "c_ptr")].value]
    c.base, c.index, c.byte_offset = Base.INPUT, table, 0
    _refused(lowered, program, rf"launch {k} \('matmul'.*argument 'c_ptr' writes .*input {table}: value "
                               r"'emb.weight'\), a delegate input that is not program state")


# The main size of each kernel family: a million times larger is always refused (its index range leaves
# its views, or is larger than any view the launch touches).
SIZES = {"pointwise": "n", "pointwise_chain": "n", "matmul": "M", "conv2d": "M", "attention": "Lq",
         "reduce": "rows", "softmax": "rows", "norm": "rows", "gather": "n", "scatter": "n", "cumsum": "rows",
         "pool2d": "total", "batch_norm": "numel", "pad": "total", "arange": "n", "rotary": "rows",
         "grouped_mm": "S", "attention_combine": "S", "attention_append": "Lq", "rank": "length", "histc": "n",
         "router": "length", "group_router": "length", "sort_offsets": "n", "cat": "n", "resize": "total",
         "grid_sample": "total", "depthwise_conv": "M", "embedding_bag": "n_bags", "cdist": "P",
         "cumextreme": "rows", "dequant_rows": "R", "conv1x1": "M", "norm_apply": "rows"}


def test_each_kernel_family_bounds_its_grid_and_its_sizes(zoo):
    _, lowered = zoo
    assert set(SIZES) == set(RULES)
    for d, k, launch in _launches(lowered.program):
        where = rf"delegate {d} \('triton_0'\) launch {k} \('{launch.kernel}'"
        program = copy.deepcopy(lowered.program)
        program.methods[0].delegates[d].plan.launches[k].grid = (2 * launch.grid[0] + 1, *launch.grid[1:])
        _refused(lowered, program, rf"{where}.*grid axis 0 has {2 * launch.grid[0] + 1} programs")
        program = copy.deepcopy(lowered.program)
        damaged = program.methods[0].delegates[d].plan.launches[k]
        size = _arg(damaged, SIZES[launch.kernel])
        damaged.args[size] = Arg(KernelArgKind.INT, damaged.args[size].value * 10**6)
        _refused(lowered, program, where)


def test_split_attention_launches_are_bounded():
    """Flash-decoding's two launches: more key splits than the keys need, no keys per split, partials
    the attention launch would write past, or more splits than the combine reads are each refused."""
    class Decode(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    args = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16))
    lowered = td.lower(torch.export.export(Decode(), args), config=RESIDENT)
    assert [launch.kernel for _, _, launch in _launches(lowered.program)] == ["attention", "attention_combine"]
    torch.testing.assert_close(_load(lowered)(*args), Decode()(*args), atol=1e-5, rtol=1e-5)
    where = r"delegate 0 \('triton_0'\) launch"
    program = copy.deepcopy(lowered.program)
    attn = program.methods[0].delegates[0].plan.launches[0]
    attn.grid = (*attn.grid[:2], attn.grid[2] + 1)
    _refused(lowered, program, rf"{where} 0 \('attention'.*grid axis 2 has")
    program = copy.deepcopy(lowered.program)
    plan = program.methods[0].delegates[0].plan
    split_n = _arg(plan.launches[0], "split_n")
    plan.launches[0].args[split_n] = Arg(KernelArgKind.INT, 0)
    _refused(lowered, program, rf"{where} 0 \('attention'.*argument .split_n. is 0")
    program = copy.deepcopy(lowered.program)
    plan = program.methods[0].delegates[0].plan
    lq = _arg(plan.launches[0], "Lq")
    plan.launches[0].args[lq] = Arg(KernelArgKind.INT, 2)  # two queries per head: past q and the partials
    _refused(lowered, program, rf"{where} 0 \('attention'.*argument '(q|part)_ptr' reaches")
    program = copy.deepcopy(lowered.program)
    combine = program.methods[0].delegates[0].plan.launches[1]
    s = _arg(combine, "S")
    combine.args[s] = Arg(KernelArgKind.INT, combine.args[s].value + 1)
    _refused(lowered, program, rf"{where} 1 \('attention_combine'.*S=3 splits do not fit BLOCK_S=2")
    _set_constexpr("BLOCK_S", 4)(combine)
    _refused(lowered, program, rf"{where} 1 \('attention_combine'.*'part_ptr' reaches")


# -- the memory plan --------------------------------------------------------------------------------
def _values(method, **where):
    return [vid for vid, v in enumerate(method.values) if all(getattr(v, k) == x for k, x in where.items())]


def _call(method):
    (call,) = [i for i in method.instructions if i.kind == InstrKind.DELEGATE]
    return call


def _input_copy(method):
    """The arena value the first user input is copied into."""
    (copy_instr,) = [i for i in method.instructions
                     if i.kind == InstrKind.COPY_H2D and i.inputs == [method.inputs[0]]]
    return copy_instr.outputs[0]


def _nbytes(method):
    method.values[_input_copy(method)].nbytes += 4
    return r"value \d+ \('ids@cuda:0'\) records 36 bytes, but int64\[4\] has 32"


def _misaligned(method):
    method.values[_input_copy(method)].arena_offset += 8
    return r"value \d+ \('ids@cuda:0'\): bytes \[\d+, \d+\) on cuda:0 do not fit arena 0 .*aligned to 256"


def _overlap(method):
    """The input's copy moved onto the delegate's first output: both are live during the delegate call."""
    vid, out = _input_copy(method), _call(method).outputs[0]
    method.values[vid].arena_offset = method.values[out].arena_offset
    names = r"(ids@cuda:0|triton_0.out0)"
    return rf"arena 0: value \d+ \('{names}'\) and value \d+ \('{names}'\) are live together"


def _scratch_over_a_value(method):
    """The delegate's scratch moved onto one of its outputs (with room for it in the arena)."""
    (delegate,) = method.delegates
    room = method.arenas[0].nbytes - delegate.plan.scratch_bytes
    out = next(vid for vid in _call(method).outputs if method.values[vid].arena_offset <= room)
    delegate.scratch_offset = method.values[out].arena_offset
    return rf"arena 0: .*(delegate 0 scratch|value {out}).* are live together and share bytes"


def _input_over_a_constant(method):
    """The input's device copy placed in the embedding table's program slot."""
    vid = _input_copy(method)
    (table,) = _values(method, name="emb.weight")
    method.values[vid].slot, method.values[vid].arena = method.values[table].slot, -1
    return r"value \d+ \('ids@cuda:0'\) is an intermediate with arena -1, slot \d+"


def _input_with_a_slot(method):
    (table,) = _values(method, name="emb.weight")
    method.values[method.inputs[0]].slot = method.values[table].slot
    return r"value \d+ \('ids'\) is an input with arena -1, slot"


def _constant_written(method):
    _call(method).outputs[0] = _values(method, name="ln.bias")[0]
    return r"instruction \d+ \('triton_0'\) writes value \d+ \('ln.bias'\), a constant"


def _constant_in_an_arena(method):
    (bias,) = _values(method, name="ln.bias")
    method.values[bias].arena = 0
    return r"value \d+ \('ln.bias'\) is a constant with arena 0"


def _device_constant_not_resident(method):
    (bias,) = _values(method, name="ln.bias")
    method.values[bias].resident, method.values[bias].slot = False, -1
    return r"value \d+ \('ln.bias'\): a constant on cuda:0 must be resident"


def _huge_arena(method):
    method.arenas[0].nbytes = 2**40
    return r"arena 0 has 1099511627776 bytes, more than the \d+ its values use"


def _copy_shapes(method):
    vid = _input_copy(method)
    method.values[vid].shape, method.values[vid].nbytes = (2,), 16
    return (r"instruction \d+ \('ids@cuda:0'\): a COPY_H2D copy from 'ids' \(cpu, int64\[4\]\) to 'ids@cuda:0' "
            r"\(cuda:0, int64\[2\]\)")


MEMORY_DAMAGE = [_nbytes, _misaligned, _overlap, _scratch_over_a_value, _input_over_a_constant, _input_with_a_slot,
                 _constant_written, _constant_in_an_arena, _device_constant_not_resident, _huge_arena, _copy_shapes]


@pytest.mark.parametrize("damage", MEMORY_DAMAGE, ids=[d.__name__.strip("_") for d in MEMORY_DAMAGE])
def test_damaged_memory_plan_is_refused(zoo, damage):
    _, lowered = zoo
    program = copy.deepcopy(lowered.program)
    match = damage(program.methods[0])
    _refused(lowered, program, rf"method 'forward' {match}")


# -- bounded dynamic dimensions: every size is verified ----------------------------------------------
@pytest.fixture(scope="module")
def dynamic():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    ep = torch.export.export(model, (torch.randn(5, 8),), dynamic_shapes=({0: Dim("batch", max=9)},))
    return model, td.lower(ep, config=RESIDENT)


def _dynamic_m(program):
    _, _, launch = _matmul(program)
    position = _arg(launch, "M")
    m = launch.args[position].value
    assert isinstance(m, Expr)
    return launch, position, m


def test_dynamic_plan_damaged_at_its_bound_is_refused_at_load(dynamic):
    _, lowered = dynamic
    program = copy.deepcopy(lowered.program)
    launch, position, m = _dynamic_m(program)
    launch.args[position] = Arg(KernelArgKind.INT, Expr(f"{m.text} + 1", m.bound + 1))
    _refused(lowered, program, r"launch 0 \('matmul'.* argument 'a_ptr' reaches elements \[0, 79\] .* spans 72")


def test_dynamic_plan_damaged_below_its_bound_is_refused_at_that_size(dynamic):
    """``max(M, 9)`` rows: right at the bound (9), past the views at every smaller size. The method
    loads; a call at the bound runs; a call at another size is refused before any launch at it."""
    model, lowered = dynamic
    program = copy.deepcopy(lowered.program)
    launch, position, m = _dynamic_m(program)
    launch.args[position] = Arg(KernelArgKind.INT, Expr(f"max({m.text}, {m.bound})", m.bound))
    method = _load(lowered, program)
    x = torch.randn(9, 8)
    with torch.no_grad():
        torch.testing.assert_close(method(x), model(x))
    with pytest.raises(td.ProgramError, match=r"launch 0 \('matmul'.* argument 'a_ptr' reaches elements \[0, 71\] "
                                              r".* spans 24 elements"):
        method(torch.randn(3, 8))


def test_a_damaged_file_is_refused_when_its_method_loads(zoo, tmp_path):
    _, lowered = zoo
    lowered.save(tmp_path / "zoo.tdp")
    program = td.load(tmp_path / "zoo.tdp", devices="simulated")
    _, k, launch = _matmul(program.program)
    launch.args[_arg(launch, "stride_am")] = Arg(KernelArgKind.INT, 100000)
    with pytest.raises(td.ProgramError, match=rf"launch {k} \('matmul'.*argument 'a_ptr' reaches"):
        program.load_method("forward")


# -- the helpers, against brute force ---------------------------------------------------------------
def test_unravel_counts_every_coordinate_a_flat_range_takes():
    for n, inner in [(0, (3,)), (1, (4, 5)), (7, (1, 3)), (12, (3, 4)), (13, (3, 4)), (5, (8, 2)), (40, (2, 3, 4))]:
        seen = [set() for _ in range(len(inner) + 1)]
        for flat in range(n):
            coords = []
            for d in reversed(inner):
                coords.append(flat % d)
                flat //= d
            for s, c in zip(seen, [flat] + coords[::-1]):
                s.add(c)
        assert _unravel(n, inner) == [len(s) for s in seen], (n, inner)


def test_overlap_sweep_agrees_with_every_pair():
    rng = random.Random(7)
    for _ in range(300):
        items = [(first, first + rng.randrange(4), 8 * rng.randrange(10), rng.randrange(0, 40), f"v{i}")
                 for i, first in enumerate(rng.randrange(10) for _ in range(rng.randrange(1, 9)))]
        pairs = any(a[0] <= b[1] and b[0] <= a[1] and a[3] and b[3] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]
                    for a, b in itertools.combinations(items, 2))
        assert (_first_overlap(items) is not None) == pairs, items


# -- a rotary pair (q and k over the same cos and sin) -----------------------------------------------
def _rotate_half(x):
    return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)


class RotaryPair(torch.nn.Module):
    """q [1, 4, 5, 8] and k [1, 5, 2, 8] read transposed (fewer heads, other strides), one launch."""

    def forward(self, q, k, cos, sin):
        k = k.transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


ROTARY_DAMAGE = [
    ("k rows x 10**6", lambda rows: _set_int("krows", rows * 10**6), r"rows x half is \d+, more than"),
    ("k row stride", lambda rows: _set_int("kxs3", 100000), r"argument 'kx_ptr' reaches"),
    ("k's cos row stride", lambda rows: _set_int("kcs3", 100000), r"argument 'cos_ptr' reaches"),
    ("k's output stride", lambda rows: _set_int("kos3", 100000), r"argument 'kout_ptr' reaches"),
    ("not a pair, the pair's grid", lambda rows: _set_constexpr("PAIR", False), "grid axis 0 has"),
]


def test_a_rotary_pair_loads_and_its_damage_is_refused():
    torch.manual_seed(0)
    args = (torch.randn(1, 4, 5, 8), torch.randn(1, 5, 2, 8), torch.randn(5, 8), torch.randn(5, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(RotaryPair(), args), config=RESIDENT)
    ((d, k, launch),) = [x for x in _launches(lowered.program) if x[2].kernel == "rotary"]
    assert launch.constexprs["PAIR"].value is True
    for got, want in zip(_load(lowered)(*args), RotaryPair()(*args)):
        torch.testing.assert_close(got, want)
    rows = launch.args[_arg(launch, "krows")].value
    where = rf"delegate {d} \('triton_0'\) launch {k} \('rotary'"
    for _, damage, match in ROTARY_DAMAGE:
        program = copy.deepcopy(lowered.program)
        damage(rows)(program.methods[0].delegates[d].plan.launches[k])
        _refused(lowered, program, rf"{where}.*{match}")
    program = copy.deepcopy(lowered.program)
    program.methods[0].delegates[d].plan.launches[k].grid = (launch.grid[0] + 1, *launch.grid[1:])
    _refused(lowered, program, rf"{where}.*grid axis 0 has {launch.grid[0] + 1} programs")


def test_the_pointwise_rule_knows_every_op_the_pointwise_kernels_compute():
    # read from the formula's source: unary ops (in _formula) and the rest (in _binary_formula) alike
    from tritondelegate.kernels import elementwise
    from tritondelegate.runtime.footprints import POINTWISE_OPS

    for op in ("copy", "exp", "gelu_tanh", "logical_not", "add", "mul", "pow", "maximum", "where", "clamp"):
        assert POINTWISE_OPS.test(op), op
    assert not POINTWISE_OPS.test("system") and not POINTWISE_OPS.test(3)
    names = [f for f in dir(elementwise) if f.endswith("formula")]
    assert sorted(names) == ["_binary_formula", "_formula"]  # a new formula function must join the rule


# -- a scatter pair (a layer's k and v cache writes in one launch) ---------------------------------------
class KVWrites(torch.nn.Module):
    """k and v caches written at the same positions, v from another layout: one PAIR scatter launch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 4))
        self.register_buffer("v", torch.zeros(1, 2, 16, 4))

    def forward(self, pos, k, v):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v.transpose(1, 2)
        return self.k[:, :, :6] + self.v[:, :, :6]


SCATTER_PAIR_DAMAGE = [
    ("v's source stride", lambda ints: _set_int("ws3", 100000), r"argument 'src2_ptr' reaches"),
    ("v's cache is a method input", lambda ints: _set_tensor("dst2_ptr", ints["src2_ptr"]),
     r"argument 'dst2_ptr' (reaches|writes)"),
    ("not a pair, the pair's grid", lambda ints: _set_constexpr("PAIR", False), "grid axis 1 has 2 programs"),
    ("a third member", lambda ints: _set_grid(ints["grid"][0], 3), "grid axis 1 has 3 programs"),
]


def _set_tensor(name, index):
    def edit(launch):
        launch.args[_arg(launch, name)] = Arg(KernelArgKind.TENSOR, index)
    return edit


def test_a_scatter_pair_loads_and_its_damage_is_refused():
    torch.manual_seed(0)
    args = (torch.tensor([3, 7]), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    lowered = td.lower(torch.export.export(KVWrites(), args), config=RESIDENT)
    ((d, k, launch),) = [x for x in _launches(lowered.program) if x[2].kernel == "scatter"]
    assert launch.constexprs["PAIR"].value is True and launch.grid[1] == 2
    torch.testing.assert_close(_load(lowered)(*args), KVWrites()(*args))
    ints = {"grid": launch.grid, "src2_ptr": launch.args[_arg(launch, "src2_ptr")].value}
    where = rf"delegate {d} \('triton_0'\) launch {k} \('scatter'"
    for _, damage, match in SCATTER_PAIR_DAMAGE:
        program = copy.deepcopy(lowered.program)
        damage(ints)(program.methods[0].delegates[d].plan.launches[k])
        _refused(lowered, program, rf"{where}.*{match}")


# -- a transposed convolution (weight [C_in, C_out / groups, KH, KW], addressed per group through ws_g) --------
CONV_T_DAMAGE = [
    ("group stride", _set_int("ws_g", 100000), r"argument 'w_ptr' reaches"),
    ("output channel stride", _set_int("ws_o", 100000), r"argument 'w_ptr' reaches"),
    ("a third group", lambda launch: _set_grid(*launch.grid[:2], 3)(launch), r"argument '(x|w|out)_ptr' reaches"),
    ("not a flag", _set_constexpr("TRANSPOSED", 2), "constexpr TRANSPOSED=2 is not allowed"),
    # by stride phase: (2 x 2 phases) x (tiles of the largest phase's rows) programs, padding >= 0
    ("a program past the phases", lambda launch: _set_grid(launch.grid[0] + 1, *launch.grid[1:])(launch),
     "grid axis 0 has"),
    ("negative padding", _set_int("pad_w", -1), "argument 'pad_w' is -1; a PHASED convolution's padding"),
    ("PHASED not a flag", _set_constexpr("PHASED", 2), "constexpr PHASED=2 is not allowed"),
]


def test_a_transposed_convolution_loads_and_its_damage_is_refused():
    torch.manual_seed(0)
    model = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2).eval()
    args = (torch.randn(1, 4, 3, 5),)
    lowered = td.lower(torch.export.export(model, args), config=RESIDENT)
    ((d, k, launch),) = [x for x in _launches(lowered.program) if x[2].kernel == "conv2d"]
    assert launch.constexprs["TRANSPOSED"].value is True and launch.constexprs["PHASED"].value is True
    assert launch.grid[2] == 2
    with torch.no_grad():
        torch.testing.assert_close(_load(lowered)(*args), model(*args))
    _each_damage_refused(lowered, d, k, CONV_T_DAMAGE)


def _each_damage_refused(lowered, d: int, k: int, damages) -> None:
    """Each (name, damage, match) of ``damages`` done to launch ``k`` of delegate ``d`` alone is refused at
    load with a message that names the launch and matches."""
    kernel = lowered.program.methods[0].delegates[d].plan.launches[k].kernel
    where = rf"delegate {d} \('triton_0'\) launch {k} \('{kernel}'"
    for _, damage, match in damages:
        program = copy.deepcopy(lowered.program)
        damage(program.methods[0].delegates[d].plan.launches[k])
        _refused(lowered, program, rf"{where}.*{match}")


# -- a convolution that stores its max pooling (POOL_KH, POOL_KW: rows are pooled pixels) ---------------
POOLED_CONV_DAMAGE = [
    ("a larger convolution output", _set_int("OH", 10**6), r"argument 'e0_ptr' reaches"),
    ("a pooled output stride", _set_int("os_h", 10**6), r"argument 'out_ptr' reaches"),
    ("the residual's stride", _set_int("e0s2", 10**6), r"argument 'e0_ptr' reaches"),
    ("one window size", _set_constexpr("POOL_KW", 0), "takes both window sizes"),
    ("pooled by phase", _set_constexpr("PHASED", True), "neither PHASED nor DEPTH"),
    ("a window too large", _set_constexpr("POOL_KH", 65), "constexpr POOL_KH=65 is not allowed"),
    ("no such pooling", _set_constexpr("POOL", "min"), "constexpr POOL='min' is not allowed"),
]


class ConvPool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)

    def forward(self, x, skip):
        return F.max_pool2d(torch.relu(self.conv(x) + skip), 3, 2, 1)


def test_a_pooling_convolution_loads_and_its_damage_is_refused():
    torch.manual_seed(0)
    model, args = ConvPool().eval(), (torch.randn(2, 3, 9, 11), torch.randn(2, 5, 5, 6))
    lowered = td.lower(torch.export.export(model, args), config=RESIDENT)
    ((d, k, launch),) = _launches(lowered.program)
    assert launch.kernel == "conv2d" and launch.constexprs["POOL_KH"].value == 3
    with torch.no_grad():
        torch.testing.assert_close(_load(lowered)(*args), model(*args))
    _each_damage_refused(lowered, d, k, POOLED_CONV_DAMAGE)


# -- a 3-D convolution with an epilogue and 3-D pooling (the depth's arguments and DEPTH) ----------------
class Video(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.ConvTranspose3d(3, 4, 2, stride=2)

    def forward(self, x, skip):
        y = torch.relu(self.conv(x)) + skip
        return F.max_pool3d(y, 3, 2, 1, return_indices=True), F.avg_pool3d(y, (2, 1, 2))


VIDEO_DAMAGE = {
    "conv2d": [
        ("input depth stride", _set_int("xs_d", 10**6), r"argument 'x_ptr' reaches"),
        ("weight depth stride", _set_int("ws_d", 10**6), r"argument 'w_ptr' reaches"),
        ("output depth stride", _set_int("os_d", 10**6), r"argument 'out_ptr' reaches"),
        ("the skip's depth stride", _set_int("e1s2", 10**6), r"argument 'e1_ptr' reaches"),
        ("not a flag", _set_constexpr("DEPTH", 2), "constexpr DEPTH=2 is not allowed"),
    ],
    "pool2d": [
        ("input depth stride", _set_int("xs_d", 10**6), r"argument 'x_ptr' reaches"),
        ("a deeper input", _set_int("D", 100), r"argument 'x_ptr' reaches"),
        ("output depth 0", _set_int("OD", 0), r"argument 'OD' is 0"),
    ],
}


def test_3d_convolution_and_pooling_load_and_their_damage_is_refused():
    torch.manual_seed(0)
    model, args = Video().eval(), (torch.randn(2, 3, 3, 4, 5), torch.randn(2, 4, 6, 8, 10))
    lowered = td.lower(torch.export.export(model, args), config=RESIDENT)
    launches = _launches(lowered.program)
    assert [launch.kernel for _, _, launch in launches] == ["conv2d", "pool2d", "pool2d"]
    assert all(launch.constexprs["DEPTH"].value for _, _, launch in launches)
    with torch.no_grad():
        for r, e in zip(torch.utils._pytree.tree_leaves(_load(lowered)(*args)),
                        torch.utils._pytree.tree_leaves(model(*args))):
            torch.testing.assert_close(r, e)
    for d, k, launch in launches[:2]:
        where = rf"delegate {d} \('triton_0'\) launch {k} \('{launch.kernel}'"
        for _, damage, match in VIDEO_DAMAGE[launch.kernel]:
            program = copy.deepcopy(lowered.program)
            damage(program.methods[0].delegates[d].plan.launches[k])
            _refused(lowered, program, rf"{where}.*{match}")
