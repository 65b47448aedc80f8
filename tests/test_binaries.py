"""Kernel binaries at lower time (``LowerConfig(kernel_archs=...)``), compiled without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate import cli
from tritondelegate.models import MLP
from tritondelegate.plan import KernelArgKind
from tritondelegate.runtime.binaries import usable
from tritondelegate.serialize import load_program

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True),
                        kernel_archs=("sm_90", "sm_80"))


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    torch.manual_seed(0)
    model, x = MLP([33, 64, 17]).eval(), torch.randn(5, 33)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, (x,)), config=CONFIG)
    path = tmp_path_factory.mktemp("bin") / "mlp.tdp"
    lowered.save(path)
    return lowered, model, x, path


def _variant(delegate, launch) -> tuple:
    """What Triton specializes a launch on: kernel, constexprs, argument types, 16-byte alignment of
    addresses, integers equal to 1 or divisible by 16."""
    args = []
    for a in launch.args:
        if a.kind == KernelArgKind.TENSOR:
            desc = delegate.plan.tensors[a.value]
            args.append((desc.dtype, desc.byte_offset % 16 == 0))
        elif a.kind == KernelArgKind.INT:
            args.append(("int", a.value == 1, a.value % 16 == 0))
        else:
            args.append((type(a.value).__name__,))
    return launch.kernel, tuple(sorted((k, v.value) for k, v in launch.constexprs.items())), tuple(args)


def test_every_distinct_variant_has_one_binary_per_arch(lowered):
    lowered, *_ = lowered
    program = lowered.program
    variants = {_variant(d, launch) for m in program.methods for d in m.delegates for launch in d.plan.launches}
    for arch in CONFIG.kernel_archs:
        mine = [b for b in program.binaries if b.arch == arch]
        assert len(mine) == len(variants)
        assert sorted(b.kernel for b in mine) == sorted(v[0] for v in variants)
        assert all(b.triton_version and len(b.cache_key) == 64 and b.nbytes > 1000 for b in mine)
    assert len({b.checksum for b in program.binaries}) == len(program.binaries)  # stored once each
    assert len(lowered.binary_data) == len(program.binaries)


def test_binaries_round_trip_and_the_simulated_device_runs_the_program(lowered):
    lowered, model, x, path = lowered
    with load_program(path) as f:
        assert f.program.binaries == [
            b.__class__(**{**b.__dict__, "data_offset": loaded.data_offset})
            for b, loaded in zip(lowered.program.binaries, f.program.binaries)]
        assert [f.binary_bytes(i) for i in range(len(f.program.binaries))] == lowered.binary_data
    method = td.load(path, devices="simulated").load_method()
    with torch.no_grad():
        torch.testing.assert_close(method(x), model(x), atol=1e-4, rtol=1e-4)


def test_inspect_lists_the_binaries(lowered, capsys):
    lowered, _, _, path = lowered
    assert cli.main(["inspect", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["binaries"]
    assert {(b["kernel"], b["arch"], b["bytes"]) for b in listed} == {
        (b.kernel, b.arch, b.nbytes) for b in lowered.program.binaries}


def test_damaged_binaries_are_program_errors(lowered, tmp_path):
    _, _, _, path = lowered
    data = bytearray(path.read_bytes())
    with load_program(path) as f:
        b = f.program.binaries[0]
        start = f.data_offset + b.data_offset
    data[start + 100] ^= 0xFF
    bad = tmp_path / "bad.tdp"
    bad.write_bytes(bytes(data))
    with pytest.raises(td.ProgramError, match=rf"kernel binary 0 \('{b.kernel}', {b.arch}\).*checksum"):
        td.load(bad)


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="unknown arch.*'sm_75'.*valid: sm_80, sm_86, sm_89, sm_90, sm_100"):
        td.lower(torch.export.export(MLP([4, 4]), (torch.randn(1, 4),)), config=td.LowerConfig(kernel_archs=("sm_75",)))


def test_binaries_that_do_not_fit_the_device_say_why(lowered):
    binaries = lowered[0].program.binaries
    version = binaries[0].triton_version
    assert usable(binaries, "sm_89", version) == ([], usable(binaries, "sm_89", version)[1])
    assert "this device is sm_89" in usable(binaries, "sm_89", version)[1]
    assert "built by Triton" in usable(binaries, "sm_90", "0.0")[1]
    indices, problem = usable(binaries, "sm_90", version)
    assert problem is None and {binaries[i].arch for i in indices} == {"sm_90"}


WORKER = textwrap.dedent("""
    import json, os, sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from tritondelegate.binaries import request_for
    from tritondelegate.kernels.compile import decode_args, specialize
    from tritondelegate.kernels.table import KERNELS
    from tritondelegate.runtime.binaries import install
    from tritondelegate.serialize import load_program

    with load_program(sys.argv[1]) as f:
        mine = [i for i, b in enumerate(f.program.binaries) if b.arch == "sm_90"]
        print(sum(install(f.program.binaries[i], f.binary_bytes(i)) for i in mine))
        launch = request_for(f.program, ["sm_90"])["launches"][0]
        kernel, target = KERNELS[launch["kernel"]], GPUTarget("cuda", 90, 32)
        options, sig, consts, attrs = specialize(kernel, make_backend(target), decode_args(launch["args"]),
                                                 launch["constexprs"])
        compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target, options=options.__dict__)
        stored = {f.program.binaries[i].cache_key: f.binary_bytes(i) for i in mine}
        print(compiled.hash in stored, compiled.asm["cubin"] == stored.get(compiled.hash))
    print(sorted({name.rsplit(".", 1)[-1] for _, _, files in os.walk(os.environ["TRITON_CACHE_DIR"])
                  for name in files if not name.startswith("__grp__")}))
""")


def test_installed_binaries_are_what_tritons_compile_finds(lowered, tmp_path):
    """On a machine with this Triton, the installed binaries are cache hits: compile() returns them and
    writes no intermediate (ttir, ptx) of its own."""
    _, _, _, path = lowered
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run([sys.executable, "-c", WORKER, str(path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    installed, hit, files = done.stdout.strip().splitlines()
    assert int(installed) == sum(b.arch == "sm_90" for b in lowered[0].program.binaries)
    assert hit == "True True"
    assert files == "['cubin', 'json']"
