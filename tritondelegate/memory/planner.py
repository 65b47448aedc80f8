"""Greedy-by-size memory planning, offset form, and its verifier.

Pure data in, pure data out: each value is (nbytes, first_use, last_use) in instruction order; the plan
is one offset per value and the arena size. Largest values are placed first, each at the lowest aligned
offset that does not collide with a value whose lifetime overlaps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..program import align_up


class PlanningError(RuntimeError):
    """An internal invariant of memory planning failed (a bug, not a user error)."""


@dataclass(frozen=True)
class Interval:
    nbytes: int
    first: int
    last: int


def _overlap_in_time(a: Interval, b: Interval) -> bool:
    return a.first <= b.last and b.first <= a.last


def greedy_by_size(values: list[Interval], alignment: int) -> tuple[list[int], int]:
    """Offsets for ``values`` (same order) and the arena size, a multiple of ``alignment``."""
    offsets = [0] * len(values)
    placed: list[int] = []
    order = sorted(range(len(values)), key=lambda i: (-values[i].nbytes, values[i].first, i))
    for i in order:
        value = values[i]
        size = align_up(max(value.nbytes, 1), alignment)
        busy = sorted(
            (offsets[j], offsets[j] + align_up(max(values[j].nbytes, 1), alignment))
            for j in placed
            if _overlap_in_time(values[j], value)
        )
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, align_up(end, alignment))
        offsets[i] = offset
        placed.append(i)
    total = max((offsets[i] + align_up(max(v.nbytes, 1), alignment) for i, v in enumerate(values)), default=0)
    verify(values, offsets, total)
    return offsets, total


def lower_bound(values: list[Interval], alignment: int = 1) -> int:
    """Peak of live bytes over time: no plan can use less.

    With an ``alignment``, every live value but the topmost also fills its padding (the next value
    starts at an aligned offset), so the bound counts aligned sizes less the largest single padding.
    """
    best = 0
    for t in sorted({v.first for v in values}):
        live = [v for v in values if v.first <= t <= v.last]
        aligned = sum(align_up(v.nbytes, alignment) for v in live)
        best = max(best, aligned - max((align_up(v.nbytes, alignment) - v.nbytes for v in live), default=0))
    return best


def verify(values: list[Interval], offsets: list[int], total: int) -> None:
    """Raise :class:`PlanningError` if two lifetime-overlapping values overlap in bytes."""
    spans = sorted(range(len(values)), key=lambda i: offsets[i])
    for a_pos, i in enumerate(spans):
        a_end = offsets[i] + values[i].nbytes
        if a_end > total:
            raise PlanningError(f"value {i} ends at {a_end}, past the arena size {total}")
        for j in spans[a_pos + 1 :]:
            if offsets[j] >= a_end:
                break
            if values[i].nbytes and values[j].nbytes and _overlap_in_time(values[i], values[j]):
                raise PlanningError(
                    f"values {i} and {j} are live together and overlap at bytes "
                    f"[{offsets[j]}, {min(a_end, offsets[j] + values[j].nbytes)})"
                )
