"""``tritondelegate inspect PROGRAM --plot arena.png``: a picture of a program's planned memory.

One panel per method arena and one per program segment. In an arena panel each planned value is a
rectangle: its lifetime along x (execution steps: one per copy or host op, one per kernel launch
inside a delegate), its bytes along y (offset in the arena). A delegate's scratch block is drawn over
the delegate's launches, with the temporaries its launches read and write inside it; the dashed line
is the arena's lower bound (the peak of bytes live at once: no plan can use less), the top of the
panel the planned size. A segment (resident constants, or state) lives as long as the loaded program:
its slots are full-width bars.

:func:`arena_rectangles` and :func:`arena_panels` are the picture as plain data (what is drawn where);
:func:`plot_arenas` draws it with matplotlib (the ``plot`` extra), imported only then.
"""

from __future__ import annotations

import math

from .plan import Base, KernelArgKind
from .program import InstrKind, Program, Role, value_lifetimes
from .symbolic import bound

# The kinds of rectangles, in legend order, and their colours (the benchmarks' report uses tab: colours).
COLORS = {
    "constant": "tab:blue",
    "state": "tab:orange",
    "input": "tab:green",
    "output": "tab:olive",
    "activation": "tab:red",
    "scratch": "lightgray",  # a delegate's scratch block
    "temporary": "tab:purple",  # inside a scratch block: what the delegate's launches read and write
}
LABELS = {"scratch": "scratch block", "temporary": "temporary (in scratch)"}


def _steps(method) -> list[int]:
    """Where each instruction starts along x (one entry more: the end): a delegate takes one step per
    launch, anything else one step."""
    starts = [0]
    for instr in method.instructions:
        width = len(method.delegates[instr.delegate].plan.launches) if instr.kind == InstrKind.DELEGATE else 1
        starts.append(starts[-1] + max(width, 1))
    return starts


def _value_kind(method, vid: int, copied_from: dict[int, int]) -> str:
    """What an arena value holds: a copy of a method input, a constant or state, an output (or what is
    copied into one), or an activation."""
    if vid in method.outputs or any(copied_from.get(o) == vid for o in method.outputs):
        return "output"
    source = vid
    while source in copied_from:
        source = copied_from[source]
    role = method.values[source].role
    if role == Role.INPUT:
        return "input"
    if role == Role.CONSTANT:
        return "constant"
    if role == Role.MUTABLE_BUFFER:
        return "state"
    return "activation"


def _hull(desc) -> tuple[int, int] | None:
    """The bytes ``[first, last + 1)`` a plan tensor spans (at the symbols' bounds); None when empty."""
    from .dtypes import parse_dtype

    shape, strides, offset = bound(tuple(desc.shape)), bound(tuple(desc.strides)), bound(desc.byte_offset)
    if math.prod(shape) == 0:
        return None
    itemsize = parse_dtype(desc.dtype).itemsize
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)  # in elements, from the view's start
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + 1
    return offset + low * itemsize, offset + high * itemsize


def _temporaries(method, instr, x0: int, panel: str, arena: int) -> list[dict]:
    """The scratch views the delegate's launches use, each over the launches that use it; views with the
    same bytes whose launch ranges meet are merged."""
    delegate = method.delegates[instr.delegate]
    plan = delegate.plan
    launches: dict[int, list[int]] = {}  # scratch view -> [first, last] launch that uses it
    for j, launch in enumerate(plan.launches):
        for arg in launch.args:
            if arg.kind == KernelArgKind.TENSOR and plan.tensors[arg.value].base == Base.SCRATCH:
                launches.setdefault(arg.value, [j, j])[1] = j
    uses: dict[tuple[int, int], list[list[int]]] = {}  # bytes -> launch ranges, merged where they meet
    for t, (first, last) in sorted(launches.items(), key=lambda item: item[1]):
        hull = _hull(plan.tensors[t])
        if hull is None:
            continue
        ranges = uses.setdefault(hull, [])
        if ranges and first <= ranges[-1][1] + 1:
            ranges[-1][1] = max(ranges[-1][1], last)
        else:
            ranges.append([first, last])
    rects = []
    for (lo, hi), ranges in sorted(uses.items()):
        for first, last in ranges:
            rects.append({"panel": panel, "method": method.name, "arena": arena, "kind": "temporary",
                          "name": f"{instr.name} temporary", "value": -1, "delegate": instr.delegate,
                          "x0": x0 + first, "x1": x0 + last + 1,
                          "offset": delegate.scratch_offset + lo, "nbytes": hi - lo})
    return rects


def arena_panels(program: Program) -> list[dict]:
    """One entry per panel: ``key``, ``title``, ``kind`` ("arena" or "segment"), ``device``, ``bytes``,
    ``lower_bound`` (arenas), ``steps`` (arenas: the x extent; instruction ``i`` spans
    ``[starts[i], starts[i + 1])``), ``starts`` and ``ticks`` ((x, label) per instruction of an arena,
    at its centre)."""
    panels = []
    for m in program.methods:
        starts = _steps(m)
        ticks = [((starts[i] + starts[i + 1]) / 2, _instruction_label(m, instr))
                 for i, instr in enumerate(m.instructions)]
        for a in m.arenas:
            panels.append({"key": f"{m.name} arena {a.device}", "kind": "arena", "method": m.name,
                           "device": a.device, "bytes": a.nbytes, "lower_bound": a.lower_bound,
                           "steps": starts[-1], "starts": starts, "ticks": ticks,
                           "title": f"method {m.name!r}, arena {a.device}: {_bytes(a.nbytes)} "
                                    f"(lower bound {_bytes(a.lower_bound)})"})
    for i, seg in enumerate(program.segments):
        kind = seg.kind.name.lower()
        slots = sum(1 for s in program.slots if s.segment == i)
        panels.append({"key": f"segment {seg.device} {kind}", "kind": "segment", "method": None,
                       "device": seg.device, "bytes": seg.nbytes, "lower_bound": None, "steps": 1, "starts": [],
                       "ticks": [],
                       "title": f"{seg.device} {kind} segment: {_bytes(seg.nbytes)}\n{slots} "
                                f"{'resident constants' if kind == 'constants' else 'state buffers'}"})
    return panels


def _instruction_label(method, instr) -> str:
    if instr.kind == InstrKind.DELEGATE:
        n = len(method.delegates[instr.delegate].plan.launches)
        return f"{instr.name} ({n} launch{'' if n == 1 else 'es'})"
    if instr.kind == InstrKind.HOST_OP:
        return f"host {instr.target.split('::')[-1]}"
    what = {InstrKind.COPY_H2D: "h2d", InstrKind.COPY_D2H: "d2h"}[instr.kind]
    return f"{what} {method.values[instr.inputs[0]].name}"


def arena_rectangles(program: Program) -> list[dict]:
    """Every rectangle of the picture, as plain data: ``panel`` (an :func:`arena_panels` key), ``kind``
    (a key of ``COLORS``), ``name``, ``x0``/``x1`` (steps, ``[x0, x1)``; segments: 0 to 1) and
    ``offset``/``nbytes`` (bytes in the arena or segment). Arena values carry their ``value`` id (-1
    otherwise), scratch blocks and temporaries their ``delegate``, slots their ``slot``."""
    rects = []
    for m in program.methods:
        starts = _steps(m)
        first, last = value_lifetimes(m)
        copied_from = {ins.outputs[0]: ins.inputs[0] for ins in m.instructions
                       if ins.kind in (InstrKind.COPY_H2D, InstrKind.COPY_D2H)}
        panel = {i: f"{m.name} arena {a.device}" for i, a in enumerate(m.arenas)}
        for vid, v in enumerate(m.values):
            if v.arena < 0 or vid not in first:
                continue
            rects.append({"panel": panel[v.arena], "method": m.name, "arena": v.arena,
                          "kind": _value_kind(m, vid, copied_from), "name": v.name, "value": vid, "delegate": -1,
                          "x0": starts[first[vid]], "x1": starts[min(last[vid] + 1, len(m.instructions))],
                          "offset": v.arena_offset, "nbytes": v.nbytes})
        for position, instr in enumerate(m.instructions):
            if instr.kind != InstrKind.DELEGATE:
                continue
            d = m.delegates[instr.delegate]
            if d.scratch_arena < 0:
                continue
            x0, x1 = starts[position], starts[position + 1]
            rects.append({"panel": panel[d.scratch_arena], "method": m.name, "arena": d.scratch_arena,
                          "kind": "scratch", "name": f"{instr.name} scratch", "value": -1,
                          "delegate": instr.delegate, "x0": x0, "x1": x1,
                          "offset": d.scratch_offset, "nbytes": d.plan.scratch_bytes})
            rects.extend(_temporaries(m, instr, x0, panel[d.scratch_arena], d.scratch_arena))
    for index, slot in enumerate(program.slots):
        if slot.segment < 0:
            continue
        seg = program.segments[slot.segment]
        rects.append({"panel": f"segment {seg.device} {seg.kind.name.lower()}", "method": None,
                      "kind": "state" if slot.state else "constant", "name": slot.name, "slot": index,
                      "value": -1, "delegate": -1, "x0": 0, "x1": 1, "offset": slot.offset,
                      "nbytes": program.constants[slot.constant].nbytes})
    return rects


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _byte_ticks(top: int) -> tuple[tuple[int, str], int]:
    """The unit of a byte axis up to ``top`` and a round tick step in it (1, 2 or 5 times a power of 10)."""
    unit = max((u for u in ((1, "B"), (1 << 10, "KiB"), (1 << 20, "MiB"), (1 << 30, "GiB")) if u[0] <= top),
               default=(1, "B"))
    rough = top / unit[0] / 6
    magnitude = 10 ** math.floor(math.log10(rough)) if rough > 0 else 1
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= rough)
    return unit, max(step * unit[0], 1)


def _bytes_in(y: float, unit: tuple[int, str]) -> str:
    return f"{y / unit[0]:g} {unit[1]}"


def _spaced(ticks: list[tuple[float, str]], gap: float) -> list[tuple[float, str]]:
    """The tick labels that fit: delegates' first, then host ops', then copies', none closer than ``gap``."""
    order = sorted(range(len(ticks)), key=lambda i: (not ticks[i][1].endswith(("launch)", "launches)")),
                                                     ticks[i][1][:3] in ("h2d", "d2h"), i))
    kept: list[int] = []
    for i in order:
        if all(abs(ticks[i][0] - ticks[k][0]) >= gap for k in kept):
            kept.append(i)
    return [ticks[i] for i in sorted(kept)]


def plot_arenas(program: Program, path: str, dpi: int = 120) -> int:
    """Draw every arena and segment of ``program`` into a PNG at ``path``; returns the panel count.
    Needs matplotlib (``pip install 'tritondelegate[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    panels = arena_panels(program)
    rects = arena_rectangles(program)
    arenas = [p for p in panels if p["kind"] == "arena"]
    segments = [p for p in panels if p["kind"] == "segment"]
    rows = max(len(arenas), len(segments), 1)
    columns = (1 if arenas else 0) + (1 if segments else 0) or 1
    fig, axes = plt.subplots(rows, columns, figsize=(10 if columns == 2 else 8, 0.6 + 2.6 * rows), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]} if columns == 2 else None)
    where = {p["key"]: axes[i][0] for i, p in enumerate(arenas)}
    where.update({p["key"]: axes[i][columns - 1] for i, p in enumerate(segments)})
    for row in axes:
        for ax in row:
            ax.set_visible(any(ax is a for a in where.values()))
    for p in panels:
        ax = where[p["key"]]
        mine = [r for r in rects if r["panel"] == p["key"]]
        top = max([p["bytes"], *(r["offset"] + r["nbytes"] for r in mine)]) or 1
        for r in mine:
            block = r["kind"] == "scratch"
            ax.add_patch(Rectangle((r["x0"], r["offset"]), r["x1"] - r["x0"], r["nbytes"],
                                   facecolor=COLORS[r["kind"]], alpha=0.5 if block else 0.85,
                                   edgecolor="gray" if block else "white", linewidth=0.6,
                                   zorder=1 if block else 2))
            big = r["nbytes"] >= 0.07 * top and (r["x1"] - r["x0"]) >= 0.12 * p["steps"]
            if big and r["kind"] != "temporary" and not (block and p["kind"] == "arena" and len(mine) > 3):
                ax.text((r["x0"] + r["x1"]) / 2, r["offset"] + r["nbytes"] / 2, r["name"], ha="center",
                        va="center", fontsize=6, clip_on=True, zorder=3)
        ax.set_xlim(0, p["steps"])
        ax.set_ylim(0, top)
        unit, step = _byte_ticks(top)
        ax.yaxis.set_major_locator(MultipleLocator(step))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _, unit=unit: _bytes_in(y, unit)))
        ax.set_title(p["title"], fontsize=9 if p["kind"] == "arena" else 8)
        ax.tick_params(labelsize=7)
        if p["kind"] == "arena":
            ax.axhline(p["lower_bound"], color="black", linestyle="--", linewidth=1, zorder=4)
            for x in p["starts"][1:-1]:
                ax.axvline(x, color="gray", linewidth=0.4, alpha=0.5, zorder=0)
            ticks = _spaced(p["ticks"], p["steps"] / 8)
            ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=6)
            ax.set_xlabel("execution step (one per copy or host op, one per launch inside a delegate)", fontsize=7)
            ax.set_ylabel("offset in the arena", fontsize=7)
        else:
            ax.set_xticks([])
            ax.set_xlabel("the loaded program's lifetime", fontsize=7)
            ax.set_ylabel("offset in the segment", fontsize=7)
    kinds = [k for k in COLORS if any(r["kind"] == k for r in rects)]
    handles = [Patch(facecolor=COLORS[k], alpha=0.85, label=LABELS.get(k, k)) for k in kinds]
    if arenas:
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1, label="arena lower bound"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return len(panels)
