"""PyTorch's own operator samples (OpInfo, ``common_methods_invocations.op_db``) through the project's
partitioner and kernels, for ``test_opinfo.py`` and ``scripts/opinfo_all.py``.

Each registry target (an ATen overload of ``kernels/registry.py``) is mapped to the OpInfos that
exercise it, by name (``aten.relu.default`` -> ``nn.functional.relu``; ``max_pool2d_with_indices`` ->
``max_pool2d``), else by the ATen ops one eager sample dispatches (``convolution`` <- ``conv2d``).
Samples are wrapped up to 64 to a module (a submodule per sample, so every node of the exported graph
names its sample), exported, lowered with a recording ``TritonPartitioner`` and run on the simulated
device twice: with the sample's values and with NaN, inf and -inf written into every floating input.
Each run is compared with eager at torch.testing's per-dtype tolerances, NaN where eager has NaN (or,
where eager's vectorized CPU path disagrees with itself, with eager in fp64). A module that fails is
halved until the failing samples stand alone.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tritondelegate as td
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import registry
from tritondelegate.partitioner import op_name

# (atol, rtol): torch.testing.assert_close's defaults, which OpInfo tests compare with
TOLERANCES = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 1.6e-2)}
HALVES = (torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.bool)
MAX_TRACED = 6  # OpInfos taken for a target found only by dispatch, the most focused first


@dataclass
class Sample:
    """One OpInfo sample run: what its graph held, what was claimed and refused, and the verdict."""

    info: str
    dtype: torch.dtype
    index: int
    targets: set = field(default_factory=set)  # registry targets among its nodes
    claimed: set = field(default_factory=set)  # ... of them in a delegate
    refused: list = field(default_factory=list)  # (node, op, reason) of its nodes left on the host
    status: str = "matched"  # matched | mismatched | raised | not exported | not run
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("mismatched", "raised")

    def __str__(self) -> str:
        return f"{self.info} [{dtype_name(self.dtype)} #{self.index}] {self.status}: {self.detail}"


# --- which OpInfos exercise which registry targets ------------------------------------------------
@cache
def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return [info for info in db if _dtypes(info)]


@contextmanager
def _sampling():
    """OpInfo's sample iterators look for the running unittest test by walking the whole stack
    (``inspect.stack``, tens of milliseconds) twice when one is made. No unittest test runs here, so that
    lookup, which would find nothing, is skipped."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    with mock.patch.object(core, "extract_test_fn", lambda: None), \
            mock.patch.object(common_utils, "extract_test_fn", lambda: None):
        yield


# Registry ATen ops that no OpInfo samples; their own tests check them against eager.
NO_OPINFO = {torch.ops.aten._grouped_mm.default}  # bf16-only when exported: tests/test_grouped_mm.py


def targets() -> list:
    """The registry's ATen overloads (``tritondelegate::`` ops have no OpInfo, nor NO_OPINFO's)."""
    return [t for t in registry.OPS
            if isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" and t not in NO_OPINFO]


def family(target) -> str:
    """The kernel file a registry target lowers through (``elementwise``, ``reduce``, ``pad``, ...)."""
    return registry.OPS[target].lower.__module__.rsplit(".", 1)[-1]


def info_id(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _short_names(info) -> set[str]:
    names = {info.name.split(".")[-1], info.aten_name or "", getattr(info.op, "__name__", "")}
    return {n.strip("_") for n in names if n}


class _Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@cache
def _dispatched() -> dict:
    """OpInfo id -> the ATen overloads its first fp32 sample dispatches in eager."""
    traced = {}
    for info in op_db():
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            with _sampling():
                sample = next(iter(info.sample_inputs("cpu", torch.float32)))
            with warnings.catch_warnings(), _Dispatched() as mode:
                warnings.simplefilter("ignore")
                info.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # noqa: BLE001 - an OpInfo that cannot run here exercises nothing
            continue
        traced[info_id(info)] = mode.ops
    return traced


def _plainest(info) -> tuple:
    """Sort key: ``amax`` before ``masked.amax``, ``max.binary`` after ``max``."""
    return info.name.count("."), bool(info.variant_test_name), len(info_id(info))


def candidates(target) -> list:
    """The OpInfos that exercise ``target``, the plainest first: those named like it, else those whose
    name is part of its own (``max_pool2d_with_indices``: ``max_pool2d``, then ``max``; the longest
    first), else those whose eager sample dispatches it."""
    base = target._opname.strip("_")
    exact = sorted((i for i in op_db() if base in _short_names(i)), key=_plainest)
    if exact:
        return exact
    words = f"_{base}_"
    inside = [max((len(n) for n in _short_names(i) if f"_{n}_" in words), default=0) for i in op_db()]
    if max(inside):
        ranked = sorted((pair for pair in zip(inside, op_db()) if pair[0]), key=lambda p: (-p[0], _plainest(p[1])))
        return [i for _, i in ranked][:MAX_TRACED]
    traced = _dispatched()
    hits = [i for i in op_db() if target in traced.get(info_id(i), ())]
    return sorted(hits, key=lambda i: (_plainest(i), len(traced[info_id(i)])))[:MAX_TRACED]


def _dtypes(info) -> list:
    """fp32, one half type and one integer type, as far as the OpInfo supports them on the CPU."""
    supported = info.supported_dtypes("cpu")
    chosen = [d for d in (torch.float32,) if d in supported]
    chosen += [d for d in HALVES if d in supported][:1]
    chosen += [d for d in INTS if d in supported][:1]
    return chosen


def samples(info, per_dtype: dict | None, reference: bool = False) -> list:
    """(dtype, index, SampleInput) of ``info``: ``per_dtype[dtype]`` samples of each dtype of
    :func:`_dtypes` (all of them when ``per_dtype`` is None; with ``reference``, its reference inputs)."""
    out = []
    for dtype in _dtypes(info):
        limit = None if per_dtype is None else per_dtype.get(dtype, per_dtype.get("int", 0))
        if limit == 0:
            continue
        maker = info.reference_inputs if reference else info.sample_inputs
        try:
            with _sampling():
                made = maker("cpu", dtype)
            for k, sample in enumerate(made):
                if limit is not None and k >= limit:
                    break
                out.append((dtype, k, sample))
        except Exception:  # noqa: BLE001 - a generator that fails here gives what it gave
            continue
    return out


# --- one module per OpInfo ------------------------------------------------------------------------
# OpInfos whose index output may order equal values either way (CPU topk, an unstable sort): name ->
# (that output's position, the position of the dim argument). Their indices are compared by the input
# values they pick along the dim.
TIES = {"sort": (1, 0), "argsort": (0, 0), "topk": (1, 1)}


class _One(torch.nn.Module):
    """``op(input, *args, **kwargs)`` of one sample, its tensors as the forward's arguments."""

    def __init__(self, op, sample, comparable: bool = True, name: str = ""):
        super().__init__()
        self.comparable = comparable
        self.ties = None  # (index output, dim) when equal values' indices may come in either order
        if name in TIES:
            output, position = TIES[name]
            args = sample.args
            self.ties = (output, args[position] if len(args) > position else sample.kwargs.get("dim", -1))
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        # copies: OpInfo may hand two samples one tensor, which export would take as one input
        self.tensors = [leaves[i].clone() for i in self.positions]
        self.leaves = [None if i in self.positions else leaf for i, leaf in enumerate(leaves)]
        self.op = op

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(pytree.tree_leaves(self.op(inp, *args, **kwargs)))


class _Batch(torch.nn.Module):
    def __init__(self, ones: list[_One]):
        super().__init__()
        self.ones = torch.nn.ModuleList(ones)

    def forward(self, *tensors):
        outs, k = [], 0
        for one in self.ones:
            outs.extend(one(*tensors[k:k + len(one.tensors)]))
            k += len(one.tensors)
        return tuple(outs)


class _Recording(td.TritonPartitioner):
    """The project's partitioner, keeping the graph it partitioned and its result."""

    def partition(self, exported_program):
        result = super().partition(exported_program)
        # lower() fuses the claimed nodes away after this: keep (name, target, module path) now
        nodes = [(n.name, n.target, [path for path, _ in n.meta.get("nn_module_stack", {}).values()])
                 for n in exported_program.graph_module.graph.nodes if n.op == "call_function"]
        self.seen = (nodes, result)
        return result


def inject(tensors: list) -> list:
    """Copies with NaN, inf and -inf written into every floating tensor (at different places per
    tensor, so that two operands do not hold them at the same element)."""
    out = []
    for k, t in enumerate(tensors):
        if t.is_floating_point() and t.numel() >= 3:
            t = t.clone()
            flat = t.view(-1) if t.is_contiguous() else None
            if flat is None:
                t = t.contiguous()
                flat = t.view(-1)
            n = flat.numel()
            for j, value in enumerate((float("nan"), float("inf"), float("-inf"))):
                flat[(k + 2 * j) % n] = value
        out.append(t)
    return out


def comparable(info) -> bool:
    """Whether ``info``'s values can be compared with eager's: not when PyTorch's own suite skips its
    device-against-CPU comparison (``empty``'s uninitialized memory, random ops)."""
    return not any(getattr(d, "cls_name", None) == "TestCommon" and getattr(d, "test_name", None) == "test_compare_cpu"
                   for d in info.decorators)


def _compare(actual: list, expected: list, values: bool = True) -> str:
    """'' when they agree at the dtype's tolerance (NaN where eager has NaN), else what differs;
    ``values=False``: shapes and dtypes only."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, eager has {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(e, torch.Tensor):
            return f"output {k}: eager returns a {type(e).__name__}"
        if not values:
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"output {k}: {_first_difference(a, e)}"
            continue
        atol, rtol = TOLERANCES.get(e.dtype, (0, 0))
        try:
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True)
        except AssertionError as exc:
            return f"output {k}: {_first_difference(a, e)}; " + " ".join(str(exc).split())[:200]
    return ""


def _first_difference(a: torch.Tensor, e: torch.Tensor) -> str:
    if a.shape != e.shape or a.dtype != e.dtype:
        return f"{a.dtype}{list(a.shape)} where eager has {e.dtype}{list(e.shape)}"
    atol, rtol = TOLERANCES.get(e.dtype, (0, 0))
    a64, e64 = a.double(), e.double()
    close = torch.isclose(a64, e64, atol=atol, rtol=rtol, equal_nan=True)
    where = (~close).nonzero()
    if not len(where):
        return "no element differs"
    at = tuple(where[0].tolist())
    return f"at {list(at)} got {a[at].item()!r}, eager {e[at].item()!r}"


# --- running ----------------------------------------------------------------------------------------
def _eager(one: _One, tensors: list) -> list | None:
    try:
        with torch.no_grad():
            return list(one(*tensors))
    except Exception:  # noqa: BLE001 - eager refuses these values (e.g. injected NaN): nothing to compare
        return None


def _eager64(one: _One, tensors: list, like: list) -> list | None:
    """Eager with every floating tensor in fp64, its results cast to ``like``'s dtypes: the reference
    where eager's own vectorized and scalar paths disagree (CPU ``gelu(inf)`` is NaN in a vector of
    eight, inf alone and in fp64)."""
    wide = [t.double() if t.is_floating_point() else t for t in tensors]
    out = _eager(one, wide)
    if out is None or len(out) != len(like):
        return None
    return [o.to(e.dtype) if isinstance(o, torch.Tensor) else o for o, e in zip(out, like)]


def _same_picks(one: _One, got: list, values: list, eager: list) -> list:
    """``got`` with its index output taken as eager's where both pick the same input values (NaN
    where eager picks NaN): for ops whose indices of equal values may come in either order."""
    output, dim = one.ties
    x = values[0]
    if x.ndim == 0 or len(got) <= output or got[output].shape != eager[output].shape:
        return got
    picked, expected = (torch.take_along_dim(x, idx, dim) for idx in (got[output], eager[output]))
    if torch.equal(picked.isnan(), expected.isnan()) and torch.equal(picked.nan_to_num(), expected.nan_to_num()):
        return got[:output] + [eager[output]] + got[output + 1:]
    return got


def _verdict(one: _One, got: list, values: list, eager: list) -> str:
    """'' when ``got`` matches eager in the sample's dtypes or, failing that, eager in fp64."""
    if one.ties is not None:
        got = _same_picks(one, got, values, eager)
    differs = _compare(got, eager, one.comparable)
    if differs and one.comparable:
        wide = _eager64(one, values, eager)
        if wide is not None and not _compare(got, wide):
            return ""
    return differs


def _attribute(partitioner: _Recording, records: list[Sample]) -> None:
    """Each node's registry target, delegated or refused (with the reason), into its sample's record."""
    nodes, result = partitioner.seen
    for name, target, stack in nodes:
        owner = next((int(p.split(".")[1]) for p in stack if p.startswith("ones.")), None)
        if owner is None:
            continue
        record = records[owner]
        if target in registry.OPS:
            record.targets.add(target)
            if name in result.tags:
                record.claimed.add(target)
        if name not in result.tags:
            record.refused.append((name, op_name(target), result.refused.get(name, "")))


def _run(ones: list[_One], records: list[Sample], expected: list[list]) -> None:
    """Lower ``ones`` as one module and run every sample, clean and NaN/inf-injected; the verdicts go
    into ``records`` only when the whole run got through (raises otherwise)."""
    tensors = [t for one in ones for t in one.tensors]
    partitioner = _Recording()
    lowered = td.lower(torch.export.export(_Batch(ones), tuple(tensors)), partitioner=partitioner)
    method = lowered.load(devices="simulated").load_method("forward")
    fresh = [Sample(r.info, r.dtype, r.index) for r in records]
    _attribute(partitioner, fresh)
    # NaN/inf only where eager takes them (an SVD refuses them): the other samples run as sampled
    spiked = [inject(one.tensors) for one in ones]
    spiked_eager = [_eager(one, v) for one, v in zip(ones, spiked)]
    spiked = [v if e is not None else one.tensors for one, v, e in zip(ones, spiked, spiked_eager)]
    for injected in (False, True):
        values = [t for v in spiked for t in v] if injected else tensors
        outputs, k, j = list(method(*values)), 0, 0
        for n, (one, record, clean) in enumerate(zip(ones, fresh, expected)):
            mine, got = values[k:k + len(one.tensors)], outputs[j:j + len(clean)]
            k, j = k + len(one.tensors), j + len(clean)
            eager = (spiked_eager[n] or clean) if injected else clean
            differs = _verdict(one, got, mine, eager)
            if differs and record.status == "matched":
                record.status, record.detail = "mismatched", ("NaN/inf inputs: " if injected else "") + differs
    for record, new in zip(records, fresh):
        record.__dict__.update(new.__dict__)


def _run_split(ones: list[_One], records: list[Sample], expected: list[list]) -> None:
    """:func:`_run`, halving the batch while it fails, down to the samples that fail alone."""
    try:
        _run(ones, records, expected)
        return
    except Exception as exc:  # noqa: BLE001 - narrowed down below
        if len(ones) == 1:
            try:
                torch.export.export(_Batch(ones), tuple(ones[0].tensors))
            except Exception as export_exc:  # noqa: BLE001 - torch.export's limits are not ours
                records[0].status, records[0].detail = "not exported", type(export_exc).__name__
                return
            records[0].status, records[0].detail = "raised", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            return
    half = len(ones) // 2
    _run_split(ones[:half], records[:half], expected[:half])
    _run_split(ones[half:], records[half:], expected[half:])


def run_infos(infos: list, per_dtype: dict | None, reference: bool = False, chunk: int = 64,
              alone: frozenset = frozenset(), max_numel: dict | None = None) -> list[Sample]:
    """The chosen samples of every OpInfo of ``infos``, ``chunk`` samples to a module; those whose
    (OpInfo id, dtype) is in ``alone`` (known to fail) one to a module, so as not to split the others.
    ``max_numel``: OpInfo id -> the most elements a sample's input may have to be run."""
    ones, records, expected = [], [], []
    for info in infos:
        for dtype, k, sample in samples(info, per_dtype, reference):
            one, record = _One(info.op, sample, comparable(info), info.name), Sample(info_id(info), dtype, k)
            clean = _eager(one, one.tensors)
            limit = (max_numel or {}).get(info_id(info))
            if limit is not None and max(t.numel() for t in one.tensors) > limit:
                record.status, record.detail = "not run", f"an input of more than {limit} elements"
            elif any(t.layout != torch.strided for t in one.tensors):
                record.status, record.detail = "not run", "sparse inputs (programs take dense tensors)"
            elif clean is None or not all(isinstance(t, torch.Tensor) for t in clean):
                record.status, record.detail = "not run", "eager gives no tensor outputs"
            else:
                ones.append(one)
                expected.append(clean)
            records.append(record)
    runnable = [r for r in records if r.status == "matched"]  # in the order of ``ones``
    single = [(r.info, r.dtype) in alone for r in runnable]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in (True, False):
            picked = [k for k, flag in enumerate(single) if flag == group]
            size = 1 if group else chunk
            for start in range(0, len(picked), size):
                part = picked[start:start + size]
                _run_split([ones[k] for k in part], [runnable[k] for k in part], [expected[k] for k in part])
    return records
