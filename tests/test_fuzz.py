"""Fuzzing the program format: 300 re-sealed mutants (the flatbuffer changed, byte by byte or field by
field, its checksums recomputed) of a tiny program with one delegate of six launches, run in one
subprocess (scripts/fuzz_campaign.py --in-process). Every mutant must fail with a ProgramError or run to
exactly the outputs of the good program: no crash, no hang, no other exception, no other output; except
a mutant that changed only a launch plan and passed the load-time verifier ("different-plan": memory-safe,
a program computing something else, which no load-time check can tell from a real one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_campaign.py"


def test_resealed_mutants_fail_cleanly_or_run_the_same():
    cmd = [sys.executable, str(SCRIPT), "-n", "300", "--programs", "resident", "--kinds", "resealed",
           "--seed", "1", "--in-process", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.stdout.strip(), f"the fuzz run died (exit code {result.returncode}): {result.stderr[-3000:]}"
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])
    print(row)
    outcomes = ("ProgramError", "identical", "different-plan", "non-ProgramError", "different")
    assert sum(row[k] for k in outcomes) == 300
    assert row["ProgramError"] > 100 and row["identical"] > 10  # both outcomes occur: the mutants are varied
    assert {k: row[k] for k in ("non-ProgramError", "different")} == {"non-ProgramError": 0, "different": 0}, \
        row["cases"]


def test_signed_resealed_mutants_are_all_refused():
    # A re-sealed mutant keeps the good file's signature: only the signature tells it from the real
    # program, so none may run (identical mutants are the ones whose bytes did not change).
    cmd = [sys.executable, str(SCRIPT), "-n", "60", "--programs", "resident", "--kinds", "resealed",
           "--seed", "2", "--in-process", "--json", "--signed"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.stdout.strip(), f"the fuzz run died (exit code {result.returncode}): {result.stderr[-3000:]}"
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["ProgramError"] + row["identical"] == 60 and row["ProgramError"] > 40, row
