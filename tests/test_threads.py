"""Threads: calls on one loaded program take turns (its lock), and interpreted launches on the simulated
device take turns across loads (Triton's interpreter patches module-level state while it runs)."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import tritondelegate as td
from tritondelegate.program import (Arena, Constant, HostArg, HostArgKind, InstrKind, Instruction, Method, Program,
                                    Role, Segment, SegmentKind, Slot, TensorValue)
from tritondelegate.serialize import save_program

N = 64  # elements of every tensor of the hand-made program


@pytest.fixture
def often_switching_threads():
    """Threads switch every microsecond instead of every 5 ms: a call that is not atomic gets interleaved."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _tensor(name, role, device="cpu", **kw) -> TensorValue:
    return TensorValue(name, "float32", (N,), device, role, 4 * N, **kw)


def _method(name: str, target: str) -> Method:
    """Returns ``target(x, w)`` and the state ``s`` as the call found it, and sets ``s`` to ``x`` (so a call
    finds the previous call's ``x``); ``x`` goes through the device arena and back first. Calls that
    interleave see each other's ``x`` in the arena, or both find one previous ``x``."""
    dump = lambda tree: pytree.treespec_dumps(pytree.tree_flatten(tree)[1])  # noqa: E731
    values = [_tensor("x", Role.INPUT), _tensor("x_dev", Role.INTERMEDIATE, "cuda:0", arena=0),
              _tensor("s", Role.MUTABLE_BUFFER, "cuda:0", constant=1, slot=0), _tensor("y", Role.INTERMEDIATE),
              _tensor("out", Role.INTERMEDIATE), _tensor("w", Role.CONSTANT, constant=0),
              _tensor("s_before", Role.INTERMEDIATE)]
    instructions = [Instruction(InstrKind.COPY_D2H, [2], [6], name="read_state"),
                    Instruction(InstrKind.COPY_H2D, [0], [1], name="h2d"),
                    Instruction(InstrKind.COPY_D2H, [1], [3], name="d2h"),
                    Instruction(InstrKind.HOST_OP, [3, 5], [4], target=target, name="op",
                                args=[HostArg(HostArgKind.TENSOR, 3), HostArg(HostArgKind.TENSOR, 5)])]
    return Method(name, values, [0], [4, 6], dump(((0,), {})), dump((0, 0)), instructions, [],
                  [Arena("cuda:0", 4 * N, 256, 4 * N)], mutated_buffers=[(2, 1)])


@pytest.fixture(scope="module")
def shared_state_program(tmp_path_factory):
    """Two methods (``mul``, ``add``) that share the state ``s``; copies and host ops only (no kernels)."""
    w = torch.randn(N)
    constants = [Constant("w", "float32", (N,), 4 * N), Constant("s", "float32", (N,), 4 * N)]
    program = Program([_method("mul", "aten::mul.Tensor"), _method("add", "aten::add.Tensor")], constants,
                      segments=[Segment("cuda:0", SegmentKind.STATE, 4 * N, 256)],
                      slots=[Slot("s", 1, "cuda:0", state=True, segment=0)])
    path = tmp_path_factory.mktemp("threads") / "shared.tdp"
    save_program(program, [w, torch.zeros(N)], path)
    return path, w


def _hammer(calls: list, n: int, records: list | None = None) -> list[str]:
    """Runs each ``(method, expected)`` of ``calls`` in its own thread ``n`` times on fresh inputs, where
    ``expected(x)`` is the call's (first) output; returns what went wrong. ``records`` gets ``(x, output)``
    of every call."""
    wrong: list[str] = []
    start = threading.Barrier(len(calls))

    def run(k, method, expected):
        gen = torch.Generator().manual_seed(k)
        start.wait()
        for i in range(n):
            x = torch.randn(*method.method.values[method.method.inputs[0]].shape, generator=gen)
            try:
                got = method(x)
            except Exception as exc:  # reported as a failure below
                wrong.append(f"thread {k} call {i}: {type(exc).__name__}: {exc}")
                continue
            if records is not None:
                records.append((x, got))
            if not torch.equal(got[0] if isinstance(got, tuple) else got, expected(x)):
                wrong.append(f"thread {k} call {i}: wrong output")

    threads = [threading.Thread(target=run, args=(k, m, e)) for k, (m, e) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong


def _assert_one_after_another(records: list) -> None:
    """Each call saw the state the call before it left: the calls form one chain, from the initial zeros
    through every call's ``x`` (two overlapping calls would both see the same previous ``x``)."""
    before = {tuple(out[1].tolist()) for _, out in records}
    assert len(before) == len(records), "two calls saw the same previous state"
    inputs = {tuple(x.tolist()) for x, _ in records}
    assert len(before - inputs) == 1 and before - inputs == {(0.0,) * N}  # the first call saw the initial zeros
    assert len(inputs - before) == 1  # the last call's x, which no call saw


def test_two_threads_on_one_method(shared_state_program, often_switching_threads):
    path, w = shared_state_program
    method = td.load(path, devices="simulated").load_method("mul")
    records: list = []
    assert _hammer([(method, lambda x: x * w)] * 2, 200, records) == []
    assert method.stats.calls == len(records) == 400
    _assert_one_after_another(records)


def test_two_threads_on_two_methods_sharing_state(shared_state_program, often_switching_threads):
    path, w = shared_state_program
    program = td.load(path, devices="simulated")
    mul, add = program.load_method("mul"), program.load_method("add")
    records: list = []
    assert _hammer([(mul, lambda x: x * w), (add, lambda x: x + w)], 200, records) == []
    _assert_one_after_another(records)
    program.reset_state()  # takes the same lock
    assert torch.equal(mul(torch.ones(N))[1], torch.zeros(N))


class _Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return x + self.w


@pytest.fixture(scope="module")
def kernel_program():
    """A tiny program with one Triton launch (run by the interpreter on the simulated device)."""
    torch.manual_seed(0)
    model = _Affine().eval()
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, (torch.randn(4, 8),)), config=config)
    assert lowered.program.methods[0].delegates  # the add runs as a kernel
    return lowered, model


def test_interpreted_launches_from_threads_on_one_method_and_on_separate_loads(kernel_program):
    lowered, model = kernel_program
    expected = lambda x: model(x).detach()  # noqa: E731
    method = lowered.load("simulated").load_method()
    assert _hammer([(method, expected)] * 2, 25) == []
    separate = [lowered.load("simulated").load_method() for _ in range(2)]
    assert _hammer([(m, expected) for m in separate], 25) == []
