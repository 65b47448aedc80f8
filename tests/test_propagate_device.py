"""Device propagation: copies, skip flags, resident constants, warnings. Every case also runs end to end
on the simulated device and matches eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import tritondelegate as td
from harness import on_host
from tritondelegate.program import InstrKind

aten = torch.ops.aten


class OpPartitioner(td.Partitioner):
    """Puts the i-th node calling ``op`` into its own delegate on ``devices[i]`` (None: leave on host)."""

    def __init__(self, op, devices):
        self.op, self.devices = op, devices

    def partition(self, ep):
        tags, specs = {}, {}
        nodes = [n for n in ep.graph_module.graph.nodes if n.op == "call_function" and n.target == self.op]
        for i, (node, device) in enumerate(zip(nodes, self.devices)):
            if device is not None:
                tags[node.name] = f"d{i}"
                specs[f"d{i}"] = td.DelegationSpec("TritonBackend", device)
        return td.PartitionResult(tags, specs)


def lower(model, args, partitioner, cfg=None, lower_config=None, expect_warnings=None):
    ep = torch.export.export(model, args)
    config = lower_config or td.LowerConfig(propagate_device=cfg or td.PropagateDeviceConfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = td.lower(ep, partitioner=partitioner, config=config)
    messages = [str(w.message) for w in caught if issubclass(w.category, td.PerCallCopyWarning)]
    return lowered, messages


def copies(lowered, method="forward"):
    return sorted((c.direction, c.value, c.device) for c in lowered.reports[method].device.copies)


def resident(lowered, method="forward"):
    return sorted((name, device) for name, device, _ in lowered.reports[method].device.resident)


def run_and_check(lowered, model, args, method="forward", device_args=None):
    program = lowered.load(devices="simulated")
    loaded = program.load_method(method)
    for _ in range(2):  # twice: resident constants must still be right on the second call
        out = loaded(*(device_args or args))
        expected = model(*args)
        torch.testing.assert_close(out, expected)
    return loaded


class Add(torch.nn.Module):
    def forward(self, a, b):
        return a + b


ARGS2 = (torch.randn(4, 5), torch.randn(4, 5))


def test_add_on_cuda0_copies_two_inputs_in_and_the_output_out():
    lowered, _ = lower(Add(), ARGS2, OpPartitioner(aten.add.Tensor, ["cuda:0"]))
    assert copies(lowered) == [("d2h", "d0.out0", "cuda:0"), ("h2d", "a", "cuda:0"), ("h2d", "b", "cuda:0")]
    loaded = run_and_check(lowered, Add(), ARGS2)
    assert loaded.stats.call_h2d_bytes == 2 * 4 * 5 * 4
    assert loaded.stats.call_d2h_bytes == 4 * 5 * 4


def test_no_device_no_copies():
    lowered, _ = lower(Add(), ARGS2, OpPartitioner(aten.add.Tensor, [None]))
    assert copies(lowered) == []
    assert lowered.program.methods[0].arenas == []
    loaded = run_and_check(lowered, Add(), ARGS2)
    assert loaded.stats.call_h2d_bytes == 0 and loaded.stats.launches_per_call == 0


class Chain(torch.nn.Module):
    def forward(self, a, b, c):
        return (a + b) + c


ARGS3 = (torch.randn(3, 7), torch.randn(3, 7), torch.randn(3, 7))


def test_two_chained_delegates_on_one_device_read_each_other_directly():
    lowered, _ = lower(Chain(), ARGS3, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]))
    assert copies(lowered) == [
        ("d2h", "d1.out0", "cuda:0"), ("h2d", "a", "cuda:0"), ("h2d", "b", "cuda:0"), ("h2d", "c", "cuda:0"),
    ]
    method = lowered.program.methods[0]
    kinds = [i.kind for i in method.instructions]
    assert kinds.count(InstrKind.DELEGATE) == 2 and kinds.count(InstrKind.COPY_D2H) == 1
    run_and_check(lowered, Chain(), ARGS3)


def test_cross_device_bounce_stays():
    lowered, _ = lower(Chain(), ARGS3, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:1"]))
    assert copies(lowered) == [
        ("d2h", "d0.out0", "cuda:0"), ("d2h", "d1.out0", "cuda:1"),
        ("h2d", "a", "cuda:0"), ("h2d", "b", "cuda:0"), ("h2d", "c", "cuda:1"), ("h2d", "d0.out0", "cuda:1"),
    ]
    assert sorted(a.device for a in lowered.program.methods[0].arenas) == ["cuda:0", "cuda:1"]
    run_and_check(lowered, Chain(), ARGS3)


class Fan(torch.nn.Module):
    def forward(self, a, b):
        x = a + b
        return x + 1, x + 2, on_host(x)


def test_delegate_output_read_by_two_same_device_delegates_and_a_host_op():
    lowered, _ = lower(Fan(), ARGS2, OpPartitioner(aten.add.Tensor, ["cuda:0"] * 3))
    got = copies(lowered)
    # x goes to the host once, for the host op; the two delegates read it where it is.
    assert ("d2h", "d0.out0", "cuda:0") in got
    assert not [c for c in got if c[0] == "h2d" and c[1].startswith("d0")]
    assert sorted(c for c in got if c[0] == "h2d") == [("h2d", "a", "cuda:0"), ("h2d", "b", "cuda:0")]
    run_and_check(lowered, Fan(), ARGS2)


@pytest.mark.parametrize("inputs,outputs", [(True, False), (False, True), (True, True)])
def test_skip_flags(inputs, outputs):
    cfg = td.PropagateDeviceConfig(skip_h2d_for_method_inputs=inputs, skip_d2h_for_method_outputs=outputs)
    lowered, _ = lower(Add(), ARGS2, OpPartitioner(aten.add.Tensor, ["cuda:0"]), cfg)
    expected = []
    if not outputs:
        expected.append(("d2h", "d0.out0", "cuda:0"))
    if not inputs:
        expected += [("h2d", "a", "cuda:0"), ("h2d", "b", "cuda:0")]
    assert copies(lowered) == expected
    loaded = run_and_check(lowered, Add(), ARGS2)
    assert loaded.stats.call_h2d_bytes == (0 if inputs else 160)
    assert loaded.stats.call_d2h_bytes == (0 if outputs else 80)
    # Device outputs come back without a synchronization; a host output needs one.
    assert loaded.stats.synchronizations_per_call == (0 if outputs else 1)


class HostFirst(torch.nn.Module):
    def forward(self, a, b):
        return on_host(a) + b


def test_input_through_a_host_op_is_still_copied():
    cfg = td.PropagateDeviceConfig(skip_h2d_for_method_inputs=True)
    lowered, _ = lower(HostFirst(), ARGS2, OpPartitioner(aten.add.Tensor, ["cuda:0"]), cfg)
    got = copies(lowered)
    assert ("h2d", "flip", "cuda:0") in got  # the host op's result is copied
    assert ("h2d", "b", "cuda:0") not in got  # b is read only by the delegate: skipped
    run_and_check(lowered, HostFirst(), ARGS2)


class Consts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5))
        self.register_buffer("buf", torch.randn(4, 5))
        self.lifted = torch.randn(4, 5)  # a plain tensor attribute: a lifted tensor constant

    def forward(self, x):
        return ((x + self.w) + self.buf) + self.lifted


ARGS1 = (torch.randn(4, 5),)
RESIDENT = td.PropagateDeviceConfig(skip_h2d_for_constants=True)


def test_resident_constants_of_each_kind():
    model = Consts()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"] * 3), RESIDENT)
    assert resident(lowered) == [("buf", "cuda:0"), ("lifted", "cuda:0"), ("w", "cuda:0")]
    assert messages == []
    # skip_h2d_for_constants alone: the input is still copied.
    assert copies(lowered) == [("d2h", "d2.out0", "cuda:0"), ("h2d", "x", "cuda:0")]
    loaded = run_and_check(lowered, model, ARGS1)
    assert loaded.stats.load_h2d_bytes == 3 * 80
    assert loaded.stats.call_h2d_bytes == 80  # x only


def test_option_off_copies_constants_and_hints():
    model = Consts()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"] * 3))
    assert resident(lowered) == []
    assert len(messages) == 3
    for name in ("w", "buf", "lifted"):
        (msg,) = [m for m in messages if f"constant {name!r}" in m]
        assert "cuda:0" in msg and "skip_h2d_for_constants=True" in msg
    run_and_check(lowered, model, ARGS1)


class SharedWithHost(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        return x + self.w, on_host(self.w)


def test_constant_also_read_by_a_host_op_is_copied_without_hint():
    model = SharedWithHost()
    # flip(w) reads no input: constant folding would compute it once in lower(); here it must run.
    config = td.LowerConfig(propagate_device=RESIDENT, fold_constants=False)
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"]), lower_config=config)
    assert resident(lowered) == []
    assert ("h2d", "w", "cuda:0") in copies(lowered)
    (msg,) = messages
    assert "'w'" in msg and "host op 'flip'" in msg and "aten::flip" in msg
    assert "skip_h2d_for_constants=True" not in msg  # the option would not help
    run_and_check(lowered, model, ARGS1)


class TwoReaders(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        return (x + self.w) + self.w


def test_constant_read_by_delegates_on_two_devices_is_copied_to_each():
    model = TwoReaders()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:1"]), RESIDENT)
    assert resident(lowered) == []
    assert ("h2d", "w", "cuda:0") in copies(lowered) and ("h2d", "w", "cuda:1") in copies(lowered)
    assert len(messages) == 2
    to0 = next(m for m in messages if "copied to cuda:0" in m)
    assert "delegate 'd1' on cuda:1" in to0
    to1 = next(m for m in messages if "copied to cuda:1" in m)
    assert "delegate 'd0' on cuda:0" in to1
    assert all("skip_h2d_for_constants=True" not in m for m in messages)
    run_and_check(lowered, model, ARGS1)


def test_constant_read_by_two_delegates_on_one_device_is_resident():
    model = TwoReaders()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]), RESIDENT)
    assert resident(lowered) == [("w", "cuda:0")]
    assert messages == []
    loaded = run_and_check(lowered, model, ARGS1)
    assert loaded.stats.load_h2d_bytes == 80 and loaded.stats.call_h2d_bytes == 80


class Returns(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        return x + self.w, self.w


def test_returned_constant_is_copied_and_says_so():
    model = Returns()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"]), RESIDENT)
    assert resident(lowered) == []
    (msg,) = messages
    assert "the method returns it" in msg and "skip_h2d_for_constants=True" not in msg
    loaded = lowered.load(devices="simulated").load_method()
    out = loaded(*ARGS1)
    out[1].add_(1)  # the returned constant is the caller's own copy
    torch.testing.assert_close(loaded(*ARGS1)[1], model.w.detach())


def test_error_on_per_call_copies_raises_for_constants_only():
    cfg = td.PropagateDeviceConfig(error_on_per_call_copies=True)
    with pytest.raises(td.PerCallCopyError, match="constant 'w'.*skip_h2d_for_constants=True"):
        lower(TwoReaders(), ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]), cfg)
    # Input copies never raise.
    lowered, _ = lower(Add(), ARGS2, OpPartitioner(aten.add.Tensor, ["cuda:0"]), cfg)
    assert ("h2d", "a", "cuda:0") in copies(lowered)
    # skip_h2d_for_constants without skip_h2d_for_method_inputs: a constant still copied raises.
    cfg = td.PropagateDeviceConfig(skip_h2d_for_constants=True, error_on_per_call_copies=True)
    with pytest.raises(td.PerCallCopyError, match="host op 'flip'"):
        lower(SharedWithHost(), ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"]),
              lower_config=td.LowerConfig(propagate_device=cfg, fold_constants=False))


def test_per_method_configs_in_a_two_method_program():
    model = TwoReaders()
    ep = torch.export.export(model, ARGS1)
    config = td.LowerConfig(propagate_device={"decode": RESIDENT})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower({"prefill": ep, "decode": ep},
                           partitioner=OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]), config=config)
    assert resident(lowered, "decode") == [("w", "cuda:0")]
    assert resident(lowered, "prefill") == []
    assert ("h2d", "w", "cuda:0") in copies(lowered, "prefill")
    assert len(lowered.program.constants) == 1  # stored once for both methods
    for name in ("prefill", "decode"):
        run_and_check(lowered, model, ARGS1, method=name)
    flag_config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants={"decode": True}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower({"prefill": ep, "decode": ep},
                           partitioner=OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]), config=flag_config)
    assert resident(lowered, "decode") == [("w", "cuda:0")] and resident(lowered, "prefill") == []


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(4, 5))

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


def test_mutated_buffer_is_never_resident_and_runs_correctly():
    model = Counter()
    lowered, _ = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0", "cuda:0"]), RESIDENT)
    assert resident(lowered) == []
    loaded = lowered.load(devices="simulated").load_method()
    reference = Counter()
    for _ in range(3):
        torch.testing.assert_close(loaded(*ARGS1), reference(*ARGS1))


def test_planning_off_stages_inside_the_delegate_and_rejects_skip_flags():
    ep = torch.export.export(Consts(), ARGS1)
    for flag in ("skip_h2d_for_method_inputs", "skip_d2h_for_method_outputs", "skip_h2d_for_constants"):
        config = td.LowerConfig(enable_non_cpu_memory_planning=False,
                                propagate_device=td.PropagateDeviceConfig(**{flag: True}))
        with pytest.raises(ValueError, match=f"{flag}.*enable_non_cpu_memory_planning=False"):
            td.lower(ep, partitioner=OpPartitioner(aten.add.Tensor, ["cuda:0"] * 3), config=config)
    model = Consts()
    lowered, messages = lower(model, ARGS1, OpPartitioner(aten.add.Tensor, ["cuda:0"] * 3),
                              lower_config=td.LowerConfig(enable_non_cpu_memory_planning=False))
    assert lowered.program.methods[0].arenas == []
    assert all(d.stage_inputs for d in lowered.program.methods[0].delegates)
    assert len(messages) == 3 and all("enable_non_cpu_memory_planning=False" in m for m in messages)
    loaded = run_and_check(lowered, model, ARGS1)
    assert loaded.stats.call_h2d_bytes == 6 * 80  # each delegate copies its two inputs in


def test_device_strings():
    assert td.DelegationSpec("TritonBackend", "CUDA").device == "cuda:0"
    assert td.TritonPartitioner(device="Cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="unknown device type 'tpu'.*cpu, cuda"):
        td.TritonPartitioner(device="tpu:0")
    with pytest.raises(ValueError, match="non-negative integer"):
        td.DelegationSpec("TritonBackend", "cuda:x")
