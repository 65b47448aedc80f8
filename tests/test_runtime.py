"""The load path and calls: arenas once, resident constants once, streams, errors, damaged files."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import tritondelegate as td
from harness import on_host
from tritondelegate.models import MLP
from tritondelegate.runtime import SimulatedAllocator
from tritondelegate.runtime.allocator import AllocatorError, SimulatedStream
from tritondelegate.serialize import header as hdr

RESIDENT = td.PropagateDeviceConfig(skip_h2d_for_constants=True)


def _mlp():
    torch.manual_seed(0)
    return MLP([16, 24, 8]).eval(), (torch.randn(3, 16),)


def _lower(model, args, **config):
    config.setdefault("propagate_device", RESIDENT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(torch.export.export(model, args), config=td.LowerConfig(**config))


@pytest.fixture
def saved(tmp_path):
    model, args = _mlp()
    path = tmp_path / "mlp.tdp"
    _lower(model, args).save(path)
    return model, args, path


def test_load_allocates_once_and_calls_allocate_nothing(saved):
    model, args, path = saved
    allocator = SimulatedAllocator()
    method = td.load(path, devices={"cuda": allocator}).load_method("forward")
    assert allocator.allocations == 2  # one arena for cuda:0, and the program's constants segment there
    assert allocator.synchronizations == 1  # once per device at load, not once per constant
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert allocator.copied_bytes["load"] == weights == method.stats.load_h2d_bytes
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(method(*args), model(*args))
    assert allocator.allocations == 2
    assert allocator.copied_bytes["load"] == weights  # never copied again
    assert method.stats.call_h2d_bytes == args[0].numel() * 4
    assert allocator.copied_bytes["h2d"] == 3 * args[0].numel() * 4


def test_copies_and_launches_run_on_the_callers_stream(saved):
    model, args, path = saved
    allocator = SimulatedAllocator()
    load_stream, call_stream = SimulatedStream("load"), SimulatedStream("call")
    method = td.load(path, devices={"cuda": allocator}).load_method("forward", stream=load_stream)
    assert allocator.copy_streams and all(s is load_stream for s in allocator.copy_streams)
    allocator.copy_streams.clear()
    method(*args, stream=call_stream)
    assert allocator.copy_streams and all(s is call_stream for s in allocator.copy_streams)


def test_device_outputs_are_fresh_unless_reuse_is_asked_for(tmp_path):
    model, args = _mlp()
    cfg = td.PropagateDeviceConfig(skip_h2d_for_constants=True, skip_d2h_for_method_outputs=True)
    lowered = _lower(model, args, propagate_device=cfg)
    first = lowered.load(devices="simulated").load_method()
    a = first(*args)
    b = first(args[0] * 2)
    assert not torch.equal(a, b)  # the first result did not change under us
    with torch.no_grad():
        torch.testing.assert_close(a, model(*args))
    reuse = lowered.load(devices="simulated").load_method(reuse_output_memory=True)
    a = reuse(*args)
    b = reuse(args[0] * 2)
    assert a.data_ptr() == b.data_ptr()  # documented: the arena is reused by the next call


def test_no_allocator_for_the_device_type(saved):
    _, _, path = saved
    with pytest.raises(AllocatorError, match="no allocator is registered for device type 'cuda'"):
        td.load(path, devices={}).load_method("forward")


def test_cuda_requested_without_cuda(saved):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(AllocatorError, match="needs CUDA"):
        td.load(saved[2], devices="cuda")


def test_unknown_method_lists_the_methods(saved):
    with pytest.raises(KeyError, match="no method 'decode'.*forward"):
        td.load(saved[2], devices="simulated").load_method("decode")


def test_missing_program_file(tmp_path):
    with pytest.raises(td.ProgramError, match="does not exist"):
        td.load(tmp_path / "nope.tdp")
    with pytest.raises(td.ProgramError, match="is not a file"):
        td.load(tmp_path)


class WithEmpty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x):
        return x * self.w, torch.cat([self.empty + x[0, :0], x[0]])


def test_zero_byte_constant_loads_without_a_copy(tmp_path):
    model = WithEmpty()
    args = (torch.randn(2, 5),)
    lowered = _lower(model, args)
    path = tmp_path / "empty.tdp"
    lowered.save(path)
    allocator = SimulatedAllocator()
    method = td.load(path, devices={"cuda": allocator}).load_method()
    names = [r[0] for r in lowered.reports["forward"].device.resident]
    assert "empty" in names and "w" in names
    assert allocator.copies == 1  # w only: the empty buffer needs no copy
    for o, e in zip(method(*args), model(*args)):
        torch.testing.assert_close(o, e)


def test_external_weights(tmp_path):
    model, args = _mlp()
    lowered = _lower(model, args, external_constants=lambda name: name.endswith("weight"))
    path = tmp_path / "ext.tdp"
    written = lowered.save(path)
    assert [os.path.basename(p) for p in written] == ["ext.tdp", "ext.weights.safetensors"]
    weights = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("weight"))
    _lower(model, args).save(tmp_path / "inside.tdp")
    assert os.path.getsize(tmp_path / "inside.tdp") - os.path.getsize(path) >= weights  # not in the program file
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(td.load(path, devices="simulated").load_method()(*args), expected)
    # Moved next to another name: found through data_files.
    moved = tmp_path / "elsewhere.safetensors"
    os.rename(written[1], moved)
    with pytest.raises(td.ProgramError, match="ext.weights.safetensors"):
        td.load(path, devices="simulated").load_method()
    program = td.load(path, data_files={"ext.weights.safetensors": str(moved)}, devices="simulated")
    torch.testing.assert_close(program.load_method()(*args), expected)


def test_resident_weight_stored_once_across_methods(tmp_path):
    """A weight resident in one method and read on the host in another adds its bytes once."""

    class Host(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return on_host(x * 1) + on_host(self.w + x)

    class Dev(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return x + self.w

    w = torch.nn.Parameter(torch.randn(256, 64))
    x = torch.randn(256, 64)
    single = _lower(Dev(w), (x,))
    both = td.lower({"dev": torch.export.export(Dev(w), (x,)), "host": torch.export.export(Host(w), (x,))},
                    config=td.LowerConfig(propagate_device=RESIDENT))
    assert [r[0] for r in both.reports["dev"].device.resident] == ["w"]
    single.save(tmp_path / "one.tdp")
    both.save(tmp_path / "two.tdp")
    growth = os.path.getsize(tmp_path / "two.tdp") - os.path.getsize(tmp_path / "one.tdp")
    assert growth < w.numel() * 4  # the second method added instructions, not a second copy of w
    program = td.load(tmp_path / "two.tdp", devices="simulated")
    torch.testing.assert_close(program.load_method("dev")(x), x + w.detach())
    torch.testing.assert_close(program.load_method("host")(x), Host(w)(x).detach())


def test_damaged_program_files_fail_cleanly_or_run_correctly(tmp_path):
    """What each kind of damage must do: a truncation, or flipped bits in the header or the flatbuffer
    (both under a CRC-32, which catches every 1- to 3-bit error at this size), fail ``td.load``; flipped
    bits in a constant's bytes fail when the constant is read (its checksum); flipped bits in padding,
    which nothing reads, load and give the same outputs."""
    model, args = _mlp()
    path = tmp_path / "good.tdp"
    _lower(model, args).save(path)
    good = path.read_bytes()
    _, _, _, _, fb_size, data_off, _, _, _, _ = hdr.HEADER.unpack(good[: hdr.HEADER.size])
    structure = hdr.FLATBUFFER_OFFSET + fb_size  # header and flatbuffer: [0, structure)
    constants = td.load(path, devices="simulated").program.constants
    spans = [(data_off + c.data_offset, data_off + c.data_offset + c.nbytes) for c in constants if c.nbytes]
    padding = [p for p in range(structure, len(good)) if not any(a <= p < b for a, b in spans)]
    with torch.no_grad():
        expected = model(*args)
    rng = random.Random(0)

    def flipped(positions) -> bytes:
        data = bytearray(good)
        for pos in positions:
            data[pos] ^= 1 << rng.randrange(8)
        return bytes(data)

    def run(data: bytes, name: str):
        bad = tmp_path / name
        bad.write_bytes(data)
        return td.load(bad, devices="simulated").load_method()(*args)

    for n in range(0, len(good), max(1, len(good) // 40)):
        with pytest.raises(td.ProgramError):
            run(good[:n], f"cut{n}.tdp")
    for i in range(60):
        positions = rng.sample(range(structure), rng.randint(1, 3))
        with pytest.raises(td.ProgramError, match="checksum mismatch|header"):
            run(flipped(positions), f"structure{i}.tdp")
    for i, (a, b) in enumerate(spans):
        with pytest.raises(td.ProgramError, match=rf"constant {i} .* do not match the checksum"):
            run(flipped(rng.sample(range(a, b), rng.randint(1, 3))), f"constant{i}.tdp")
    assert padding  # the zeros after the flatbuffer, up to the page-aligned data segment
    for i in range(20):
        out = run(flipped(rng.sample(padding, rng.randint(1, 3))), f"padding{i}.tdp")
        torch.testing.assert_close(out, expected)


def test_close_gives_the_memory_back_and_refuses_calls(saved):
    model, args, path = saved
    allocator = SimulatedAllocator()
    with td.load(path, devices={"cuda": allocator}) as program:
        method = program.load_method("forward")
        with torch.no_grad():
            torch.testing.assert_close(method(*args), model(*args))
        assert allocator.live_bytes > 0 and program.memory()["cuda:0"]["total"] > 0
    assert program.closed and allocator.live_bytes == 0 and program.memory() == {}
    with pytest.raises(RuntimeError, match="method 'forward': its program was closed"):
        method(*args)
    with pytest.raises(RuntimeError, match="program was closed"):
        program.load_method("forward")
    with pytest.raises(RuntimeError, match="program was closed"):
        program.reset_state()
    program.close()  # again: nothing left to free


@pytest.mark.parametrize("alloc_input,alloc_output", [(False, True), (True, False), (False, False)])
def test_unplanned_graph_inputs_and_outputs(alloc_input, alloc_output):
    model, args = _mlp()
    cfg = td.PropagateDeviceConfig(skip_h2d_for_constants=True, skip_d2h_for_method_outputs=True)
    lowered = _lower(model, args, propagate_device=cfg, alloc_graph_input=alloc_input, alloc_graph_output=alloc_output)
    method_ir = lowered.program.methods[0]
    x_copy = next(v for v in method_ir.values if v.name == "x@cuda:0")
    out = method_ir.values[method_ir.outputs[0]]
    assert (x_copy.arena >= 0) == alloc_input and (out.arena >= 0) == alloc_output
    planned = lowered.load(devices="simulated")
    allocator = planned.allocators["cuda"]
    method = planned.load_method()
    before = allocator.allocations
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(method(*args), model(*args))
    # What is not planned is allocated on each call: one buffer per unplanned value.
    assert allocator.allocations - before == 2 * ((not alloc_input) + (not alloc_output))


def test_graphs_replay_recorded_launches_with_new_inputs():
    model, args = _mlp()
    lowered = _lower(model, args)
    method = lowered.load(devices="simulated").load_method(graphs=True)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(3, 16)
            torch.testing.assert_close(method(x), model(x))
            # Recorded on the second call, replayed from the third: new inputs reach it through the arena.
            assert method.stats.graph_replays_per_call == (1 if i >= 2 else 0)


def test_graphs_skip_delegates_that_read_caller_memory():
    model, args = _mlp()
    cfg = td.PropagateDeviceConfig(skip_h2d_for_constants=True, skip_h2d_for_method_inputs=True)
    method = _lower(model, args, propagate_device=cfg).load(devices="simulated").load_method(graphs=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 16)
            torch.testing.assert_close(method(x), model(x))
    assert method.stats.graph_replays_per_call == 0


def test_launch_plans_that_do_not_fit_their_kernel_are_program_errors():
    import copy as copy_module

    model, args = _mlp()
    lowered = _lower(model, args)
    broken = copy_module.deepcopy(lowered.program)
    broken.methods[0].delegates[0].plan.launches[0].args.pop()
    with pytest.raises(td.ProgramError, match="does not fit the kernel's parameters"):
        td.LoweredProgram(broken, lowered.constant_data, lowered.reports).load(devices="simulated").load_method()
    broken = copy_module.deepcopy(lowered.program)
    broken.methods[0].delegates[0].plan.launches[0].kernel = "no_such_kernel"
    with pytest.raises(td.ProgramError, match="no_such_kernel"):
        td.LoweredProgram(broken, lowered.constant_data, lowered.reports).load(devices="simulated").load_method()
    broken = copy_module.deepcopy(lowered.program)
    host = next(i for i in broken.methods[0].instructions if i.kind.name == "COPY_H2D")
    host.kind, host.target = type(host.kind).HOST_OP, "os::system"
    with pytest.raises(td.ProgramError, match="not an ATen operator"):
        td.LoweredProgram(broken, lowered.constant_data, lowered.reports).load(devices="simulated").load_method()


def test_registered_allocator_is_used_by_auto(saved, monkeypatch):
    from tritondelegate.runtime import allocator as allocator_module

    monkeypatch.setattr(allocator_module, "_REGISTRY", {})
    mine = SimulatedAllocator()
    td.register_allocator("CUDA", mine)
    model, args, path = saved
    method = td.load(path).load_method()
    assert mine.allocations == 2  # arena and constants segment
    with torch.no_grad():
        torch.testing.assert_close(method(*args), model(*args))
    with pytest.raises(TypeError, match="needs a DeviceAllocator"):
        td.register_allocator("cuda", object())
