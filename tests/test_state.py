"""Program state: buffers mutated by any method are one instance per loaded program, shared by its
methods, kept on the device and updated in place; resident constants are held once per program."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate.program import DEVICE_ALIGNMENT, align_up
from tritondelegate.runtime import SimulatedAllocator

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class Accumulate(torch.nn.Module):
    """``total += x @ w`` (a state update that is not a scatter: written back on the device)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("total", torch.zeros(4, 8))

    def forward(self, x):
        self.total.add_(x @ self.w)
        return self.total * 2


class Read(torch.nn.Module):
    """Reads the state ``Accumulate`` writes, and the same weight."""

    def __init__(self, acc: Accumulate):
        super().__init__()
        self.w = acc.w
        self.register_buffer("total", acc.total)

    def forward(self, x):
        return self.total + x @ self.w


class Cache(torch.nn.Module):
    """A tiny KV-cache-like module: ``cache[:, pos] = x @ w`` then reads the whole cache."""

    def __init__(self, length: int = 17, width: int = 5):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width))
        self.register_buffer("cache", torch.zeros(2, length, width))

    def forward(self, x, pos):
        self.cache[:, pos] = (x @ self.w).unsqueeze(1)
        return self.cache.sum(dim=1)


def _acc_program(config=RESIDENT, **load):
    torch.manual_seed(0)
    acc = Accumulate()
    x = torch.randn(4, 8)
    eps = {"step": torch.export.export(acc, (x,)), "read": torch.export.export(Read(acc), (x,))}
    lowered = td.lower(eps, config=config)
    return lowered, acc, x


def test_methods_share_state_and_a_reader_sees_the_latest_value(tmp_path):
    lowered, acc, x = _acc_program()
    assert lowered.state["total"].device == "cuda:0"
    lowered.save(tmp_path / "acc.tdp")
    program = td.load(tmp_path / "acc.tdp", devices="simulated")
    step, read = program.load_method("step"), program.load_method("read")
    expected = torch.zeros(4, 8)
    for _ in range(3):
        expected += x @ acc.w.detach()
        torch.testing.assert_close(step(x), 2 * expected)
        assert step.stats.call_h2d_bytes == x.nbytes  # the state never crosses the bus
        assert step.stats.call_d2h_bytes == x.nbytes
        assert step.stats.call_d2d_bytes == expected.nbytes  # written back on the device
    with torch.no_grad():
        torch.testing.assert_close(read(x), expected + x @ acc.w)
    assert read.stats.load_h2d_bytes == 0  # the weight was loaded by "step" already


def test_reset_state_and_independent_loads():
    lowered, acc, x = _acc_program()
    first, second = lowered.load("simulated"), lowered.load("simulated")
    step = first.load_method("step")
    once = step(x)
    step(x)
    with torch.no_grad():
        torch.testing.assert_close(second.load_method("read")(x), x @ acc.w)  # untouched by `first`
    first.reset_state()
    torch.testing.assert_close(step(x), once)
    assert first.state_names == ["total"]


def test_memory_holds_each_constant_once_per_program():
    lowered, acc, x = _acc_program()
    allocator = SimulatedAllocator()
    program = lowered.load({"cuda": allocator})
    assert program.memory() == {}
    step = program.load_method("step")
    read = program.load_method("read")
    memory = program.memory()["cuda:0"]
    assert memory["constants"] == align_up(acc.w.nbytes, DEVICE_ALIGNMENT)  # read by both methods, held once
    assert memory["state"] == align_up(acc.total.nbytes, DEVICE_ALIGNMENT)
    arenas = sum(a.nbytes for m in lowered.program.methods for a in m.arenas)
    assert memory["arenas"] == arenas
    assert memory["total"] == memory["constants"] + memory["state"] + arenas
    assert allocator.copied_bytes["load"] == acc.w.nbytes + acc.total.nbytes  # weights once, state once
    assert step.stats.load_h2d_bytes + read.stats.load_h2d_bytes == acc.w.nbytes


def test_scatter_updates_state_in_place():
    torch.manual_seed(0)
    model = Cache()
    x, pos = torch.randn(2, 5), torch.tensor([3])
    ep = torch.export.export(model, (x, pos))
    lowered = td.lower(ep, config=RESIDENT)
    assert lowered.reports["forward"].inplace == ["index_put"]
    method = lowered.load("simulated").load_method("forward")
    eager = Cache()
    eager.load_state_dict(model.state_dict())
    for p in (3, 0, 16, 3):
        x = torch.randn(2, 5)
        with torch.no_grad():
            torch.testing.assert_close(method(x, torch.tensor([p])), eager(x, torch.tensor([p])))
        assert method.stats.call_d2d_bytes == 0  # nothing written back: the kernel wrote the slot
        assert method.stats.call_h2d_bytes == x.nbytes + 8  # x and pos only


def test_state_touched_by_a_host_op_is_copied_per_call_and_reported():
    torch.manual_seed(0)
    model = Cache()
    x, pos = torch.randn(2, 5), torch.tensor([3])
    ep = torch.export.export(model, (x, pos))
    partitioner = td.TritonPartitioner(ops=["aten.mm", "aten.sum"])  # index_put stays on the host
    with pytest.warns(td.PerCallCopyWarning, match=r"state buffer 'cache' \(680 bytes\).*host op 'index_put'"):
        lowered = td.lower(ep, partitioner=partitioner, config=RESIDENT)
    assert lowered.state["cache"].device == "cpu"
    assert "cache, 680 B, on the host: host op 'index_put'" in lowered.summary()
    method = lowered.load("simulated").load_method("forward")
    eager = Cache()
    eager.load_state_dict(model.state_dict())
    for p in (3, 9):
        with torch.no_grad():
            torch.testing.assert_close(method(x, torch.tensor([p])), eager(x, torch.tensor([p])))
    assert method.stats.call_h2d_bytes >= 680
    strict = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
        skip_h2d_for_constants=True, error_on_per_call_copies=True))
    with pytest.raises(td.PerCallCopyError, match="state buffer 'cache'"):
        td.lower(ep, partitioner=partitioner, config=strict)


def test_state_on_device_false_copies_the_state_every_call():
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
        skip_h2d_for_constants=True, state_on_device=False))
    with pytest.warns(td.PerCallCopyWarning, match="state_on_device=False"):
        lowered, acc, x = _acc_program(config)
    assert lowered.state["total"].device == "cpu"
    program = lowered.load("simulated")
    step = program.load_method("step")
    expected = torch.zeros(4, 8)
    for _ in range(2):
        expected += x @ acc.w.detach()
        torch.testing.assert_close(step(x), 2 * expected)
    assert step.stats.call_h2d_bytes == x.nbytes + acc.total.nbytes
    assert program.memory()["cpu"]["state"] == acc.total.nbytes


def test_graphs_replay_delegates_that_update_device_state():
    torch.manual_seed(0)
    model = Cache()
    x = torch.randn(2, 5)
    lowered = td.lower(torch.export.export(model, (x, torch.tensor([0]))), config=RESIDENT)
    method = lowered.load("simulated").load_method("forward", graphs=True)
    eager = Cache()
    eager.load_state_dict(model.state_dict())
    for p in range(4):
        x = torch.randn(2, 5)
        with torch.no_grad():
            torch.testing.assert_close(method(x, torch.tensor([p])), eager(x, torch.tensor([p])))
    assert method.stats.graph_replays_per_call == 1


def test_calls_on_one_program_are_serialized():
    lowered, acc, x = _acc_program()
    program = lowered.load("simulated")
    steps = [program.load_method("step") for _ in range(2)]
    errors = []

    def run(method):
        try:
            for _ in range(3):
                method(x)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with torch.no_grad():
        expected = 6 * (x @ acc.w)
        torch.testing.assert_close(program.load_method("read")(x), expected + x @ acc.w, rtol=1e-5, atol=1e-5)


def test_one_buffer_with_two_shapes_is_refused():
    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x):
            return self.total + x

    _, acc, x = _acc_program()
    eps = {"step": torch.export.export(acc, (x,)), "other": torch.export.export(Other(), (torch.randn(3),))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        with pytest.raises(ValueError, match=r"state buffer 'total' is torch.float32\[4, 8\] in one method"):
            td.lower(eps)


class Rescale(torch.nn.Module):
    """A bf16 buffer overwritten in place from an fp32 computation, as Phi-3's longrope rewrites its
    inv_freq (``copy_`` keeps the buffer's dtype); read before the overwrite, so the next call sees
    what this one wrote (it is state)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.5, 2.0, 8).to(torch.bfloat16))
        self.register_buffer("scale", torch.tensor(1.5))  # fp32

    def forward(self, x):
        y = x * self.freq
        self.freq.copy_(torch.linspace(0.5, 2.0, 8) * self.scale)  # an fp32 value
        return y


def test_an_update_of_another_dtype_is_cast_to_the_buffer():
    # Before: lower() wrote the fp32 update for the bf16 state and the program failed to load.
    model = Rescale()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    lowered = td.lower(torch.export.export(model, (x,)))
    assert lowered.state["freq"].dtype == torch.bfloat16
    method, eager = lowered.load().load_method("forward"), Rescale()
    for _ in range(2):  # the initial freq, then the one the first call wrote (rounded to bf16)
        torch.testing.assert_close(method(x), eager(x))


class Counter(torch.nn.Module):
    """transformers' static cache keeps a counter per layer that each call overwrites before reading it:
    ``counter.copy_(position); counter.add_(n)``. ``read_first`` reads it before the overwrite."""

    def __init__(self, read_first: bool = False):
        super().__init__()
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))
        self.read_first = read_first

    def forward(self, x, position):
        old = self.counter + 0 if self.read_first else 0
        self.counter.copy_(position[0])
        self.counter.add_(x.shape[0])
        return x * (self.counter - x.shape[0] + 1) + old


def _counter_program(**readers):
    x, position = torch.randn(3, 4), torch.tensor([7])
    eps = {"step": torch.export.export(Counter(), (x, position)),
           **{name: torch.export.export(m, (x, position)) for name, m in readers.items()}}
    return td.lower(eps, config=RESIDENT), x, position


def test_state_that_no_method_reads_is_not_written():
    lowered, x, position = _counter_program()
    assert lowered.state == {}  # the counter is a constant now: never read, so never updated
    fused = lowered.reports["step"].fused
    assert any("state 'counter' is never read, only overwritten" in d for d in fused), fused
    # (position + 3) - 3 + 1, then x times it (+ 0): 2 launches; the update position + 3 was a third
    assert sum(lowered.reports["step"].launches.values()) == 2
    step = lowered.load("simulated").load_method("step")
    for p in (7, 2, 9):
        torch.testing.assert_close(step(x, torch.tensor([p])), x * (p + 1))


def test_state_read_before_its_overwrite_or_by_another_method_stays_state():
    read_first, _, _ = _counter_program()
    lowered, x, position = _counter_program(reader=Counter(read_first=True))
    assert list(lowered.state) == ["counter"]  # "reader" reads what "step" wrote
    assert not any("never read" in d for report in lowered.reports.values() for d in report.fused)
    program = lowered.load("simulated")
    step, reader = program.load_method("step"), program.load_method("reader")
    step(x, torch.tensor([4]))
    torch.testing.assert_close(reader(x, torch.tensor([1])), x * 2 + (4 + 3))  # the old counter, 4 + 3
