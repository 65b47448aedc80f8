"""``LoweredProgram.summary()``: what runs where, what is copied per call, what stays resident.

It leads with one table row per method (nodes delegated, delegates, launches and bytes per call,
resident constants and state, arena against its lower bound, modelled traffic against its lower
bound), then the details of each method, grouped so that a model with hundreds of weights still fits
on a screen: copies and resident constants by size (the largest ``LIMIT``, then one line for the
rest), nodes left on the host by op with a count and one reason, graph rewrites by kind.
``summary(verbose=True)`` lists every item instead.
"""

from __future__ import annotations

import re
from collections import Counter

from .inspection import human_bytes as _bytes, segment_facts, state_facts, symbol_facts, symbols_line
from .kernels.traffic import method_traffic, traffic_line
from .program import Role

LIMIT = 10  # items listed per group before "N more" (verbose=True: all)


def method_facts(lowered, name: str) -> dict:
    """The figures of one method, as plain data (the demo's JSON uses them)."""
    report = lowered.reports[name]
    method = next(m for m in lowered.program.methods if m.name == name)
    nodes = report.nodes
    state_slots = {v.slot for v in method.values if v.role == Role.MUTABLE_BUFFER and v.slot >= 0}
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
        "state_bytes": sum(lowered.program.constants[lowered.program.slots[s].constant].nbytes for s in state_slots),
        "state_in_place": list(report.inplace),
        "folded": list(report.folded),
        "fused": list(report.fused),
        "arenas": [
            {"device": a.device, "bytes": a.nbytes, "lower_bound_bytes": a.lower_bound, "alignment": a.alignment}
            for a in method.arenas
        ],
        "traffic": method_traffic(method),
    }


def format_summary(lowered, verbose: bool = False) -> str:
    facts = {name: method_facts(lowered, name) for name in lowered.method_names}
    lines = _table(facts)
    for name, f in facts.items():
        lines.append("")
        lines.extend(_method_lines(name, f, verbose))
    program = program_facts(lowered)
    if program["state"] or program["segments"]:
        lines.append("")
        lines.extend(_program_lines(program, verbose))
    target = getattr(lowered, "target", None)
    if target is not None:
        lines += ["", f"launch configurations chosen for {target.describe()}"]
    if not verbose and (any(_shortened(f) for f in facts.values()) or len(program["state"]) > LIMIT + 1):
        lines.append("")
        lines.append("(summary(verbose=True) lists every item)")
    return "\n".join(lines)


# --- the per-method table -------------------------------------------------------------------------
def _copy_bytes(f: dict, direction: str) -> int:
    return sum(c["nbytes"] for c in f["per_call_copies"] if c["direction"] == direction)


def _pair(value: int, bound: int) -> str:
    return f"{_bytes(value)} ({_bytes(bound)})"


def _table(facts: dict[str, dict]) -> list[str]:
    header = ["method", "delegated", "delegates", "launches", "in/call", "out/call", "constants", "state",
              "arena (bound)", "traffic (bound)"]
    rows = []
    for name, f in facts.items():
        share = int(100 * f["nodes_delegated"] / max(f["nodes_total"], 1))  # 100% only when all are
        t = f["traffic"]
        rows.append([
            name,
            f"{f['nodes_delegated']}/{f['nodes_total']} {share}%",
            str(len(f["delegates"])),
            str(sum(d["launches"] for d in f["delegates"])),
            _bytes(_copy_bytes(f, "h2d")),
            _bytes(_copy_bytes(f, "d2h")),
            _bytes(sum(r["bytes"] for r in f["resident_constants"])),
            _bytes(f["state_bytes"]),
            _pair(sum(a["bytes"] for a in f["arenas"]), sum(a["lower_bound_bytes"] for a in f["arenas"])),
            _pair(t["bytes"], t["lower_bound"]) if t["bytes"] else "-",
        ])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):  # the method name left-aligned, the figures right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *(line(r) for r in rows),
            "(in/out: bytes copied to and from the device per call; constants: resident, loaded once; "
            "(bound): the lower bound)"]


# --- the details of one method --------------------------------------------------------------------
def _shortened(f: dict) -> bool:
    """Whether the default summary of this method leaves anything out."""
    return (any(len(f[k]) > LIMIT + 1 for k in ("per_call_copies", "resident_constants", "delegates"))
            or any(len(f[k]) > LIMIT // 2 for k in ("folded", "state_in_place"))
            or len(f["fused"]) > len({_rewrite_kind(r) for r in f["fused"]})
            or len(f["host_nodes"]) > len({h["op"] for h in f["host_nodes"]}))


def _largest(items: list[dict], key: str, verbose: bool, show, unit=_bytes) -> list[str]:
    """``show(item)`` for the largest ``LIMIT`` items by ``key`` (all of them, in order, when verbose), then
    one line for the rest: how many and their total."""
    if verbose or len(items) <= LIMIT + 1:  # one item more costs no more than the line for it
        return [show(i) for i in items]
    ordered = sorted(items, key=lambda i: -i[key])  # stable: ties keep the program's order
    rest = ordered[LIMIT:]
    return [*(show(i) for i in ordered[:LIMIT]), f"{len(rest)} more, {unit(sum(i[key] for i in rest))}"]


def _names(names: list[str], verbose: bool, limit: int = LIMIT // 2) -> str:
    """A list of names on one line: the first ``limit`` and how many more (verbose: all)."""
    if verbose or len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def _rewrite_kind(description: str) -> str:
    """What a rewrite's description (``passes/fuse*.py``) starts with, before the node names:
    ``rms_norm: mul_2 (...)`` -> ``rms_norm``, ``rotary embedding of q -> ...`` -> ``rotary embedding``,
    ``linear x3 -> one GEMM: ...`` -> ``linear x3``."""
    return re.split(r":|\(| of | -> ", description, maxsplit=1)[0].strip() or description


def _kinds_line(descriptions: list[str]) -> str:
    kinds = list(Counter(_rewrite_kind(d) for d in descriptions).items())
    shown = ", ".join(f"{kind} ({n})" for kind, n in kinds[:LIMIT])
    return shown + (f" and {len(kinds) - LIMIT} more kinds" if len(kinds) > LIMIT else "")


def _host_lines(host: list[dict], verbose: bool) -> list[str]:
    if verbose:
        return [f"{h['node']} [{h['op']}]: {h['reason']}" for h in host]
    by_op: dict[str, list[dict]] = {}
    for h in host:
        by_op.setdefault(h["op"], []).append(h)
    lines = []
    for op, nodes in sorted(by_op.items(), key=lambda item: -len(item[1])):
        reasons = Counter(h["reason"] for h in nodes)
        reason = reasons.most_common(1)[0][0]
        n = len(reasons) - 1
        others = f" (and {n} other reason{'s' if n > 1 else ''})" if n else ""
        names = [h["node"] for h in nodes]
        shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        lines.append(f"{op} x{len(nodes)} ({shown}): {reason}{others}")
    return lines


def _method_lines(name: str, f: dict, verbose: bool) -> list[str]:
    share = 100.0 * f["nodes_delegated"] / max(f["nodes_total"], 1)
    lines = [f"method {name!r}",
             f"  compute nodes: {f['nodes_total']}, delegated {f['nodes_delegated']} ({share:.1f}%); "
             f"view/layout nodes: {f['view_nodes']}"]
    if f["symbols"]:
        lines.append(f"  {symbols_line(f['symbols'])}")
    if f["host_nodes"]:
        ops = len({h["op"] for h in f["host_nodes"]})
        lines.append(f"  on the host ({len(f['host_nodes'])} nodes, {ops} ops):")
        lines.extend(f"    {line}" for line in _host_lines(f["host_nodes"], verbose))
    delegates = f["delegates"]
    if len(delegates) == 1:
        d = delegates[0]
        lines.append(f"  delegates (1): {d['name']} on {d['device']}, {d['launches']} kernel launches")
    else:
        lines.append(f"  delegates ({len(delegates)}):")
        lines.extend(f"    {line}" for line in _largest(
            delegates, "launches", verbose, lambda d: f"{d['name']} on {d['device']}: {d['launches']} kernel launches",
            unit=lambda n: f"{n} kernel launches"))
    copies = f["per_call_copies"]
    if copies:
        lines.append(f"  per-call copies ({len(copies)}: {_bytes(_copy_bytes(f, 'h2d'))} host->device, "
                     f"{_bytes(_copy_bytes(f, 'd2h'))} device->host):")

        def copy_line(c):
            route = f"host -> {c['device']}" if c["direction"] == "h2d" else f"{c['device']} -> host"
            return f"{c['value']} ({route}), {_bytes(c['nbytes'])}: {c['reason']}"

        lines.extend(f"    {line}" for line in _largest(copies, "nbytes", verbose, copy_line))
    else:
        lines.append("  per-call copies: none")
    resident = f["resident_constants"]
    if resident:
        total = sum(r["bytes"] for r in resident)
        order = "" if verbose or len(resident) <= LIMIT + 1 else ", largest first"
        lines.append(f"  resident constants ({len(resident)}, {_bytes(total)}, loaded once{order}):")
        lines.extend(f"    {line}" for line in _largest(
            resident, "bytes", verbose, lambda r: f"{r['name']} on {r['device']}, {_bytes(r['bytes'])}"))
    if f["fused"]:
        kinds = "" if verbose else f" {_kinds_line(f['fused'])}"
        lines.append(f"  fused into bigger ops ({len(f['fused'])}):{kinds}")
        if verbose:
            lines.extend(f"    {rewrite}" for rewrite in f["fused"])
    if f["folded"]:
        lines.append(f"  computed once by lower() (constant folding): {_names(f['folded'], verbose)}")
    if f["state_in_place"]:
        lines.append(f"  state updated in place: {_names(f['state_in_place'], verbose)}")
    lines.append(f"  {traffic_line(f['traffic'], _bytes)}")
    for a in f["arenas"]:
        ratio = a["bytes"] / a["lower_bound_bytes"] if a["lower_bound_bytes"] else 1.0
        lines.append(
            f"  arena {a['device']}: {_bytes(a['bytes'])} (lower bound {_bytes(a['lower_bound_bytes'])}, "
            f"ratio {ratio:.3f})"
        )
    return lines


# --- the program --------------------------------------------------------------------------------
def program_facts(lowered) -> dict:
    """Program-level memory: the state buffers and the per-device segments, as plain data."""
    state = state_facts(lowered.program)
    for s in state:  # why a buffer stays on the host is known at lower time only
        info = lowered.state.get(s["name"])
        s["reason"] = info.reason if info is not None and s["device"] == "cpu" else ""
    return {"state": state, "segments": segment_facts(lowered.program)}


def _program_lines(facts: dict, verbose: bool) -> list[str]:
    lines = []
    if facts["state"]:
        total = sum(s["bytes"] for s in facts["state"])
        lines.append(f"program state ({len(facts['state'])} buffers, {_bytes(total)}, one instance per loaded "
                     "program, shared by every method):")

        def state_line(s):
            where = f"on the host: {s['reason']}" if s["device"] == "cpu" else f"on {s['device']}"
            return f"{s['name']}, {_bytes(s['bytes'])}, {where}"

        lines.extend(f"  {line}" for line in _largest(facts["state"], "bytes", verbose, state_line))
    for seg in facts["segments"]:
        what = "resident constants" if seg["kind"] == "constants" else "state buffers"
        lines.append(f"segment {seg['device']} {seg['kind']}: {_bytes(seg['bytes'])} ({seg['slots']} {what}, "
                     "loaded once per program)")
    return lines
