"""``LoweredProgram.summary()``: what runs where, what is copied per call, what stays resident."""

from __future__ import annotations

from .inspection import segment_facts, state_facts, symbol_facts, symbols_line
from .kernels.traffic import method_traffic, traffic_line


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def method_facts(lowered, name: str) -> dict:
    """The figures of one method, as plain data (the demo's JSON uses them)."""
    report = lowered.reports[name]
    method = next(m for m in lowered.program.methods if m.name == name)
    nodes = report.nodes
    return {
        "nodes_total": nodes.total,
        "nodes_delegated": nodes.delegated,
        "view_nodes": nodes.views,
        "symbols": symbol_facts(method),
        "host_nodes": [{"node": n, "op": op, "reason": r} for n, op, r in nodes.host],
        "delegates": [
            {"name": tag, "device": method.delegates[i].device, "launches": report.launches[tag]}
            for i, tag in enumerate(report.launches)
        ],
        "per_call_copies": [c.__dict__ for c in report.device.copies],
        "resident_constants": [{"name": n, "device": d, "bytes": b} for n, d, b in report.device.resident],
        "state_in_place": list(report.inplace),
        "folded": list(report.folded),
        "fused": list(report.fused),
        "arenas": [
            {"device": a.device, "bytes": a.nbytes, "lower_bound_bytes": a.lower_bound, "alignment": a.alignment}
            for a in method.arenas
        ],
        "traffic": method_traffic(method),
    }


def format_summary(lowered) -> str:
    lines = []
    for name in lowered.method_names:
        f = method_facts(lowered, name)
        share = 100.0 * f["nodes_delegated"] / max(f["nodes_total"], 1)
        lines.append(f"method {name!r}")
        lines.append(
            f"  compute nodes: {f['nodes_total']}, delegated {f['nodes_delegated']} ({share:.1f}%); "
            f"view/layout nodes: {f['view_nodes']}"
        )
        if f["symbols"]:
            lines.append(f"  {symbols_line(f['symbols'])}")
        if f["host_nodes"]:
            lines.append(f"  on the host ({len(f['host_nodes'])}):")
            for h in f["host_nodes"]:
                lines.append(f"    {h['node']} [{h['op']}]: {h['reason']}")
        lines.append(f"  delegates ({len(f['delegates'])}):")
        for d in f["delegates"]:
            lines.append(f"    {d['name']} on {d['device']}: {d['launches']} kernel launches")
        if f["per_call_copies"]:
            h2d = sum(c["nbytes"] for c in f["per_call_copies"] if c["direction"] == "h2d")
            d2h = sum(c["nbytes"] for c in f["per_call_copies"] if c["direction"] == "d2h")
            lines.append(f"  per-call copies ({len(f['per_call_copies'])}: {_bytes(h2d)} host->device, "
                         f"{_bytes(d2h)} device->host):")
            for c in f["per_call_copies"]:
                route = f"host -> {c['device']}" if c["direction"] == "h2d" else f"{c['device']} -> host"
                lines.append(f"    {c['value']} ({route}), {_bytes(c['nbytes'])}: {c['reason']}")
        else:
            lines.append("  per-call copies: none")
        if f["resident_constants"]:
            total = sum(r["bytes"] for r in f["resident_constants"])
            lines.append(f"  resident constants ({len(f['resident_constants'])}, {_bytes(total)}, loaded once):")
            for r in f["resident_constants"]:
                lines.append(f"    {r['name']} on {r['device']}, {_bytes(r['bytes'])}")
        if f["fused"]:
            lines.append(f"  fused into bigger ops ({len(f['fused'])}):")
            lines.extend(f"    {rewrite}" for rewrite in f["fused"])
        if f["folded"]:
            lines.append(f"  computed once by lower() (constant folding): {', '.join(f['folded'])}")
        if f["state_in_place"]:
            lines.append(f"  state updated in place: {', '.join(f['state_in_place'])}")
        lines.append(f"  {traffic_line(f['traffic'], _bytes)}")
        for a in f["arenas"]:
            ratio = a["bytes"] / a["lower_bound_bytes"] if a["lower_bound_bytes"] else 1.0
            lines.append(
                f"  arena {a['device']}: {_bytes(a['bytes'])} (lower bound {_bytes(a['lower_bound_bytes'])}, "
                f"ratio {ratio:.3f})"
            )
    lines.extend(_program_lines(lowered))
    return "\n".join(lines)


def program_facts(lowered) -> dict:
    """Program-level memory: the state buffers and the per-device segments, as plain data."""
    state = state_facts(lowered.program)
    for s in state:  # why a buffer stays on the host is known at lower time only
        info = lowered.state.get(s["name"])
        s["reason"] = info.reason if info is not None and s["device"] == "cpu" else ""
    return {"state": state, "segments": segment_facts(lowered.program)}


def _program_lines(lowered) -> list[str]:
    facts = program_facts(lowered)
    lines = []
    if facts["state"]:
        lines.append(f"program state ({len(facts['state'])} buffers, one instance per loaded program, "
                     "shared by every method):")
        for s in facts["state"]:
            where = f"on the host: {s['reason']}" if s["device"] == "cpu" else f"on {s['device']}"
            lines.append(f"  {s['name']}, {_bytes(s['bytes'])}, {where}")
    for seg in facts["segments"]:
        what = "resident constants" if seg["kind"] == "constants" else "state buffers"
        lines.append(f"segment {seg['device']} {seg['kind']}: {_bytes(seg['bytes'])} ({seg['slots']} {what}, "
                     "loaded once per program)")
    return lines
