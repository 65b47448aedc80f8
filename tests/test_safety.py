"""A program file is untrusted input: a file whose structure is sound but whose contents are not (crafted,
or damaged and re-sealed) is a ProgramError naming what is wrong, never another exception, a wrong
answer, an error that blames the caller, an op that touches files, or data that does not match its
checksum."""

from __future__ import annotations

import copy
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from safetensors.torch import load_file, save_file

import tritondelegate as td
from tritondelegate.plan import Arg, KernelArgKind
from tritondelegate.program import (Arena, Constant, HostArg, HostArgKind, InstrKind, Instruction, Method,
                                    Program, Role, TensorValue)
from tritondelegate.errors import ProgramError
from tritondelegate.runtime.host_ops import resolve_op
from tritondelegate.serialize import header as hdr
from tritondelegate.serialize import load_program, save_program


def _dump(tree) -> str:
    return pytree.treespec_dumps(pytree.tree_flatten(tree)[1])


class Tiny(torch.nn.Module):
    """Two linears, softmax, a scale buffer and a cumsum: one delegate of several launches."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        return (torch.softmax(self.l2(h), dim=-1) * self.scale).cumsum(-1), h.sum(0)


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The lowered Tiny model saved twice: constants in the file, and in an external weights file."""
    torch.manual_seed(0)
    model = Tiny().eval()
    folder = tmp_path_factory.mktemp("tiny")
    ep = torch.export.export(model, (X,))
    resident = td.PropagateDeviceConfig(skip_h2d_for_constants=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        td.lower(ep, config=td.LowerConfig(propagate_device=resident)).save(folder / "tiny.tdp")
        external = td.LowerConfig(propagate_device=resident, external_constants=True)
        (folder / "ext").mkdir()
        td.lower(ep, config=external).save(folder / "ext" / "tiny.tdp")
    return folder, model


def _run(path: Path, x=X):
    method = td.load(path, devices="simulated").load_method()
    return method(x)


def _craft(source: Path, target: Path, edit) -> Path:
    """``source``'s program with ``edit(program)`` applied, written by the writer (so its checksums are
    right and only the edit is wrong)."""
    with load_program(source) as pf:
        program = copy.deepcopy(pf.program)
        data = [pf.constant_tensor(i).clone() for i in range(len(program.constants))]
    edit(program)
    save_program(program, data, target)
    return target


def _value(program: Program, name: str) -> TensorValue:
    return next(v for v in program.methods[0].values if v.name == name)


def _set_spec(field: str, text: str):
    return lambda p: setattr(p.methods[0], field, text)


def _first_copy(program: Program) -> Instruction:
    return next(i for i in program.methods[0].instructions if i.kind == InstrKind.COPY_H2D)


def _input_shape(program: Program, shape: tuple) -> None:
    value = program.methods[0].values[program.methods[0].inputs[0]]
    value.shape, value.nbytes = shape, math.prod(shape) * 4


def _tensor_arg_to_int(program: Program) -> None:
    launch = program.methods[0].delegates[0].plan.launches[0]
    k = next(k for k, a in enumerate(launch.args) if a.kind == KernelArgKind.TENSOR)
    launch.args[k] = Arg(KernelArgKind.INT, 0)


def _constexpr(program: Program, kernel: str, name: str, value) -> None:
    launch = next(l for l in program.methods[0].delegates[0].plan.launches if l.kernel == kernel)
    launch.constexprs[name] = Arg(KernelArgKind.INT, value)


CRAFTED = [
    ("input spec not json", _set_spec("input_spec", "{"), r"input spec does not parse \(JSONDecodeError"),
    ("input spec without context", _set_spec("input_spec", '[1, {"type": "builtins.tuple"}]'),
     r"input spec does not parse \(KeyError"),
    ("input spec of an unknown type", _set_spec("input_spec", '[1, {"type": "os.system", "context": "null", '
                                                '"children_spec": []}]'), r"does not parse \(NotImplementedError"),
    ("input spec not (args, kwargs)", _set_spec("input_spec", _dump((0,))), r"input spec is not \(args, kwargs\)"),
    ("output spec with another leaf count", _set_spec("output_spec", _dump((0, 0, 0))),
     "output spec has 3 leaves for 2 outputs"),
    ("nbytes that disagree with the shape", lambda p: setattr(_value(p, "x@cuda:0"), "nbytes", 100),
     r"records 100 bytes, but float32\[3, 8\] has 96"),
    ("arena alignment 0", lambda p: setattr(p.methods[0].arenas[0], "alignment", 0),
     "alignment 0, not a power of two"),
    ("an arena larger than what lies in it", lambda p: setattr(p.methods[0].arenas[0], "nbytes", 2**42),
     "arena 0 has 4398046511104 bytes; what lies in it needs"),
    ("segment alignment 2**40", lambda p: setattr(p.segments[0], "alignment", 2**40), "not a power of two up to"),
    ("a copy in the wrong direction", lambda p: setattr(_first_copy(p), "kind", InstrKind.COPY_D2H),
     r"a COPY_D2H copy from float32\[3, 8\] on cpu to float32\[3, 8\] on cuda:0"),
    ("a device value moved to the host", lambda p: setattr(_value(p, "x@cuda:0"), "device", "cpu"),
     r"value \d+ \('x@cuda:0'\) on cpu at offset \d+ \(96 bytes\) does not fit arena 0 on cuda:0"),
    ("a non-canonical device", lambda p: setattr(_value(p, "x@cuda:0"), "device", "CUDA:0"),
     "has device 'CUDA:0', not a device such as"),
    ("the input's shape", lambda p: _input_shape(p, (3, 9)), r"COPY_H2D copy from float32\[3, 9\] on cpu"),
    ("a copy from the host to the host",
     lambda p: setattr(_first_copy(p), "outputs", [p.methods[0].outputs[0]]),
     r"a COPY_H2D copy from float32\[3, 8\] on cpu to float32\[3, 8\] on cpu"),
    ("a read before the write", lambda p: p.methods[0].instructions.reverse(),
     r"reads value \d+ \('triton_0.out1'\) before anything writes it"),
    ("an instruction that writes a constant",
     lambda p: setattr(_first_copy(p), "outputs", [next(j for j, v in enumerate(p.methods[0].values)
                                                        if v.role == Role.CONSTANT)]),
     r"writes value 0 \('l1.weight'\), a constant"),
    ("a scratch block without an arena", lambda p: setattr(p.methods[0].delegates[0], "scratch_arena", -1),
     r"delegate 0 needs \d+ scratch bytes but has no scratch arena"),
]


@pytest.mark.parametrize("name, edit, match", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_file_is_a_program_error_at_load(tiny, tmp_path, name, edit, match):
    folder, _ = tiny
    path = _craft(folder / "tiny.tdp", tmp_path / "crafted.tdp", edit)
    with pytest.raises(ProgramError, match=match):
        _run(path)


@pytest.mark.parametrize("edit", [_tensor_arg_to_int, lambda p: _constexpr(p, "softmax", "BLOCK_C", 3),
                                  lambda p: _constexpr(p, "matmul", "BLOCK_K", 0)],
                         ids=["tensor argument as an int", "softmax BLOCK_C 3", "matmul BLOCK_K 0"])
def test_launch_arguments_that_do_not_fit_the_kernel_are_program_errors(tiny, tmp_path, edit):
    """Refused at load by the plan checks, or, at the latest, when the launch fails: a ProgramError
    either way, never the interpreter's error, and the next load of a good file still runs."""
    folder, model = tiny
    path = _craft(folder / "tiny.tdp", tmp_path / "crafted.tdp", edit)
    with pytest.raises(ProgramError):
        _run(path)
    with torch.no_grad():
        for got, want in zip(_run(folder / "tiny.tdp"), model(X)):
            torch.testing.assert_close(got, want)


# -------------------------------------------------------------------------------------------------
# Checksums of constant data


def _flip_constant_byte(path: Path, index: int) -> None:
    with load_program(path) as pf:
        start = pf.data_offset + pf.program.constants[index].data_offset
    raw = bytearray(path.read_bytes())
    raw[start + 1] ^= 0x40
    path.write_bytes(bytes(raw))


def test_damaged_resident_constant_is_caught_at_load(tiny, tmp_path):
    folder, _ = tiny
    path = tmp_path / "damaged.tdp"
    path.write_bytes((folder / "tiny.tdp").read_bytes())
    with load_program(path) as pf:
        slot = next(s for s in pf.program.slots if not s.state)
        name = pf.program.constants[slot.constant].name
    _flip_constant_byte(path, slot.constant)
    program = td.load(path, devices="simulated")
    with pytest.raises(ProgramError, match=rf"constant {slot.constant} \('{name}'\): its bytes in the program "
                                           "file's data segment do not match the checksum"):
        program.load_method()


def _external_copy(folder: Path, tmp_path: Path) -> Path:
    for f in (folder / "ext").iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path / "tiny.tdp"


def test_swapped_external_tensors_of_one_shape_are_caught(tiny, tmp_path):
    folder, model = tiny
    path = _external_copy(folder, tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(weights)
    assert tensors["l2.bias"].shape == tensors["scale"].shape
    with torch.no_grad():  # the good file runs right
        for got, want in zip(_run(path), model(X)):
            torch.testing.assert_close(got, want)
    tensors["l2.bias"], tensors["scale"] = tensors["scale"], tensors["l2.bias"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ProgramError, match=r"constant \d+ \('(l2.bias|scale)'\): its bytes in .*tiny.weights."
                                           r"safetensors.* do not match the checksum"):
        _run(path)


def test_damaged_external_tensor_is_caught(tiny, tmp_path):
    folder, _ = tiny
    path = _external_copy(folder, tmp_path)
    weights = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["l1.weight"][2, 3] += 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ProgramError, match=r"\('l1.weight'\): its bytes .* do not match the checksum"):
        _run(path)


# -------------------------------------------------------------------------------------------------
# Hand-made programs: host ops, and a plan too large to allocate

N = 16


def _host_program(target: str, args: list[HostArg], shape=(N,), arena: bool = False) -> tuple[Program, list]:
    """``out = target(*args)`` on the host; value 0 is the input ``x``, value 1 the constant ``w``. With
    ``arena``, ``x`` goes through a device arena first (the program then needs ``x``'s bytes there)."""
    nbytes = math.prod(shape) * 4
    values = [TensorValue("x", "float32", shape, "cpu", Role.INPUT, nbytes),
              TensorValue("w", "float32", (N,), "cpu", Role.CONSTANT, 4 * N, constant=0),
              TensorValue("out", "float32", shape, "cpu", Role.INTERMEDIATE, nbytes)]
    instructions = [Instruction(InstrKind.HOST_OP, [0, 1], [2], target=target, args=args, name="op")]
    arenas = []
    if arena:
        values.append(TensorValue("x_dev", "float32", shape, "cuda:0", Role.INTERMEDIATE, nbytes, arena=0))
        instructions.insert(0, Instruction(InstrKind.COPY_H2D, [0], [3], name="h2d"))
        arenas = [Arena("cuda:0", nbytes, 256, nbytes)]
    method = Method("forward", values, [0], [2], _dump(((0,), {})), _dump((0,)), instructions, [], arenas)
    return Program([method], [Constant("w", "float32", (N,), 4 * N)]), [torch.randn(N)]


MUL = [HostArg(HostArgKind.TENSOR, 0), HostArg(HostArgKind.TENSOR, 1)]


def test_hand_made_program_runs(tmp_path):
    program, data = _host_program("aten::mul.Tensor", MUL)
    save_program(program, data, tmp_path / "p.tdp")
    x = torch.randn(N)
    assert torch.equal(_run(tmp_path / "p.tdp", x)[0], x * data[0])


@pytest.mark.parametrize("target, args, match", [
    ("aten::from_file", [HostArg(HostArgKind.STR, "/etc/passwd")], "not allowed in a program: it takes a file name"),
    ("aten::from_file.out", [HostArg(HostArgKind.STR, "/etc/passwd"), HostArg(HostArgKind.TENSOR, 1, "out")],
     "takes a file name"),
    ("aten::_print", [HostArg(HostArgKind.STR, "hello")], "returns nothing and writes no tensor"),
    ("aten::__dict__.clear", [], "not an operator this PyTorch knows"),
    ("aten::add.__class__", MUL, "not an operator this PyTorch knows"),
    ("aten::save", MUL, "not an operator this PyTorch knows"),  # a TorchScript builtin, not an ATen op
    ("aten::mul.Tensor.x", MUL, "not an operator this PyTorch knows"),
    ("aten::mul.Tensor ", MUL, "not an operator this PyTorch knows"),
    ("builtins::eval", MUL, "not an ATen operator"),
])
def test_host_ops_are_real_aten_ops_that_touch_no_files(tmp_path, target, args, match):
    program, data = _host_program(target, args)
    save_program(program, data, tmp_path / "p.tdp")
    loaded = td.load(tmp_path / "p.tdp", devices="simulated")
    with pytest.raises(ProgramError, match=f"host op {re.escape(repr(target))} is .*{match}"):
        loaded.load_method()


def test_the_deny_rule_is_read_from_schemas():
    """Every ATen op with a file-name argument is refused, and ordinary ops (functional, in-place, out=,
    dunder names, size queries) resolve."""
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::from_file"):
            with pytest.raises(ProgramError, match="takes a file name"):
                resolve_op(name)
    for target in ("aten::add.Tensor", "aten::add_.Tensor", "aten::add.out", "aten::__and__.Tensor",
                   "aten::sym_size.int", "aten::_to_copy", "aten::relu", "aten::relu.default", "aten::copy_"):
        assert isinstance(resolve_op(target), torch._ops.OpOverload), target


def test_a_host_op_that_fails_on_valid_inputs_is_a_program_error(tmp_path):
    """A program whose host op cannot run on the inputs it declares fails as the file's fault."""
    program, data = _host_program("aten::mm", MUL)  # mm of two vectors
    save_program(program, data, tmp_path / "p.tdp")
    method = td.load(tmp_path / "p.tdp", devices="simulated").load_method()
    with pytest.raises(ProgramError, match=r"instruction 0 \('op'\) failed with RuntimeError.*program is inconsistent"):
        method(torch.randn(N))
    with pytest.raises(td.InputError):  # a wrong input is still the caller's
        method(torch.randn(N + 1))


def test_a_plan_too_large_to_allocate_is_a_program_error(tmp_path):
    """A self-consistent program whose arena needs 2**40 floats: refused when the arena is allocated."""
    shape = (2**40,)
    program, data = _host_program("aten::mul.Tensor", MUL, shape=shape, arena=True)
    save_program(program, data, tmp_path / "p.tdp")
    loaded = td.load(tmp_path / "p.tdp", devices="simulated")
    with pytest.raises(ProgramError, match=r"method 'forward' needs 4398046511104 bytes on cuda:0, which cannot be "
                                           "allocated"):
        loaded.load_method()


def test_damaged_host_constant_is_caught_when_first_read(tmp_path):
    program, data = _host_program("aten::mul.Tensor", MUL)
    path = tmp_path / "p.tdp"
    save_program(program, data, path)
    _flip_constant_byte(path, 0)
    loaded = td.load(path, devices="simulated")  # the structure is fine: the bytes are read later
    with pytest.raises(ProgramError, match=r"constant 0 \('w'\): its bytes .* do not match the checksum"):
        loaded.load_method()


def test_checksum_is_of_the_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert hdr.checksum(t) == hdr.checksum(t.t().contiguous().t()) == hdr.checksum(t.view(torch.uint8))
    assert hdr.checksum(t) != hdr.checksum(t.t().contiguous())  # the same values in another order
    assert hdr.checksum(torch.zeros(4)) != hdr.checksum(torch.zeros(5))
