"""The house is one-way: no import circle in the package, and a process that only runs programs loads
nothing of the lowering side and leaves Triton as it found it."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import torch

import tritondelegate as td

PACKAGE = pathlib.Path(td.__file__).parent
# What a process that loads and calls a saved program must never import.
LOWERING = ("partitioner", "passes", "emit", "lower", "decompose", "backend", "config", "kernels.builder",
            "kernels.fusion", "kernels.registry", "memory.planner", "memory.method_plan", "serialize.writer")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in its body (function-level imports included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module):
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_package_has_no_import_circle():
    paths = [p for p in PACKAGE.rglob("*.py") if "generated" not in p.parts]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    assert "tritondelegate.kernels.refs" in graph["tritondelegate.kernels.elementwise"]  # the walk sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the walk finds a planted circle
    assert _cycle({**graph, "tritondelegate.kernels.refs": {"tritondelegate.kernels.builder"}})


def test_running_a_program_loads_no_lowering_module_and_leaves_triton_alone(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        td.lower(torch.export.export(model, (x,)), partitioner=td.TritonPartitioner(device="cuda:0")).save(
            tmp_path / "m.tdp")
    torch.save((x, model(x).detach()), tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import json, os, sys
        import torch, triton
        import tritondelegate as td
        program = td.load({str(tmp_path / "m.tdp")!r}, devices="simulated")
        x, expected = torch.load({str(tmp_path / "io.pt")!r})
        out = program.load_method("forward")(x)

        @triton.jit
        def users_kernel(x_ptr):
            pass

        print(json.dumps({{
            "modules": sorted(m for m in sys.modules if m.startswith("tritondelegate")),
            "max_error": (out - expected).abs().max().item(),
            "interpret_env": os.environ.get("TRITON_INTERPRET"),
            "users_kernel": type(users_kernel).__name__,
        }}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (tmp_path / "run.py").write_text(code)  # a file: Triton reads a kernel's source
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["max_error"] < 1e-4  # the kernels really ran, interpreted on the simulated device
    loaded = [m for m in facts["modules"] if m.removeprefix("tritondelegate.").startswith(LOWERING)]
    assert loaded == [], loaded
    assert "tritondelegate.runtime.interpreter" in facts["modules"]  # the list is the real one
    # The simulated device interprets its own kernels: Triton's mode is untouched for everyone else.
    assert facts["interpret_env"] is None
    assert facts["users_kernel"] == "JITFunction"


def test_the_readme_layout_table_matches_the_tree():
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("## Layout"):readme.index("## Benchmarks")]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    named = set()
    for path_cell, what in rows:
        paths = [p.strip("` ") for p in path_cell.split(",")]
        folder = paths[0].rpartition("/")[0]
        for p in paths:
            full = p if "/" in p else f"{folder}/{p}"
            assert (PACKAGE.parent / full).exists(), f"the layout table names {full}, which does not exist"
            named.add(full.rstrip("/"))
        for module in re.findall(r"`(\w+\.py)`", what):  # modules a folder's row names
            full = f"{paths[0].rstrip('/')}/{module}"
            assert (PACKAGE.parent / full).exists(), f"the layout table names {full}, which does not exist"
            named.add(full)
    # every module of the package is in a row: by name, or by its folder's row
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if "generated" in rel or path.name == "__init__.py" and rel != "tritondelegate/__init__.py":
            continue
        assert rel in named or rel.rpartition("/")[0] in named - {"tritondelegate"}, \
            f"{rel} is in no row of the README's layout table"


def test_importing_the_lower_module_leaves_td_lower_the_function():
    """``from tritondelegate.lower import LoweredProgram`` (a type hint) imports the submodule of the same
    name as the export ``td.lower``; the export stays the function, in a fresh process."""
    code = textwrap.dedent("""
        import tritondelegate as td
        from tritondelegate.lower import LoweredProgram
        import tritondelegate.lower
        assert callable(td.lower) and td.lower.__module__ == "tritondelegate.lower", td.lower
        assert td.LoweredProgram is LoweredProgram
        from tritondelegate.serialize import reader
        assert callable(td.load)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
