"""The program file format: round trips, constants stored once, external safetensors data, and
robustness against damaged files (every failure a ProgramError, never a crash, a hang or a wrong answer).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import random
import struct
import zlib
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from safetensors.torch import load_file, save_file

from tritondelegate.dtypes import dtype_name, parse_dtype
from tritondelegate.plan import Arg, Base, DelegatePlan, KernelArgKind, Launch, TensorDesc
from tritondelegate.program import (FORMAT_VERSION, Segment, SegmentKind, Slot, Arena, Constant, Delegate,
                                    HostArg, HostArgKind, InstrKind, Instruction, KernelBinary, Method,
                                    Program, Role, Symbol, TensorValue, align_up)
from tritondelegate.errors import ProgramError
from tritondelegate.serialize import header as hdr
from tritondelegate.serialize import load_program, save_program, writer
from tritondelegate.serialize.reader import ProgramFile
from tritondelegate.serialize.validate import check_program
from tritondelegate.symbolic import Expr, any_symbolic


def _const(name: str, t: torch.Tensor, external: int = -1) -> Constant:
    return Constant(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), external=external)


def _value(name, t_or_spec, role, device="cpu", **kw) -> TensorValue:
    dtype, shape = t_or_spec
    nbytes = math.prod(shape) * parse_dtype(dtype).itemsize
    return TensorValue(name, dtype, tuple(shape), device, role, nbytes, **kw)


def _specs(n_inputs: int, n_outputs: int) -> dict:
    """The input and output pytree specs of a method with these many tensor inputs and outputs."""
    dump = lambda tree: pytree.treespec_dumps(pytree.tree_flatten(tree)[1])  # noqa: E731
    return {"input_spec": dump((tuple(range(n_inputs)), {})), "output_spec": dump(tuple(range(n_outputs)))}


def _plan() -> DelegatePlan:
    return DelegatePlan(
        tensors=[
            TensorDesc(Base.INPUT, 0, 0, "float32", (4, 3), (3, 1)),
            TensorDesc(Base.INPUT, 1, 8, "bfloat16", (3,), (1,)),
            TensorDesc(Base.OUTPUT, 0, 0, "float32", (3, 4), (1, 3)),
            TensorDesc(Base.SCRATCH, 0, 256, "float32", (0, 5), (5, 1)),
        ],
        launches=[
            Launch("add_kernel", (2, 1, 1),
                   [Arg(KernelArgKind.TENSOR, 0), Arg(KernelArgKind.TENSOR, 2), Arg(KernelArgKind.INT, -(2**40)),
                    Arg(KernelArgKind.FLOAT, 0.25), Arg(KernelArgKind.BOOL, True), Arg(KernelArgKind.STR, "rn")],
                   {"BLOCK": Arg(KernelArgKind.INT, 128), "SCALE": Arg(KernelArgKind.FLOAT, -1.5),
                    "EVEN": Arg(KernelArgKind.BOOL, False), "MODE": Arg(KernelArgKind.STR, "ieee"),
                    "EXTRA": Arg(KernelArgKind.TENSOR, 3)},
                   op="aten::add.Tensor", bytes_read=2**40, bytes_written=96, flops=12),
            Launch("copy_kernel", (7,), [Arg(KernelArgKind.TENSOR, 1)], {}, op=""),
        ],
        scratch_bytes=512,
        input_nbytes=[48, 48],
        output_nbytes=[48],
    )


def _all_host_args() -> list[HostArg]:
    return [
        HostArg(HostArgKind.TENSOR, 0),
        HostArg(HostArgKind.NONE, None, "out"),
        HostArg(HostArgKind.INT, -(2**62), "dim"),
        HostArg(HostArgKind.FLOAT, float("-inf")),
        HostArg(HostArgKind.BOOL, True, "keepdim"),
        HostArg(HostArgKind.STR, "tanh", "approximate"),
        HostArg(HostArgKind.INT_LIST, [1, -1, 0]),
        HostArg(HostArgKind.INT_LIST, []),
        HostArg(HostArgKind.FLOAT_LIST, [0.5, 1e300]),
        HostArg(HostArgKind.TENSOR_LIST, [1, -1, 2]),
        HostArg(HostArgKind.DTYPE, "bfloat16", "dtype"),
        HostArg(HostArgKind.DEVICE, "cuda:1", "device"),
        HostArg(HostArgKind.MEMORY_FORMAT, "contiguous_format", "memory_format"),
        HostArg(HostArgKind.LAYOUT, "strided", "layout"),
        HostArg(HostArgKind.BOOL_LIST, [True, False, True]),
    ]


def _example() -> tuple[Program, list[torch.Tensor]]:
    """Two methods sharing constants; in-file, zero-byte and external (bf16 too) constants."""
    data = [
        torch.randn(4, 3),  # 0 w: read by both methods
        torch.randn(3).to(torch.bfloat16),  # 1 b: read by both methods
        torch.empty(0, 5),  # 2 zero-byte
        torch.tensor(7, dtype=torch.int64),  # 3 0-dim
        torch.randn(2, 2).to(torch.bfloat16),  # 4 external file 0
        torch.randn(3),  # 5 external file 0
        torch.arange(5, dtype=torch.int8),  # 6 external file 1, in a subfolder
        torch.empty(0, dtype=torch.bfloat16),  # 7 external, zero-byte
        torch.tensor([True, False, True]),  # 8 bool
    ]
    names = ["layer.w", "layer.b", "empty", "buf", "ext.w", "ext.b", "ext2.idx", "ext.empty", "mask"]
    ext = {4: 0, 5: 0, 6: 1, 7: 0}
    constants = [_const(n, t, ext.get(i, -1)) for i, (n, t) in enumerate(zip(names, data))]

    forward = Method(
        name="forward",
        values=[
            _value("x", ("float32", (4, 3)), Role.INPUT),
            _value("layer.w", ("float32", (4, 3)), Role.CONSTANT, constant=0, slot=0,
                   device="cuda:0", resident=True),
            _value("layer.b", ("bfloat16", (3,)), Role.CONSTANT, constant=1),
            _value("x_dev", ("float32", (4, 3)), Role.INTERMEDIATE, device="cuda:0", arena=0, arena_offset=256),
            _value("y_dev", ("float32", (3, 4)), Role.INTERMEDIATE, device="cuda:0", arena=0, arena_offset=512),
            _value("y", ("float32", (3, 4)), Role.INTERMEDIATE),
            _value("buf", ("int64", ()), Role.MUTABLE_BUFFER, constant=3, slot=1),
            _value("buf_new", ("int64", ()), Role.INTERMEDIATE),
            _value("ext.w", ("bfloat16", (2, 2)), Role.CONSTANT, constant=4),
            _value("x_copy", ("float32", (4, 3)), Role.INTERMEDIATE),
        ],
        inputs=[0],
        outputs=[5, 8],
        **_specs(1, 2),
        instructions=[
            Instruction(InstrKind.COPY_H2D, [0], [3], name="h2d_x"),
            Instruction(InstrKind.DELEGATE, [3, 1], [4], delegate=0, name="delegate_0"),
            Instruction(InstrKind.COPY_D2H, [4], [5], name="d2h_y"),
            Instruction(InstrKind.HOST_OP, [0, 1, 2], [7], target="aten::add.Tensor", args=_all_host_args(),
                        name="add"),
            Instruction(InstrKind.COPY_D2H, [3], [9], name="d2h_x"),
        ],
        delegates=[Delegate("triton", "cuda:0", _plan(), scratch_arena=0, scratch_offset=1024,
                            stage_inputs=False)],
        arenas=[Arena("cuda:0", 1536, 256, 1500)],
        mutated_buffers=[(6, 7)],
    )
    decode = Method(
        name="decode",
        values=[
            _value("layer.w", ("float32", (4, 3)), Role.CONSTANT, constant=0),
            _value("layer.b", ("bfloat16", (3,)), Role.CONSTANT, constant=1),
            _value("empty", ("float32", (0, 5)), Role.CONSTANT, constant=2),
            _value("buf", ("int64", ()), Role.CONSTANT, constant=3),
            _value("ext.b", ("float32", (3,)), Role.CONSTANT, constant=5),
            _value("ext2.idx", ("int8", (5,)), Role.CONSTANT, constant=6),
            _value("mask", ("bool", (3,)), Role.CONSTANT, constant=8),
            _value("out", ("float32", (4, 3)), Role.INTERMEDIATE),
        ],
        inputs=[],
        outputs=[7],
        **_specs(0, 1),
        instructions=[Instruction(InstrKind.HOST_OP, [0, 1], [7], target="aten::mul.Tensor",
                                  args=[HostArg(HostArgKind.TENSOR, 0), HostArg(HostArgKind.TENSOR, 1)])],
        delegates=[],
        arenas=[],
    )
    program = Program([forward, decode, _dynamic_method()], constants, ["model.safetensors", "sub/more.safetensors"],
                      segments=[Segment("cuda:0", SegmentKind.CONSTANTS, 256, 256),
                                Segment("cuda:0", SegmentKind.STATE, 0, 256)],
                      slots=[Slot("layer.w", 0, "cuda:0", state=False, segment=0, offset=0),
                             Slot("buf", 3, "cpu", state=True)])
    return program, data


S0, S1 = Expr("s0", 16), Expr("s1", 8)  # the symbols of _dynamic_method: s0 in 1..16, s1 in 0..8


def _dynamic_method() -> Method:
    """A method with two bounded dynamic dimensions and every kind of size that may be symbolic."""
    values = [
        TensorValue("x", "float32", (S0, 3), "cpu", Role.INPUT, 16 * 3 * 4),
        TensorValue("y", "int64", (2, S1), "cpu", Role.INPUT, 2 * 8 * 8),
        TensorValue("x_dev", "float32", (S0, 3), "cuda:0", Role.INTERMEDIATE, 192, arena=0, arena_offset=0),
        TensorValue("z_dev", "float32", (Expr("2*s0", 32), 3), "cuda:0", Role.INTERMEDIATE, 384, arena=0,
                    arena_offset=256),
        TensorValue("z", "float32", (Expr("2*s0", 32), 3), "cpu", Role.INTERMEDIATE, 384),
        TensorValue("w", "float32", (S0, 4, Expr("max(s0, s1)", 16)), "cpu", Role.INTERMEDIATE, 16 * 4 * 16 * 4),
    ]
    sym_args = [HostArg(HostArgKind.TENSOR, 0), HostArg(HostArgKind.SYM_INT_LIST, [S0, 4, Expr("max(s0, s1)", 16)]),
                HostArg(HostArgKind.SYM_INT, Expr("(s0 + 1)//2", 8), "dim"),
                HostArg(HostArgKind.SYM_INT_LIST, [3, 4]),
                HostArg(HostArgKind.SYM_INT_LIST, [])]
    plan = DelegatePlan(
        tensors=[TensorDesc(Base.INPUT, 0, 0, "float32", (S0, 3), (3, 1)),
                 TensorDesc(Base.OUTPUT, 0, Expr("12*s0", 192), "float32", (S0, 3), (3, 1)),
                 TensorDesc(Base.SCRATCH, 0, 0, "float32", (S1, S0), (Expr("s0", 16), 1))],
        launches=[Launch("add_kernel", (Expr("(s0 + 63)//64", 1), 1, 1),
                         [Arg(KernelArgKind.TENSOR, 0), Arg(KernelArgKind.TENSOR, 1),
                          Arg(KernelArgKind.INT, Expr("3*s0", 48)), Arg(KernelArgKind.INT, 5)],
                         {"BLOCK": Arg(KernelArgKind.INT, 64), "N": Arg(KernelArgKind.INT, S0)},
                         op="aten::add.Tensor")],
        scratch_bytes=512, input_nbytes=[192], output_nbytes=[384])
    return Method(
        name="dynamic", values=values, inputs=[0, 1], outputs=[4, 5], **_specs(2, 2),
        instructions=[Instruction(InstrKind.COPY_H2D, [0], [2], name="h2d"),
                      Instruction(InstrKind.DELEGATE, [2], [3], delegate=0, name="delegate_0"),
                      Instruction(InstrKind.COPY_D2H, [3], [4], name="d2h"),
                      Instruction(InstrKind.HOST_OP, [0], [5], target="aten::new_zeros", args=sym_args, name="nz")],
        delegates=[Delegate("triton", "cuda:0", plan, scratch_arena=0, scratch_offset=768)],
        arenas=[Arena("cuda:0", 1280, 256, 1280)],
        symbols=[Symbol("s0", 1, 16, 0, 0), Symbol("s1", 0, 8, 1, 1)],
    )


def _with_offsets(program: Program, loaded: Program) -> Program:
    """``program`` with the data offsets and checksums the writer chose (the fields the writer decides)."""
    constants = [dataclasses.replace(c, data_offset=l.data_offset, checksum=l.checksum)
                 for c, l in zip(program.constants, loaded.constants)]
    return dataclasses.replace(program, constants=constants)


def _save(tmp_path: Path, program=None, data=None, name="model.tdp") -> tuple[Path, Program, list]:
    if program is None:
        program, data = _example()
    path = tmp_path / name
    save_program(program, data, path)
    return path, program, data


# -------------------------------------------------------------------------------------------------
# Round trips


def test_round_trip(tmp_path):
    program, data = _example()
    before = dataclasses.replace(program)
    files = save_program(program, data, tmp_path / "model.tdp")
    assert program == before  # the writer does not modify its argument
    assert files == [str(tmp_path / "model.tdp"), str(tmp_path / "model.safetensors"),
                     str(tmp_path / "sub" / "more.safetensors")]
    with load_program(tmp_path / "model.tdp") as pf:
        assert isinstance(pf, ProgramFile)
        assert pf.program == _with_offsets(program, pf.program)
        for i, (c, t) in enumerate(zip(pf.program.constants, data)):
            if c.external < 0:
                assert c.data_offset % hdr.CONSTANT_ALIGNMENT == 0
            got = pf.constant_tensor(i)
            assert got.dtype == t.dtype and got.shape == t.shape and got.device.type == "cpu"
            assert torch.equal(got, t), c.name
            raw = pf.constant_bytes(i)
            assert raw.dtype == torch.uint8 and raw.numel() == c.nbytes
            assert torch.equal(raw, t.reshape(-1).view(torch.uint8))


def test_types_of_decoded_fields(tmp_path):
    path, program, _ = _save(tmp_path)
    with load_program(path) as pf:
        m = pf.program.methods[0]
        assert type(m.values[0].shape) is tuple and type(m.values[0].role) is Role
        assert type(m.instructions[0].kind) is InstrKind
        args = m.instructions[3].args
        assert [type(a.kind) for a in args] == [HostArgKind] * len(args)
        assert [type(a.value) for a in args] == [type(a.value) for a in _all_host_args()]
        plan = m.delegates[0].plan
        assert type(plan.launches[0].grid) is tuple and type(plan.tensors[0].strides) is tuple
        assert list(plan.launches[0].constexprs) == ["BLOCK", "SCALE", "EVEN", "MODE", "EXTRA"]
        assert type(plan.tensors[0].base) is Base and type(plan.launches[0].args[0].kind) is KernelArgKind


def test_symbolic_sizes_round_trip(tmp_path):
    path, program, _ = _save(tmp_path)
    with load_program(path) as pf:
        m, expected = pf.program.methods[2], program.methods[2]
    assert m.symbols == expected.symbols and type(m.symbols[0]) is Symbol
    assert [v.shape for v in m.values] == [v.shape for v in expected.values]
    assert type(m.values[0].shape[0]) is Expr and m.values[0].shape[0] == S0
    args = m.instructions[3].args
    assert [(a.kind, a.value) for a in args] == [(a.kind, a.value) for a in expected.instructions[3].args]
    assert type(args[1].value) is list and type(args[1].value[1]) is int
    plan, want = m.delegates[0].plan, expected.delegates[0].plan
    assert plan.tensors == want.tensors and plan.tensors[1].byte_offset == Expr("12*s0", 192)
    assert plan.launches[0].grid == (Expr("(s0 + 63)//64", 1), 1, 1)
    assert plan.launches[0].args == want.launches[0].args and plan.launches[0].constexprs == want.launches[0].constexprs


def test_concrete_sizes_store_no_expressions():
    """A method without symbols is stored exactly as before symbolic sizes (no expression fields);
    a symbolic one stores each size's bound in the int field, its text beside it."""
    program, _ = _example()
    constants, _ = writer._layout(program)
    t = writer._program_t(program, constants)
    forward, dynamic = t.methods[0], t.methods[2]
    assert forward.symbols is None and all(v.shapeExprs is None for v in forward.values)
    plan = forward.delegates[0].plan
    assert all(d.shapeExprs is d.stridesExprs is d.byteOffsetExpr is None for d in plan.tensors)
    assert all(l.gridExprs is None and all(a.iexpr is None for a in l.args) for l in plan.launches)
    assert (dynamic.values[5].shape, dynamic.values[5].shapeExprs) == ([16, 4, 16], ["s0", "", "max(s0, s1)"])
    assert (dynamic.instructions[3].args[2].ival, dynamic.instructions[3].args[2].sexpr) == (8, "(s0 + 1)//2")
    assert dynamic.instructions[3].args[3].slistExprs is None


def test_converter_maps_every_schema_field_and_round_trips():
    """Every field of every table is read and written: a dataclass field of the same name, the expression
    texts of a size, the value of a union (Arg, HostArg) or one of the converter's special fields; and
    the example program comes back equal through the object API, the flatbuffer and the reader."""
    from tritondelegate.serialize import convert
    from tritondelegate.serialize.generated import program_generated as fb

    special = {"Launch": {"constexprs"}, "Method": {"mutatedBuffers", "symbols"}}
    tables = {Program, Method, TensorValue, Instruction, HostArg, Delegate, Arena, Symbol, Constant, Segment, Slot,
              KernelBinary, DelegatePlan, TensorDesc, Launch, Arg}
    for cls in tables:
        slots = [s for _, s in convert._fields(cls) if s is not None]
        slots += [s for s in convert._union(cls).values() if s] if cls.__name__ in convert._UNIONS else []
        covered = {a for s in slots for a in (s.attr, s.exprs) if a} | special.get(cls.__name__, set())
        assert covered == set(vars(getattr(fb, cls.__name__ + "T")())), cls.__name__
    program, _ = _example()
    program.binaries = [KernelBinary("add_kernel", "sm_90", "3.4.0", "key", "add_kernel", "{}", 16, 7, 64)]
    constants, _ = writer._layout(program)
    program = dataclasses.replace(program, constants=constants)
    assert convert.from_buffer(writer._finish(convert.to_object(program))) == program



@pytest.fixture
def reader_work(monkeypatch):
    """Counts the tables the flatbuffer reader builds: its work, whatever the machine's speed. The reader's
    budget bounds it by the buffer's size (each vector entry costs one unit)."""
    from tritondelegate.serialize import convert

    work = {"tables": 0}
    table = convert._Reader.table

    def counted(self, acc, cls, where):
        work["tables"] += 1
        return table(self, acc, cls, where)

    monkeypatch.setattr(convert._Reader, "table", counted)
    return work


def test_tables_shared_many_times_over_are_an_error_not_a_hang(reader_work):
    """Flatbuffer offsets may point many vector entries at one table: 2000 methods that are one method
    of 2000 values that are one value would be 4 million values; the reader's budget refuses them."""
    import flatbuffers
    from tritondelegate.serialize import convert
    from tritondelegate.serialize.generated import program_generated as fb

    def shared_vector(builder, offset, n):
        builder.StartVector(4, n, 4)
        for _ in range(n):
            builder.PrependUOffsetTRelative(offset)
        return builder.EndVector()

    builder = flatbuffers.Builder(1024)
    value = fb.TensorValueT(name="x", dtype="float32", shape=[1], device="cpu").Pack(builder)
    values = shared_vector(builder, value, 2000)
    fb.MethodStart(builder)
    fb.MethodAddValues(builder, values)
    methods = shared_vector(builder, fb.MethodEnd(builder), 2000)
    fb.ProgramStart(builder)
    fb.ProgramAddMethods(builder, methods)
    builder.Finish(fb.ProgramEnd(builder), file_identifier=hdr.FILE_IDENTIFIER)
    buf = bytes(builder.Output())
    with pytest.raises(ProgramError, match=r"the flatbuffer is corrupt: method \d+ values claims 2000 entries"):
        convert.from_buffer(buf)
    assert 0 < reader_work["tables"] <= len(buf) < 2000 * 2000  # stopped within its budget, not 4 million

def test_file_layout(tmp_path):
    path, program, data = _save(tmp_path)
    raw = path.read_bytes()
    fields = hdr.HEADER.unpack(raw[: hdr.HEADER.size])
    magic, version, header_size, fb_off, fb_size, data_off, data_size, file_size, _, _ = fields
    assert magic == b"TDPROG\0\0" and version == FORMAT_VERSION and header_size == 64 and fb_off == 64
    assert data_off % 4096 == 0 and data_off >= fb_off + fb_size
    assert file_size == len(raw) == data_off + data_size
    assert raw[fb_off + 4 : fb_off + 8] == b"TDP1"
    # in-file constants: 0 (48 B), 1 (6 B), 2 (0 B), 3 (8 B), 8 (3 B), each on a 64-byte boundary
    assert data_size == 64 + 64 + 64 + 3
    with load_program(path) as pf:
        for i in (0, 1, 3, 8):
            off = data_off + pf.program.constants[i].data_offset
            assert raw[off : off + program.constants[i].nbytes] == data[i].reshape(-1).view(torch.uint8).numpy().tobytes()


def test_constant_shared_by_two_methods_is_stored_once(tmp_path):
    big = torch.randint(0, 256, (8192,), dtype=torch.uint8).view(torch.float32)  # 8 KiB, distinctive

    def program(readers: int, with_big: bool = True) -> tuple[Program, list]:
        constants, data = [], []
        if with_big:
            constants, data = [_const("big", big)], [big]
        methods = []
        for k in range(2):
            values = [_value("big", ("float32", (2048,)), Role.CONSTANT, constant=0)] if k < readers else []
            values.append(_value("x", ("float32", (2048,)), Role.INPUT))
            methods.append(Method(f"m{k}", values, [len(values) - 1], [0], **_specs(1, 1), instructions=[],
                                  delegates=[], arenas=[]))
        return Program(methods, constants), data

    sizes = {}
    for key, (readers, with_big) in {"none": (0, False), "one": (1, True), "two": (2, True)}.items():
        path, _, _ = _save(tmp_path, *program(readers, with_big), name=f"{key}.tdp")
        raw = path.read_bytes()
        sizes[key] = hdr.HEADER.unpack(raw[: hdr.HEADER.size])[6], len(raw)  # data_size, file size
        assert raw.count(big.view(torch.uint8).numpy().tobytes()) == (0 if key == "none" else 1)
        if with_big:
            with load_program(path) as pf:
                assert torch.equal(pf.constant_bytes(0), big.view(torch.uint8))
    assert sizes["one"][0] == sizes["two"][0] == sizes["none"][0] + big.nbytes
    assert sizes["two"][1] == sizes["one"][1] == sizes["none"][1] + big.nbytes


def test_constant_views_are_zero_copy(tmp_path):
    path, _, data = _save(tmp_path)
    pf = load_program(path)
    w = pf.constant_tensor(0)
    w.add_(1)  # the mapping is private: the view is writable, the file is not touched
    assert torch.equal(pf.constant_tensor(0), data[0] + 1)  # a view of the same memory, not a copy
    assert pf.constant_bytes(0).data_ptr() == w.data_ptr()
    ext = pf.constant_tensor(4)
    assert pf.constant_tensor(4).data_ptr() == ext.data_ptr()
    pf.close()
    with load_program(path) as again:
        assert torch.equal(again.constant_tensor(0), data[0])


def test_close_keeps_handed_out_tensors_valid(tmp_path):
    path, _, data = _save(tmp_path)
    pf = load_program(path)
    w, b, ext = pf.constant_tensor(0), pf.constant_bytes(1), pf.constant_tensor(5)
    pf.close()
    pf.close()  # idempotent
    assert pf.closed and "closed" in repr(pf)
    with pytest.raises(ValueError, match="closed"):
        pf.constant_bytes(0)
    del pf
    assert torch.equal(w, data[0]) and torch.equal(b, data[1].view(torch.uint8)) and torch.equal(ext, data[5])
    # without tensors outstanding the mapping goes at once
    with load_program(path) as pf:
        mm = pf._mm
    assert mm.closed


def test_data_files_override(tmp_path):
    path, _, data = _save(tmp_path)
    moved = tmp_path / "elsewhere.safetensors"
    os.replace(tmp_path / "model.safetensors", moved)
    with load_program(path, data_files={"model.safetensors": str(moved)}) as pf:
        assert torch.equal(pf.constant_tensor(4), data[4])
    with load_program(path) as pf:
        assert torch.equal(pf.constant_tensor(5, {"model.safetensors": moved}), data[5])
        assert pf.external_path(0, {"model.safetensors": moved}) == str(moved)


def test_every_constant_records_the_checksum_of_its_bytes(tmp_path):
    path, program, data = _save(tmp_path)
    with load_program(path) as pf:
        assert [c.checksum for c in pf.program.constants] == [hdr.checksum(t) for t in data]
        for i in range(len(data)):
            assert torch.equal(pf.constant_tensor(i), data[i])  # checked on the way


def test_a_file_without_checksums_loads_unchecked(tmp_path):
    """Files written before constants had checksums load as before: nothing to check them against."""
    program, data = _example()
    path = _write_raw(tmp_path / "old.tdp", program, data)  # the object tree as _layout makes it: no checksums
    with load_program(path) as pf:
        assert all(c.checksum is None for c in pf.program.constants)
        start = pf.data_offset + pf.program.constants[0].data_offset
    raw = bytearray(path.read_bytes())
    raw[start] ^= 1
    path.write_bytes(bytes(raw))
    with load_program(path) as pf:
        assert not torch.equal(pf.constant_tensor(0), data[0])  # damaged, and nothing can tell


def test_external_file_contents(tmp_path):
    _, program, data = _save(tmp_path)
    first = load_file(tmp_path / "model.safetensors")
    assert set(first) == {"ext.w", "ext.b", "ext.empty"}
    assert first["ext.w"].dtype == torch.bfloat16 and torch.equal(first["ext.w"], data[4])
    assert set(load_file(tmp_path / "sub" / "more.safetensors")) == {"ext2.idx"}


# -------------------------------------------------------------------------------------------------
# External data errors


def _external_error(tmp_path, index, match, data_files=None):
    path = tmp_path / "model.tdp"
    with load_program(path) as pf:
        with pytest.raises(ProgramError, match=match) as info:
            pf.constant_tensor(index, data_files)
    return str(info.value)


def test_missing_external_file(tmp_path):
    _save(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    msg = _external_error(tmp_path, 4, "is missing")
    assert "model.safetensors" in msg and "'ext.w'" in msg and "data_files" in msg


def test_missing_external_key(tmp_path):
    _save(tmp_path)
    save_file({"ext.b": torch.randn(3)}, tmp_path / "model.safetensors")
    msg = _external_error(tmp_path, 4, "has no tensor 'ext.w'")
    assert "model.safetensors" in msg


@pytest.mark.parametrize("tensor, what", [(torch.randn(2, 2), "float32\\[2, 2\\]"),
                                           (torch.randn(4).to(torch.bfloat16), "bfloat16\\[4\\]")])
def test_wrong_external_dtype_or_shape(tmp_path, tensor, what):
    _save(tmp_path)
    save_file({"ext.w": tensor, "ext.b": torch.randn(3), "ext.empty": torch.empty(0, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    msg = _external_error(tmp_path, 4, f"'ext.w'.* is {what}, but the program expects bfloat16\\[2, 2\\]")
    assert "model.safetensors" in msg


def test_short_external_data(tmp_path):
    _save(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    msg = _external_error(tmp_path, 4, "not a valid safetensors file")
    assert "model.safetensors" in msg and "'ext.w'" in msg


def test_external_file_that_is_not_safetensors(tmp_path):
    _save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 100)
    _external_error(tmp_path, 5, "'ext.b'.*not a valid safetensors file")


# -------------------------------------------------------------------------------------------------
# The writer's checks


def test_writer_rejects_mismatched_data(tmp_path):
    program, data = _example()
    with pytest.raises(ValueError, match="constant tensors for"):
        save_program(program, data[:-1], tmp_path / "a.tdp")
    bad = list(data)
    bad[0] = data[0].double()
    with pytest.raises(ValueError, match=r"constant 0 \('layer.w'\) is float32\[4, 3\] but its tensor is float64"):
        save_program(program, bad, tmp_path / "a.tdp")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_writer_rejects_bad_fields(tmp_path):
    program, data = _example()
    program.methods[0].values[0].arena_offset = 2**64
    with pytest.raises(ValueError, match=r"method 0 \('forward'\) value 0 \('x'\) arena_offset: .* is outside"):
        save_program(program, data, tmp_path / "a.tdp")
    program, data = _example()
    program.methods[1].instructions[0].args[0] = HostArg(HostArgKind.INT_LIST, 3)
    with pytest.raises(TypeError, match="expected a list"):
        save_program(program, data, tmp_path / "a.tdp")
    program, data = _example()
    program.external_files[1] = "../outside.safetensors"
    with pytest.raises(ValueError, match="must be a relative path inside the program file's directory"):
        save_program(program, data, tmp_path / "a.tdp")
    program, data = _example()
    program.methods[2].values[0].shape = (Expr("s0", 2**64), 3)
    with pytest.raises(ValueError, match=r"value 0 \('x'\) shape\[0\] \(bound of 's0'\): .* is outside"):
        save_program(program, data, tmp_path / "a.tdp")
    program, data = _example()
    program.methods[2].delegates[0].plan.launches[0].grid = (Expr("", 1),)
    with pytest.raises(ValueError, match="grid\\[0\\]: a size expression without text"):
        save_program(program, data, tmp_path / "a.tdp")


def test_data_on_device_independent_storage(tmp_path):
    """Non-contiguous and view tensors are written as their logical (contiguous) bytes."""
    base = torch.randn(6, 4)
    data = [base.t(), base[1:3]]  # a transposed view, and a slice sharing storage with it
    constants = [_const("t", data[0]), _const("s", data[1], external=0)]
    program = Program([], constants, ["w.safetensors"])
    save_program(program, data, tmp_path / "v.tdp")
    with load_program(tmp_path / "v.tdp") as pf:
        assert torch.equal(pf.constant_tensor(0), base.t()) and torch.equal(pf.constant_tensor(1), base[1:3])


# -------------------------------------------------------------------------------------------------
# Damaged files


def _load_outcome(path):
    """ProgramError -> None; else the program (after reading every in-file constant: a dtype torch cannot
    view bytes as, or bytes that do not match their checksum, is a ProgramError too)."""
    try:
        pf = load_program(path)
    except ProgramError:
        return None
    with pf:
        for i, c in enumerate(pf.program.constants):
            if c.external < 0:
                try:
                    pf.constant_bytes(i).sum()
                    pf.constant_tensor(i)
                except ProgramError:
                    return None
        return pf.program


def test_damaged_files(tmp_path, reader_work):
    path, program, _ = _save(tmp_path)
    good = path.read_bytes()
    with load_program(path) as pf:
        expected = pf.program
    _, _, _, fb_off, fb_size, data_off, data_size, _, _, _ = hdr.HEADER.unpack(good[:64])
    target = tmp_path / "damaged.tdp"
    rng = random.Random(1234)
    counts = {}
    most = 0  # the most tables one load built

    def outcome(raw: bytes):
        nonlocal most
        target.write_bytes(raw)
        reader_work["tables"] = 0
        result = _load_outcome(target)
        most = max(most, reader_work["tables"])
        return result

    # every truncation length over a stride, plus the boundaries: always an error
    lengths = sorted(set(range(0, len(good), 37)) | {0, 1, 63, 64, fb_off + fb_size, data_off, len(good) - 1})
    for n in lengths:
        assert outcome(good[:n]) is None, n
    counts["truncations"] = len(lengths)
    assert outcome(good + b"\0") is None  # bytes past the recorded end

    # every header byte flipped: always an error
    for i in range(hdr.HEADER.size):
        raw = bytearray(good)
        raw[i] ^= 1 << rng.randrange(8)
        assert outcome(bytes(raw)) is None, i
    counts["header flips"] = hdr.HEADER.size

    # random flips in the flatbuffer: the checksum catches them
    for _ in range(120):
        raw = bytearray(good)
        raw[fb_off + rng.randrange(fb_size)] ^= 1 << rng.randrange(8)
        assert outcome(bytes(raw)) is None
    counts["flatbuffer flips"] = 120

    # the same with the checksums repaired, so the flatbuffer decoder and the checks see the damage:
    # a ProgramError, the same program (the flip hit padding), or some other well-formed program,
    # whose constants are then read; never another exception
    same = errors = other = 0
    for k in range(300):
        raw = bytearray(good)
        for _ in range(1 + k % 3):
            pos = fb_off + rng.randrange(fb_size)
            if k % 5 == 0:  # a large 32-bit word: lengths, offsets
                pos -= pos % 4
                raw[pos : pos + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x10000, fb_size]))
            else:
                raw[pos] ^= 1 << rng.randrange(8)
        raw = _fix_checksums(raw, fb_off, fb_size)
        got = outcome(raw)
        if got is None:
            errors += 1
        elif got == expected:
            same += 1
        else:
            other += 1
    assert errors > 100  # most structural damage is found
    counts["repaired-checksum flips (error/same/other)"] = (errors, same, other)

    # flips in the data segment: inside a constant, its checksum catches them; in padding, the same program
    spans = [(c.data_offset, c.data_offset + c.nbytes) for c in expected.constants if c.external < 0]
    caught = 0
    for _ in range(40):
        raw = bytearray(good)
        pos = rng.randrange(data_size)
        raw[data_off + pos] ^= 0xFF
        inside = any(start <= pos < end for start, end in spans)
        assert outcome(bytes(raw)) == (None if inside else expected), pos
        caught += inside
    assert 0 < caught < 40  # both kinds of position were hit
    counts["data flips (caught)"] = (40, caught)
    print(counts, f"at most {most} tables read by one load")
    assert most <= fb_size, f"a damaged file made the reader build {most} tables from {fb_size} bytes: {counts}"


def _fix_checksums(raw: bytearray, fb_off: int, fb_size: int) -> bytes:
    struct.pack_into("<I", raw, 56, zlib.crc32(raw[fb_off : fb_off + fb_size]))
    struct.pack_into("<I", raw, 60, zlib.crc32(raw[:60]))
    return bytes(raw)


def _write_raw(path: Path, program: Program, data: list[torch.Tensor], edit=None, header_edit=None,
               data_size_delta: int = 0) -> Path:
    """A program file built by hand: ``edit`` changes the flatbuffer's object tree before packing,
    ``header_edit`` changes the header fields (checksums are recomputed, so only the edit is wrong)."""
    constants, data_size = writer._layout(program)
    t = writer._program_t(program, constants)
    if edit:
        edit(t)
    fb_bytes = writer._finish(t)
    data_off = align_up(64 + len(fb_bytes), hdr.DATA_SEGMENT_ALIGNMENT)
    segment = bytearray(data_size)
    for c, d in zip(constants, data):
        if c.external < 0:
            segment[c.data_offset : c.data_offset + c.nbytes] = d.reshape(-1).view(torch.uint8).numpy().tobytes()
    fields = list(hdr.HEADER.unpack(hdr.pack_header(FORMAT_VERSION, len(fb_bytes), data_off, data_size, zlib.crc32(fb_bytes))))
    segment = segment[: len(segment) + data_size_delta] if data_size_delta < 0 else segment
    fields[6] = len(segment)
    fields[7] = data_off + len(segment)
    if header_edit:
        header_edit(fields)
    head = bytearray(hdr.HEADER.pack(*fields))
    struct.pack_into("<I", head, 60, zlib.crc32(head[:60]))
    body = bytes(head) + fb_bytes + bytes(data_off - 64 - len(fb_bytes)) + bytes(segment)
    path.write_bytes(body)
    return path


def _set(path: str, value):
    def edit(t):
        *parents, last = path.split(".")
        obj = t
        for p in parents:
            obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
        if last.isdigit():
            obj[int(last)] = value
        else:
            setattr(obj, last, value)
    return edit


BAD_FLATBUFFERS = [
    ("methods.0.values.0.role", 9, r"method 0 value 0 has Role value 9; valid: 0 \(INPUT\)"),
    ("methods.0.instructions.0.kind", 5, "InstrKind value 5"),
    ("methods.0.instructions.3.args.1.kind", 99, "HostArgKind value 99"),
    ("methods.0.delegates.0.plan.tensors.0.base", 3, "Base value 3"),
    ("methods.0.delegates.0.plan.launches.0.args.2.kind", 7, "KernelArgKind value 7"),
    ("methods.0.outputs.1", 10, r"method 'forward' output 1 refers to value 10, but there are 10"),
    ("methods.0.inputs.0", -1, "input 0 refers to value -1"),
    ("methods.0.instructions.1.inputs.0", 100, r"instruction 1 \('delegate_0'\) input 0 refers to value 100"),
    ("methods.0.instructions.3.args.0.ival", 10, "arg 0 refers to value 10"),
    ("methods.0.instructions.3.args.9.tlist", [1, -2], r"arg 9\[1\] refers to value -2"),
    ("methods.0.instructions.1.delegate", 1, "refers to delegate 1, but there are 1"),
    ("methods.0.instructions.1.delegate", -1, "refers to delegate -1"),
    ("methods.0.instructions.0.outputs", [3, 4], "a copy reads 1 values and writes 2"),
    ("methods.0.mutatedBuffers.0.value", 12, "mutated buffer 0 refers to value 12"),
    ("methods.0.values.3.arena", 1, "refers to arena 1, but there are 1"),
    ("methods.0.values.1.arena", 0, r"value 1 \('layer.w'\) does not fit its slot 0 \(constant\)"),
    ("methods.0.values.3.arenaOffset", 4096, "offset 4096 lies outside arena 0"),
    ("methods.0.values.2.constant", 9, "refers to constant 9"),
    ("methods.0.values.2.constant", 0, r"is bfloat16\[3\] but its constant 0"),
    ("methods.0.values.0.dtype", "float33", "unknown dtype 'float33'"),
    ("methods.0.values.0.shape", [4, -3], "negative dimension"),
    ("methods.0.delegates.0.scratchOffset", 1800, r"scratch \[1800, 2312\) lies outside arena 0"),
    ("methods.0.delegates.0.plan.tensors.1.index", 2, "tensor 1 refers to input 2, but there are 2"),
    ("methods.0.delegates.0.plan.tensors.3.index", 1, "refers to scratch 1"),
    ("methods.0.delegates.0.plan.tensors.0.dtype", "float", "unknown dtype 'float'"),
    ("methods.0.delegates.0.plan.tensors.0.strides", [3], "strides"),
    ("methods.0.delegates.0.plan.launches.0.args.0.ival", 4, "arg 0 refers to plan tensor 4, but there are 4"),
    ("methods.0.delegates.0.plan.launches.0.constexprs.4.arg.ival", -1, "constexpr 'EXTRA' refers to plan tensor -1"),
    ("methods.0.delegates.0.plan.launches.0.constexprs.4.arg", None, "constexpr 4 has no value"),
    ("methods.0.delegates.0.plan", None, "delegate 0 has no launch plan"),
    ("methods.0.delegates.0.plan.scratchBytes", -1, "scratch_bytes is negative"),
    ("methods.0.delegates.0.plan.launches.0.bytesRead", -1, r"launch 0 \('add_kernel'\) bytes_read is negative"),
    ("methods.0.delegates.0.plan.launches.1.flops", -7, "flops is negative"),
    ("methods.0.instructions.3.args.10.sval", "complex7", "unknown dtype 'complex7'"),
    ("methods.0.instructions.3.args.12.sval", "weird_format", "unknown memory format"),
    ("methods.0.arenas.0.nbytes", -5, "arena 0 nbytes is negative"),
    ("methods.1.name", "forward", "two methods are named 'forward'"),
    ("constants.0.dtype", "floatX", r"constant 0 \('layer.w'\) has unknown dtype"),
    ("constants.0.nbytes", 44, "records 44 bytes, but float32"),
    ("constants.0.dataOffset", 256, r"bytes \[256, 304\) lie outside the data segment"),
    ("constants.0.dataOffset", -64, "lie outside the data segment"),
    ("constants.3.dataOffset", 4, "not aligned for int64"),
    ("constants.4.external", 2, "refers to external file 2, but there are 2"),
    ("constants.5.name", "ext.w", "two constants have key 'ext.w'"),
    ("externalFiles.0", "/abs/model.safetensors", "must be a relative path"),
    # external files stay in the program's directory (the writer's rule: validate.external_name_problem)
    ("externalFiles.0", "../../../x.safetensors", r"external file 0 \('../../../x.safetensors'\) must be a relative "
                                                  "path inside the program file's directory"),
    ("externalFiles.1", "sub/../../x.safetensors", "must be a relative path inside"),
    ("externalFiles.1", "sub\\..\\..\\x.safetensors", "must be a relative path inside"),
    ("externalFiles.0", "./model.safetensors", "must be a relative path inside"),
    ("externalFiles.0", "", "must be a relative path inside"),
    # indices that point at a value of the same type, caught by the names and slots that must agree
    ("methods.0.values.1.constant", -1, r"has constant -1, but its slot 0 holds constant 0"),
    ("slots.0.name", "other", r"slot 0 \('other'\) holds constant 0, which is named 'layer.w'"),
    ("methods.1.values.0.name", "w2", r"value 0 \('w2'\) refers to constant 0, which is named 'layer.w'"),
    # consistency.py: specs, sizes, devices, arenas, data flow
    ("methods.0.inputSpec", "{", r"method 'forward' input spec does not parse \(JSONDecodeError"),
    ("methods.1.outputSpec", "[1, {}]", r"method 'decode' output spec does not parse \(KeyError"),
    ("methods.0.values.3.nbytes", 40, r"value 3 \('x_dev'\) records 40 bytes, but float32\[4, 3\] has 48"),
    ("methods.0.values.0.device", "cuda", "has device 'cuda', not a device such as 'cpu' or 'cuda:0'"),
    ("methods.0.values.7.role", 0, r"value 7 \('buf_new'\) has role INPUT but is not a method input"),
    ("methods.0.arenas.0.alignment", 3, "arena 0 has alignment 3, not a power of two"),
    ("methods.0.arenas.0.nbytes", 4096, "arena 0 has 4096 bytes; what lies in it needs 1536"),
    ("segments.0.nbytes", 1024, "segment 0 has 1024 bytes; its slots need 256"),
    ("methods.0.instructions.1.inputs", [3], "passes 1 inputs and 1 outputs to delegate 0, whose plan takes 2 and 1"),
    ("methods.0.instructions.4.kind", 2, r"a COPY_H2D copy from float32\[4, 3\] on cuda:0 to float32\[4, 3\] on cpu"),
    # 4, a device-to-device copy never emitted, is no instruction kind: refused, naming the instruction
    ("methods.0.instructions.4.kind", 4, r"method 0 instruction 4 has InstrKind value 4; valid: 0 \(HOST_OP\), "
                                         r"1 \(DELEGATE\), 2 \(COPY_H2D\), 3 \(COPY_D2H\)$"),
    ("methods.0.instructions.3.args.11.sval", "gpu:0", "unknown device 'gpu:0'"),
    ("methods.0.instructions.0.outputs", [1], r"writes value 1 \('layer.w'\), a constant"),
    ("methods.0.instructions.1.inputs.0", 5, r"reads value 5 \('y'\) before anything writes it"),
    ("methods.0.mutatedBuffers.0.buffer", 7, r"cannot be written back to state 7 \('buf_new', intermediate"),
    ("version", 99, f"the program records version 99, the header {FORMAT_VERSION}"),
    ("methods.0.values.1.slot", 5, "refers to slot 5, but there are 2"),
    ("methods.0.values.0.slot", -2, r"refers to slot -2, but there are 2 \(-1: none\)"),
    ("methods.0.values.1.slot", -1, "is resident but has no slot"),
    ("methods.0.values.6.slot", -1, "is state but has no slot"),
    ("methods.0.values.6.slot", 0, r"is int64\[\] on cpu, but its slot 0 holds float32\[4, 3\] on cuda:0"),
    ("slots.0.constant", 12, r"slot 0 \('layer.w'\) refers to constant 12"),
    ("slots.0.segment", 1, r"\(constants on cuda:0\) lies in segment 1 \(state on cuda:0\)"),
    ("slots.0.offset", 128, r"bytes \[128, 176\) do not fit segment 0"),
    ("slots.1.segment", 0, r"slot 1 \('buf'\) \(state on cpu\) lies in segment 0"),
    ("slots.1.device", "cuda:0", "lies in no segment; only host state may"),
    ("segments.0.alignment", 0, "segment 0 has alignment 0"),
    ("segments.0.kind", 7, "SegmentKind value 7"),
    # symbolic sizes (method 2): expressions are integer arithmetic over the method's symbols
    ("methods.2.values.0.shapeExprs", ["__import__('os')", ""],
     r"method 2 value 0 shape\[0\]: size expression \"__import__\('os'\)\" is not integer arithmetic.*Call"),
    ("methods.2.instructions.3.args.2.sexpr", "s0.__class__", r"arg 2: size expression 's0.__class__' .*Attribute"),
    ("methods.2.delegates.0.plan.tensors.1.byteOffsetExpr", "s0**99", r"tensor 1 byte_offset: .*'s0\*\*99'.*Pow"),
    ("methods.2.delegates.0.plan.launches.0.gridExprs", ["(s7 + 63)//64", "", ""],
     r"launch 0 grid\[0\]: size expression '\(s7 \+ 63\)//64' is not integer arithmetic over the method's symbols"),
    ("methods.2.instructions.3.args.1.slistExprs", ["s0", "", "s0; 1"], r"arg 1\[2\]: .*does not parse"),
    ("methods.2.values.0.shapeExprs", ["s0"], "value 0 shape has 1 size expressions for 2 sizes"),
    ("methods.2.instructions.3.args.2.sexpr", "7", "the literal size '7' differs from its bound 8"),
    ("methods.2.delegates.0.plan.launches.0.args.2.ival", 47,
     r"launch 0 args: size expression '3\*s0' is 48 at the symbols' maxima, but its recorded bound is 47"),
    ("methods.2.delegates.0.plan.launches.0.constexprs.1.arg.iexpr", "s1 // 0", "divides by zero"),
    ("methods.2.delegates.0.plan.tensors.0.byteOffset", -8, "tensor 0 byte_offset is negative"),
    ("methods.2.delegates.0.plan.tensors.1.byteOffset", -8,
     r"'12\*s0' is 192 at the symbols' maxima, but its recorded bound is -8"),
    # symbols: a valid range, an input dimension that is exactly the symbol
    ("methods.2.symbols.0.min", 20, r"symbol 0 \('s0'\): its range 20\.\.16 is not 0 <= min <= max"),
    ("methods.2.symbols.1.min", -1, r"symbol 1 \('s1'\): its range -1\.\.8"),
    ("methods.2.symbols.1.input", 2, r"symbol 1 \('s1'\) refers to input 2, but there are 2"),
    ("methods.2.symbols.1.dim", 2, r"input 1 has no dimension 2 \(its rank is 2\)"),
    ("methods.2.symbols.1.dim", 0, r"input 1 dimension 0 is 2, not the symbol"),
    ("methods.2.symbols.0.max", 17, r"input 0 dimension 0 is s0, not the symbol \(bound 17\)"),
    ("methods.2.symbols.1.name", "s0", "names an unknown|not integer arithmetic over the method's symbols"),
    ("methods.2.symbols", None, "not integer arithmetic over the method's symbols"),
]


@pytest.mark.parametrize("field, value, match", BAD_FLATBUFFERS, ids=[f"{f}={v}" for f, v, _ in BAD_FLATBUFFERS])
def test_bad_program_contents(tmp_path, field, value, match):
    program, data = _example()
    path = _write_raw(tmp_path / "bad.tdp", program, data, edit=_set(field, value))
    with pytest.raises(ProgramError, match=match) as info:
        load_program(path)
    assert str(info.value).startswith(str(path) + ": ")


@pytest.mark.parametrize("name, match", [("s0", "two symbols have this name"), ("for", "not a valid symbol name"),
                                         ("max", "not a valid symbol name"), ("s 1", "not a valid symbol name"),
                                         ("", "not a valid symbol name")])
def test_bad_symbol_names(name, match):
    """Checked on the decoded program (a file with such a name fails earlier, at its expressions)."""
    program, _ = _example()
    program.methods[2].symbols[1].name = name
    with pytest.raises(ProgramError, match=f"p.tdp: method 'dynamic' symbol 1 \\({name!r}\\): {match}"):
        check_program(program, "p.tdp", FORMAT_VERSION, 0, 4096)


def test_dynamic_batch_model_round_trip(tmp_path):
    """A program lowered from a model with a bounded dynamic batch, saved, loaded and run at several sizes."""
    import tritondelegate as td
    from torch.export import Dim

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    ep = torch.export.export(model, (torch.randn(5, 8),), dynamic_shapes={"input": {0: Dim("batch", max=33)}})
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(ep, config=config)
    lowered.save(tmp_path / "dyn.tdp")
    with load_program(tmp_path / "dyn.tdp") as pf:
        read = pf.program
    (symbol,) = read.methods[0].symbols
    assert read.methods[0].symbols == lowered.program.methods[0].symbols
    assert (symbol.min, symbol.max, symbol.input, symbol.dim) == (0, 33, 0, 0)
    got, want = read.methods[0], lowered.program.methods[0]
    assert [v.shape for v in got.values] == [v.shape for v in want.values]
    assert any(any_symbolic(v.shape) for v in got.values)
    for d, e in zip(got.delegates, want.delegates, strict=True):
        assert d.plan.tensors == e.plan.tensors and d.plan.launches == e.plan.launches
        assert any(any_symbolic(l.grid) for l in d.plan.launches)
        assert any(any_symbolic((t.byte_offset, t.shape, t.strides)) for t in d.plan.tensors)
    assert [i.args for i in got.instructions] == [i.args for i in want.instructions]
    assert read == _with_offsets(lowered.program, read)  # everything else too
    method = td.load(tmp_path / "dyn.tdp").load_method("forward")
    for n in (1, 7, 33):
        x = torch.randn(n, 8)
        with torch.no_grad():
            torch.testing.assert_close(method(x), model(x), atol=1e-4, rtol=1e-4)


BAD_HEADERS = [
    (0, b"XXPROG\0\0", "not a tritondelegate program file"),
    (1, 1, f"format version 1 is not supported; this reader reads version\\(s\\) {FORMAT_VERSION}"),
    (2, 72, "header size 72"),
    (4, 10**6, r"flatbuffer \[64, 1000064\) lies outside the file"),
    (5, 4096 * 100, r"data segment \[409600, .*\) does not lie between"),
    (5, 4097, "does not lie between|not a multiple of 4096"),
    (6, 10**9, "does not lie between"),
    (7, 10**9, "truncated: the header records 1000000000 bytes"),
]


@pytest.mark.parametrize("field, value, match", BAD_HEADERS, ids=[f"field{f}={v!r}" for f, v, _ in BAD_HEADERS])
def test_bad_headers(tmp_path, field, value, match):
    program, data = _example()
    path = _write_raw(tmp_path / "bad.tdp", program, data, header_edit=lambda f: f.__setitem__(field, value))
    with pytest.raises(ProgramError, match=match):
        load_program(path)


def test_bad_identifier_and_checksums(tmp_path):
    path, _, _ = _save(tmp_path)
    good = bytearray(path.read_bytes())
    fb_size = hdr.HEADER.unpack(good[:64])[4]
    raw = bytearray(good)
    raw[64 + 4 : 64 + 8] = b"XXXX"
    path.write_bytes(_fix_checksums(raw, 64, fb_size))
    with pytest.raises(ProgramError, match="does not carry the identifier b'TDP1'"):
        load_program(path)
    raw = bytearray(good)
    raw[64 + 20] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ProgramError, match=r"flatbuffer checksum mismatch: bytes \[64, "):
        load_program(path)
    raw = bytearray(good)
    raw[50] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ProgramError, match="header checksum mismatch"):
        load_program(path)
    path.write_bytes(b"TDPROG")
    with pytest.raises(ProgramError, match="truncated: 6 bytes"):
        load_program(path)


def test_vector_length_beyond_the_buffer_is_an_error_not_a_hang(tmp_path, reader_work):
    """A corrupt length of a vector of tables is refused before any loop runs over it."""
    path, _, _ = _save(tmp_path)
    load_program(path).close()
    whole = reader_work["tables"]  # what reading the whole program takes
    raw = bytearray(path.read_bytes())
    fb_off, fb_size = 64, hdr.HEADER.unpack(raw[:64])[4]
    from tritondelegate.serialize.generated import program_generated as fb

    root = fb.Program.GetRootAs(bytes(raw[fb_off : fb_off + fb_size]), 0)
    vec = root._tab.Vector(root._tab.Offset(8))  # Program.constants
    struct.pack_into("<I", raw, fb_off + vec - 4, 0x7FFFFFFF)
    path.write_bytes(_fix_checksums(raw, fb_off, fb_size))
    reader_work["tables"] = 0
    with pytest.raises(ProgramError, match="constants claims 2147483647 entries"):
        load_program(path)
    assert reader_work["tables"] < whole  # refused before any loop over the claimed entries


# -------------------------------------------------------------------------------------------------
# The runtime side imports nothing of the AOT side


def test_reader_imports_only_the_format():
    allowed = {"__future__", "dataclasses", "functools", "json", "keyword", "math", "mmap", "operator", "os", "re",
               "struct", "typing", "zlib", "enum", "hmac", "torch", "torch.utils._pytree", "safetensors", "xxhash", "flatbuffers",
               "..constant_methods", "..dtypes", "..errors", "..plan", "..program", "..symbolic", ".._device",
               ".header", ".generated", ".validate",
               ".consistency", ".convert", ".signing"}
    for name in ("reader.py", "convert.py", "header.py", "validate.py", "consistency.py", "signing.py"):
        tree = ast.parse((Path(__file__).parent.parent / "tritondelegate" / "serialize" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # "from . import header" -> ".header"
                prefix = "." * node.level + (node.module or "")
                mods = [prefix] if node.module else [prefix + a.name for a in node.names]
            else:
                continue
            for mod in mods:
                assert mod in allowed, f"{name} imports {mod}"
