"""``tritondelegate inspect PROGRAM``: what a program file holds, read without lowering anything.

Methods with their inputs, outputs, delegates and launches, and their modelled traffic (the bytes and
FLOPs the launches record, summed, next to the method's lower bound); constants (resident where, or
read on the host); program state; per-device segments and method arenas. It reads the file through the same
validating reader as ``td.load`` and imports nothing of the lowering side.
"""

from __future__ import annotations

from collections import Counter

from .constant_methods import decode as decode_constant_methods
from .kernels.traffic import method_traffic, si_units, traffic_line
from .program import InstrKind, Program, Role


def describe(program: Program) -> dict:
    """The program as plain data (what ``inspect --json`` prints)."""
    return {
        "format_version": program.version,
        "methods": [_method(program, m) for m in program.methods],
        "constants": _constants(program),
        "state": state_facts(program),
        "segments": segment_facts(program),
        "external_files": list(program.external_files),
        "binaries": [
            {"kernel": b.kernel, "arch": b.arch, "name": b.name, "bytes": b.nbytes,
             "triton_version": b.triton_version}
            for b in program.binaries
        ],
        "constant_methods": decode_constant_methods(program.constant_methods),
    }


def state_facts(program: Program) -> list[dict]:
    """Each state buffer: name, where it lives, bytes."""
    return [{"name": s.name, "device": s.device, "bytes": program.constants[s.constant].nbytes}
            for s in program.slots if s.state]


def segment_facts(program: Program) -> list[dict]:
    """Each per-device segment: device, kind, bytes, alignment, how many slots it holds."""
    return [{"device": seg.device, "kind": seg.kind.name.lower(), "bytes": seg.nbytes, "alignment": seg.alignment,
             "slots": sum(1 for s in program.slots if s.segment == i)}
            for i, seg in enumerate(program.segments)]


def symbol_facts(m) -> list[dict]:
    """Each dynamic dimension of method ``m``: its symbol, range, and the input dimension giving it."""
    return [{"name": s.name, "min": s.min, "max": s.max, "input": m.values[m.inputs[s.input]].name, "dim": s.dim}
            for s in m.symbols]


def symbols_line(symbols: list[dict]) -> str:
    dims = "; ".join(f"{s['name']} = {s['input']!r} dim {s['dim']} in {s['min']}..{s['max']}" for s in symbols)
    return f"dynamic dimensions: {dims} (memory planned, and sizes below given, at the upper bounds)"


def _tensor(value) -> dict:
    shape = [d if isinstance(d, int) else str(d) for d in value.shape]  # a dynamic dim as its expression
    return {"name": value.name, "dtype": value.dtype, "shape": shape, "device": value.device}


def _method(program: Program, m) -> dict:
    kinds = Counter(i.kind for i in m.instructions)
    delegates = []
    for instr in m.instructions:
        if instr.kind == InstrKind.DELEGATE:
            d = m.delegates[instr.delegate]
            delegates.append({"name": instr.name, "device": d.device, "launches": len(d.plan.launches),
                              "kernels": dict(Counter(launch.kernel for launch in d.plan.launches)),
                              "scratch_bytes": d.plan.scratch_bytes,
                              "launch_plan": [launch_facts(launch) for launch in d.plan.launches]})
    return {
        "name": m.name,
        "symbols": symbol_facts(m),
        "inputs": [_tensor(m.values[v]) for v in m.inputs],
        "outputs": [_tensor(m.values[v]) for v in m.outputs],
        "delegates": delegates,
        "launches_per_call": sum(d["launches"] for d in delegates),
        "host_ops": kinds[InstrKind.HOST_OP],
        "copies_per_call": {"h2d": kinds[InstrKind.COPY_H2D], "d2h": kinds[InstrKind.COPY_D2H]},
        "state_written_back": [m.values[b].name for b, _ in m.mutated_buffers],
        "arenas": [{"device": a.device, "bytes": a.nbytes, "lower_bound_bytes": a.lower_bound} for a in m.arenas],
        "traffic": method_traffic(m),
    }


def launch_facts(launch) -> dict:
    """One launch of a plan: its kernel, the nodes it computes, its grid (a dynamic size as its
    expression) and its modelled traffic."""
    return {"kernel": launch.kernel, "op": launch.op,
            "grid": [g if isinstance(g, int) else str(g) for g in launch.grid],
            "bytes_read": launch.bytes_read, "bytes_written": launch.bytes_written, "flops": launch.flops}


def format_launches(facts: dict) -> str:
    """Each method's launches in the order they run, with the bytes each reads and writes and its FLOPs
    (``inspect --launches``); the share of the method's modelled bytes each moves shows where fusion
    would pay."""
    lines = []
    for m in facts["methods"]:
        total = max(m["traffic"]["bytes"], 1)
        traffic = traffic_line(m["traffic"], human_bytes)
        lines.append(f"method {m['name']!r}: {m['launches_per_call']} launches, {traffic}")
        for d in m["delegates"]:
            lines.append(f"  {d['name']} on {d['device']}:")
            lines.append(f"    {'#':>4}  {'kernel':<18} {'grid':<16} {'read':>10} {'written':>10} {'share':>6} "
                         f"{'FLOPs':>8}  node")
            for k, launch in enumerate(d["launch_plan"]):
                moved = launch["bytes_read"] + launch["bytes_written"]
                grid = "x".join(map(str, launch["grid"]))
                read, written = human_bytes(launch["bytes_read"]), human_bytes(launch["bytes_written"])
                lines.append(f"    {k:>4}  {launch['kernel']:<18} {grid:<16} {read:>10} {written:>10} "
                             f"{moved / total:>6.1%} {si_units(launch['flops']):>8}  {launch['op']}")
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """A byte count in B, KiB, MiB or GiB (what ``summary()`` and ``inspect --launches`` print)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _constants(program: Program) -> list[dict]:
    resident: dict[int, set[str]] = {}
    state = set()
    for slot in program.slots:
        if slot.state:
            state.add(slot.constant)
        else:
            resident.setdefault(slot.constant, set()).add(slot.device)
    readers: dict[int, set[str]] = {}
    for m in program.methods:
        for v in m.values:
            if v.role == Role.CONSTANT and v.constant >= 0:
                readers.setdefault(v.constant, set()).add(m.name)
    return [
        {"name": c.name, "dtype": c.dtype, "shape": list(c.shape), "bytes": c.nbytes,
         "resident_on": sorted(resident.get(i, ())), "methods": sorted(readers.get(i, ())),
         "stored": program.external_files[c.external] if c.external >= 0 else "program file"}
        for i, c in enumerate(program.constants) if i not in state
    ]


def format_description(facts: dict) -> str:
    lines = [f"program format {facts['format_version']}"]
    for m in facts["methods"]:
        sig = lambda ts: ", ".join(f"{t['name']}: {t['dtype']}{t['shape']}@{t['device']}" for t in ts)  # noqa: E731
        lines.append(f"method {m['name']!r}: ({sig(m['inputs'])}) -> ({sig(m['outputs'])})")
        if m["symbols"]:
            lines.append(f"  {symbols_line(m['symbols'])}")
        lines.append(f"  {len(m['delegates'])} delegates, {m['launches_per_call']} launches per call, "
                     f"{m['host_ops']} host ops, copies per call: {m['copies_per_call']['h2d']} h2d, "
                     f"{m['copies_per_call']['d2h']} d2h")
        for d in m["delegates"]:
            kernels = ", ".join(f"{k} x{n}" for k, n in d["kernels"].items())
            lines.append(f"    {d['name']} on {d['device']}: {d['launches']} launches ({kernels})")
        if m["state_written_back"]:
            lines.append(f"  state written back after each call: {', '.join(m['state_written_back'])}")
        lines.append(f"  {traffic_line(m['traffic'], lambda n: f'{n} bytes')}")
        for a in m["arenas"]:
            lines.append(f"  arena {a['device']}: {a['bytes']} bytes (lower bound {a['lower_bound_bytes']})")
    total = sum(c["bytes"] for c in facts["constants"])
    on_device = sum(c["bytes"] for c in facts["constants"] if c["resident_on"])
    lines.append(f"constants: {len(facts['constants'])}, {total} bytes; resident on a device: {on_device} bytes")
    for s in facts["state"]:
        lines.append(f"state {s['name']}: {s['bytes']} bytes on {s['device']}")
    for seg in facts["segments"]:
        lines.append(f"segment {seg['device']} {seg['kind']}: {seg['bytes']} bytes, {seg['slots']} slots")
    by_arch: dict[str, list] = {}
    for b in facts["binaries"]:
        by_arch.setdefault(b["arch"], []).append(b)
    for arch, binaries in sorted(by_arch.items()):
        kernels = ", ".join(f"{k} x{n}" for k, n in Counter(b["kernel"] for b in binaries).items())
        lines.append(f"kernel binaries {arch} (Triton {binaries[0]['triton_version']}): {len(binaries)}, "
                     f"{sum(b['bytes'] for b in binaries)} bytes ({kernels})")
    if facts["constant_methods"]:
        lines.append("constant methods: " + ", ".join(f"{k} = {v!r}" for k, v in facts["constant_methods"].items()))
    return "\n".join(lines)

