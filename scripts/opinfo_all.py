"""Every OpInfo sample (sample_inputs and reference_inputs) of every registry op, on the simulated device.

    python scripts/opinfo_all.py [--per-dtype N] [--reference] [--json PATH] [--only SUBSTRING ...]

The OpInfos that exercise each ATen op of the kernel registry (``tests/opinfo_cases.py``) give all of
their samples (at most N per dtype with ``--per-dtype``; their reference inputs too with
``--reference``) in fp32, one of fp16/bf16 and an integer type; each is exported, lowered with the
project's partitioner and run as sampled and with NaN, inf and -inf in its floating inputs, then
compared with eager. Prints one table per kernel family: the registry ops of the family, the samples
whose graph holds one of them, how many were delegated (one of them claimed), matched, refused (one of
them left on the host, with its reason) and mismatched or raised; then every failing sample. ``tests/
test_opinfo.py`` runs a few samples per op of the same machinery in CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import opinfo_cases as oc  # noqa: E402
from tritondelegate.partitioner import op_name  # noqa: E402

COLUMNS = ("ops", "samples", "delegated", "matched", "refused", "mismatched/raised")


def table(records: list) -> dict[str, dict[str, int]]:
    """Kernel family -> the counts of :data:`COLUMNS` (a sample counts in every family it touches)."""
    rows = collections.defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    for target in oc.targets():
        rows[oc.family(target)]["ops"] += 1
    for r in records:
        if r.status in ("not exported", "not run"):
            continue
        for fam in {oc.family(t) for t in r.targets}:
            row = rows[fam]
            mine = {t for t in r.targets if oc.family(t) == fam}
            claimed = mine & r.claimed
            row["samples"] += 1
            row["delegated"] += bool(claimed)
            row["matched"] += bool(claimed) and r.status == "matched"
            row["refused"] += any(op in {op_name(t) for t in mine - claimed} for _, op, _ in r.refused)
            row["mismatched/raised"] += r.failed
    return dict(sorted(rows.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every sample's verdict here")
    parser.add_argument("--only", nargs="*", help="OpInfo ids containing one of these")
    parser.add_argument("--chunk", type=int, default=64, help="samples lowered as one module")
    parser.add_argument("--per-dtype", type=int, help="at most this many samples per OpInfo and dtype")
    parser.add_argument("--reference", action="store_true", help="also the OpInfos' reference inputs")
    args = parser.parse_args()
    start = time.time()
    infos = {oc.info_id(i): i for t in oc.targets() for i in oc.candidates(t)}
    if args.only:
        infos = {k: v for k, v in infos.items() if any(s in k for s in args.only)}
    limit = None if args.per_dtype is None else {"int": args.per_dtype, **dict.fromkeys(oc.TOLERANCES, args.per_dtype)}
    records = []
    for reference in (False, True) if args.reference else (False,):
        records += oc.run_infos(list(infos.values()), limit, reference=reference, chunk=args.chunk)
    rows = table(records)
    width = max(map(len, rows)) + 2
    print(f"{'family':<{width}}" + "".join(f"{c:>19}" for c in COLUMNS))
    for fam, row in rows.items():
        print(f"{fam:<{width}}" + "".join(f"{row[c]:>19}" for c in COLUMNS))
    total = {c: sum(row[c] for row in rows.values()) for c in COLUMNS}
    print(f"{'total':<{width}}" + "".join(f"{total[c]:>19}" for c in COLUMNS))
    statuses = collections.Counter(r.status for r in records)
    print(f"\n{len(records)} samples of {len(infos)} OpInfos: {dict(statuses)} in {time.time() - start:.0f} s")
    unreached = sorted(op_name(t) for t in oc.targets() if not any(t in r.targets for r in records))
    print(f"registry ops no sample reaches ({len(unreached)}): {', '.join(unreached)}")
    for r in records:
        if r.failed:
            print("FAILED", r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"info": r.info, "dtype": str(r.dtype), "index": r.index, "status": r.status,
                        "detail": r.detail, "claimed": sorted(map(op_name, r.claimed)),
                        "refused": r.refused} for r in records], f, indent=1)
    return 1 if any(r.failed for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
