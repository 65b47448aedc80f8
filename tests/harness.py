"""Shared test helpers: shapes, per-dtype tolerances, and running a model through delegates.

``run_delegated`` lowers every compute node of an exported model into one Triton delegate and runs
its launch plan on host memory (the simulated device), so a kernel test checks the kernel and its
lowering without the rest of the pipeline. End-to-end tests use the public API instead.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from tritondelegate.backend import build_plan
from tritondelegate.runtime.delegate import DelegateRunner

# Kernels run natively on a GPU when there is one, else under the Triton interpreter on host memory.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Odd sizes first: 1, primes, a power of two plus one.
SIZES = (1, 17, 33, 64, 129)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (atol, rtol) per dtype; fp16/bf16 results are judged against an fp32 reference.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


class Fn(torch.nn.Module):
    """A module around a function, so a test can export a lambda."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class Buffered(torch.nn.Module):
    """A module with one buffer ``buf`` (the tensor given) that ``fn(buf, *args)`` may update in place."""

    def __init__(self, fn, buf: torch.Tensor):
        super().__init__()
        self.register_buffer("buf", buf)
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.buf, *args)


class Logits(torch.nn.Module):
    """A transformers causal LM as input_ids -> logits, without the cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def on_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` reversed along its last dim by an op with no Triton kernel (``aten.flip``): how a test puts
    a node on the host."""
    return torch.flip(x, [-1])


def greedy_static_cache(prefill, decode, prompt: torch.Tensor, tokens: int):
    """Greedy generation through transformers' static-cache recipe (``prefill``/``decode`` take
    ``input_ids`` and ``cache_position``): the tokens and every step's last logits."""
    n = prompt.shape[1]
    with torch.no_grad():
        logits = [prefill(input_ids=prompt, cache_position=torch.arange(n))[0, -1]]
        out = [int(logits[-1].argmax())]
        for step in range(tokens - 1):
            logits.append(decode(input_ids=torch.tensor([[out[-1]]]), cache_position=torch.tensor([n + step]))[0, -1])
            out.append(int(logits[-1].argmax()))
    return out, logits


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0):
    """Compare with the tolerance of ``dtype`` (default: ``actual``'s); ``scale`` widens it for
    ops that accumulate over long reductions (documented at each use)."""
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    if not actual.dtype.is_floating_point:
        assert actual.dtype == reference.dtype
        assert torch.equal(actual, reference)
        return
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.float(), reference.float(), atol=atol * scale, rtol=rtol * scale)


def export_decomposed(model, args, keep=()):
    """``model`` exported and decomposed; ``keep``: ATen ops kept whole beyond the default ones (an op
    the default table decomposes, e.g. ``aten.index_copy.default``, to test its own kernel)."""
    from tritondelegate.decompose import decompose, default_keep

    ep = torch.export.export(model, tuple(args))
    return decompose(ep, keep=default_keep() + list(keep)) if keep else decompose(ep)


def run_delegated(model, args, keep=()):
    """Export ``model``, lower all its compute into one delegate and run it. Returns (outputs, plan)."""
    return run_program(export_decomposed(model, args, keep), args)


def run_program(ep, args):
    """:func:`run_delegated` of an exported program as it is (decomposed or not)."""
    graph = ep.graph_module.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = list(out_node.args[0])
    plan = build_plan(nodes, inputs, outputs)
    state = {**dict(ep.named_parameters()), **dict(ep.named_buffers()), **ep.constants}
    user = iter(args)
    values = [
        (state[spec.target] if spec.target is not None else next(user)).contiguous().to(DEVICE)
        for spec in ep.graph_signature.input_specs
    ]
    results = [torch.empty(o.meta["val"].shape, dtype=o.meta["val"].dtype, device=DEVICE) for o in outputs]
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=DEVICE)
    DelegateRunner(plan, scratch, simulated=DEVICE == "cpu")(values, results)
    return [r.cpu() for r in results], plan


def check_model(model, args, dtype=None, scale=1.0, reference_args=None, keep=()):
    """Run ``model`` through a delegate and compare every output with eager.

    For fp16/bf16, pass the fp32 model/args as ``reference_args=(fp32_model, fp32_args)`` to judge
    against an fp32 reference. ``keep``: as for :func:`export_decomposed`.
    """
    results, plan = run_delegated(model, args, keep)
    if reference_args is not None:
        ref_model, ref_args = reference_args
        expected = ref_model(*ref_args)
    else:
        expected = model(*args)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    flat = [e for e in torch.utils._pytree.tree_leaves(expected)]
    assert len(flat) == len(results)
    for r, e in zip(results, flat):
        assert_close(r, e.to(r.dtype) if not r.dtype.is_floating_point else e, dtype=dtype or r.dtype,
                     scale=scale)
    return results, plan


def check_low(model, args, dtype, tolerance=None):
    """``model`` in ``dtype`` through a delegate, against the same rounded weights and inputs in fp32:
    :func:`check_model`'s (results, plan). ``tolerance``: the dtype whose tolerance applies (default:
    each result's own)."""
    low = copy.deepcopy(model).to(dtype)
    low_args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    ref_args = tuple(a.float() if a.is_floating_point() else a for a in low_args)
    return check_model(low, low_args, tolerance, reference_args=(copy.deepcopy(low).float(), ref_args))


@dataclass
class StateRun:
    """What :func:`check_state_updates` saw: the plan, the aliases ``build_plan`` recorded, and the
    aliases expected (each in-place-updated buffer's mutation output -> that buffer's input)."""

    plan: object
    aliases: dict[int, int] | None
    expected_aliases: dict[int, int]
    nodes: list
    num_outputs: int


def check_state_updates(model, calls, in_place=(), keep=(), aliases=True, dtype=None):
    """Run a model that updates its buffers through one delegate, call after call, and compare its
    user outputs and final buffers with eager (on a copy of ``model``).

    The nodes whose target is in ``in_place`` are marked ``td_inplace`` (as the reinplacing pass
    does) and the plan is built with ``aliases={}`` (``aliases=False``: ``None``). Buffers live in
    tensors allocated here, one per buffer for all the calls: an aliased mutation output is that
    tensor, updated by the kernels; any other mutation output is copied back into it after a call,
    as the runtime does."""
    from torch.export.graph_signature import OutputKind

    reference = copy.deepcopy(model)
    ep = export_decomposed(model, calls[0], keep)
    graph = ep.graph_module.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    for n in nodes:
        if n.target in in_place:
            n.meta["td_inplace"] = True
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = list(next(n for n in graph.nodes if n.op == "output").args[0])
    recorded = {} if aliases else None
    plan = build_plan(nodes, inputs, outputs, aliases=recorded)
    specs_in, specs_out = ep.graph_signature.input_specs, ep.graph_signature.output_specs
    state = {**dict(ep.named_parameters()), **dict(ep.named_buffers()), **ep.constants}
    held = {s.target: state[s.target].clone().to(DEVICE) for s in specs_in if s.target is not None}
    position = {s.target: i for i, s in enumerate(specs_in) if s.target is not None}
    marked = {n for n in nodes if n.meta.get("td_inplace")}
    expected = {i: position[s.target] for i, (s, o) in enumerate(zip(specs_out, outputs))
                if s.kind == OutputKind.BUFFER_MUTATION and o in marked}
    runner = DelegateRunner(plan, torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=DEVICE),
                            simulated=DEVICE == "cpu")
    for args in calls:
        user = iter(args)
        values = [held[s.target] if s.target is not None else next(user).to(DEVICE) for s in specs_in]
        kept = [i for i in range(len(outputs)) if i not in (recorded or {})]
        results = [torch.empty(outputs[i].meta["val"].shape, dtype=outputs[i].meta["val"].dtype,
                               device=DEVICE) for i in kept]
        runner(values, results)
        got = dict(zip(kept, results))
        got.update({i: values[j] for i, j in (recorded or {}).items()})
        for i, spec in enumerate(specs_out):
            if spec.kind == OutputKind.BUFFER_MUTATION and got[i] is not held[spec.target]:
                held[spec.target].copy_(got[i])
        with torch.no_grad():
            eager = reference(*args)
        eager = torch.utils._pytree.tree_leaves(eager)
        users = [got[i].cpu() for i, s in enumerate(specs_out) if s.kind == OutputKind.USER_OUTPUT]
        assert len(users) == len(eager)
        for r, e in zip(users, eager):
            assert_close(r, e, dtype=dtype)
    for name, buffer in reference.named_buffers():
        assert_close(held[name].cpu(), buffer, dtype=dtype)
    return StateRun(plan, recorded, expected, nodes, len(outputs))


def check_dynamic(model, calls, dynamic_shapes, dtype=None, scale=1.0, reference=None, example=None, keep_host=()):
    """Export ``model`` with ``dynamic_shapes`` (bounded ``torch.export.Dim``s), lower it with the
    default partitioner, and run every argument tuple of ``calls`` (different sizes) through one
    loaded program, comparing each result with eager. Every compute node must be delegated (except
    ops named in ``keep_host``), and no call may fall back to re-lowering.

    ``example``: the arguments to export with (default: ``calls[0]``). ``reference``: a function of
    the call's arguments returning the expected outputs (default: ``model``), e.g. an fp32 model for
    fp16/bf16 runs. Returns (lowered program, loaded method)."""
    import tritondelegate as td

    ep = torch.export.export(model, tuple(example or calls[0]), dynamic_shapes=dynamic_shapes)
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(ep, config=config)
    report = lowered.reports["forward"]
    host = [(n, op, why) for n, op, why in report.nodes.host if op not in keep_host]
    assert not host, f"nodes left on the host: {host}"
    method = lowered.load().load_method("forward")
    for args in calls:
        results = method(*args)
        with torch.no_grad():
            expected = (reference or model)(*args)
        results = torch.utils._pytree.tree_leaves(results)
        expected = torch.utils._pytree.tree_leaves(expected)
        assert len(results) == len(expected)
        for r, e in zip(results, expected):
            assert_close(r, e.to(r.dtype) if not r.dtype.is_floating_point else e, dtype=dtype or r.dtype,
                         scale=scale)
        # The call moved exactly its own inputs' bytes to the device.
        assert method.stats.call_h2d_bytes == sum(a.numel() * a.element_size() for a in args)
    return lowered, method


def lower_resident(model, args, dynamic_shapes=None):
    """``model`` exported for ``args`` (``dynamic_shapes`` as torch.export takes them) and lowered with
    the default partitioner and resident constants; export's and lowering's warnings silenced."""
    import tritondelegate as td

    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes), config=config)


def plan_launches(lowered, method: int = 0) -> list:
    """Every launch of a lowered program's method, in order, over its delegates."""
    return [launch for d in lowered.program.methods[method].delegates for launch in d.plan.launches]


def check_launches(model, args, dtype=torch.float32) -> list:
    """Export and lower ``model`` with resident constants, run it on the simulated device and compare
    every output with the model in fp32 at ``dtype``'s tolerance (the model is left in fp32). Returns
    the launches of its plan."""
    import tritondelegate as td

    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(torch.export.export(model, tuple(args)), config=config)
    results = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        expected = model.float()(*(a.float() for a in args))
    atol, rtol = TOLERANCES[dtype]
    for r, e in zip(torch.utils._pytree.tree_leaves(results), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(r.float(), e, atol=atol, rtol=rtol)
    return plan_launches(lowered)
