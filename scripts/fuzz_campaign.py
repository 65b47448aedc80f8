#!/usr/bin/env python
"""Fuzz campaign over program files: mutated files must load and run to the same outputs, or fail with a
ProgramError; never crash the process, hang, raise another exception or run to different outputs.

Three programs (built here, tiny, run on the simulated device): ``resident`` (one method, constants
resident on the device, several launches), ``two_methods`` (two methods sharing weights and device
state), ``external`` (``resident`` with its weights in an external safetensors file). Each gets N *raw*
mutants (bit flips, words, truncations anywhere in the program file or its weights file, checksums left
as they are) and N *re-sealed* mutants (the flatbuffer changed, byte by byte or field by field through
the generated object API, then its checksums and the header recomputed as the writer does, so the
loader's structural checks and the runtime see the damage). Prints one row per program and kind:

    python scripts/fuzz_campaign.py                 # 1000 raw + 1000 re-sealed mutants per program
    python scripts/fuzz_campaign.py -n 200 --programs resident --kinds resealed
    python scripts/fuzz_campaign.py --in-process    # no watchdog: one process runs everything
    python scripts/fuzz_campaign.py --programs resident --show resealed:5   # what mutant 5 changed
    python scripts/fuzz_campaign.py --signed        # the programs signed (LoweredProgram.save(key=...))

With ``--signed`` each program is saved with a secret key and loaded with it; a re-sealed mutant keeps
the good file's signature trailer (all that someone without the key can do), so only the signature
tells it from the real program: every mutant must then be a ProgramError or identical.

Each mutant runs in a worker process watched by this one: a worker that dies is a crash, one silent for
``--timeout`` seconds a hang; the worker is restarted after the mutant. ``--in-process`` runs all
mutants in this process (tests/test_fuzz.py: a crash or hang then fails the whole run). ``--json``
prints the counts and the first few cases of each bad outcome as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

PROGRAMS = ("resident", "two_methods", "external")
KINDS = ("raw", "resealed")
OUTCOMES = ("crash", "hang", "non-ProgramError", "different", "ProgramError", "different-plan", "identical")
KEY = b"fuzz campaign signing key"
BAD = OUTCOMES[:4]
# "different-plan": a re-sealed mutant that changed only a delegate's launch plan (kernel arguments,
# constexprs, grids, launches, tensor views) and that the load-time verifier (runtime/verify.py) let
# through: every access stays inside the memory the plan was given, so the file computes something
# else, as an edited model would. No load-time check can tell such an edit from a real program; only
# authenticating the file could. Every other different output is a defect.
SCALARS = (int, float, str, bytes, bool)
INTERESTING = (0, 1, 2, 3, 7, 8, 255, 256, 4096, 65535, 65536, 100000, 2**31 - 1, 2**31, 2**32 - 1, 2**40,
               -1, -2, -(2**31))


# -------------------------------------------------------------------------------------------------
# The programs


def _models():
    """The models of the three programs: the safety tests' ``Tiny`` (one delegate of several
    launches) and the state tests' ``Accumulate``/``Read`` (two methods sharing a weight and state)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_safety import Tiny
    from test_state import Accumulate, Read

    return Tiny, Accumulate, Read


def build(name: str, folder: Path, signed: bool = False) -> Path:
    """Lowers program ``name`` into ``folder`` (program.tdp, its weights file, calls.pt, and with
    ``signed`` the key it was signed with); returns folder."""
    import torch

    import tritondelegate as td

    torch.manual_seed(0)
    Tiny, Step, Read = _models()
    resident = td.PropagateDeviceConfig(skip_h2d_for_constants=True)
    if name == "two_methods":
        step = Step()
        x = torch.randn(4, 8)
        eps = {"step": torch.export.export(step, (x,)), "read": torch.export.export(Read(step), (x,))}
        calls = [("step", (x,)), ("read", (x,)), ("step", (-x,)), ("read", (x,))]
        config = td.LowerConfig(propagate_device=resident)
    else:
        x = torch.randn(3, 8)
        eps = torch.export.export(Tiny().eval(), (x,))
        calls = [("forward", (x,))]
        config = td.LowerConfig(propagate_device=resident, external_constants=name == "external")
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        key = KEY if signed else None
        td.lower(eps, config=config).save(folder / "program.tdp", key=key)
    if signed:
        (folder / "key").write_bytes(KEY)
    torch.save(calls, folder / "calls.pt")
    return folder


# -------------------------------------------------------------------------------------------------
# Running a (mutated) program


def _key(folder: Path) -> bytes | None:
    """The key a signed program was saved with (``build(signed=True)``), None for an unsigned one."""
    return (folder / "key").read_bytes() if (folder / "key").exists() else None


def run_program(folder: Path, names: list[str] | None = None):
    """Loads ``folder/program.tdp``, loads every method, makes the recorded calls: their outputs. A call
    names its method by its position in ``names`` (the good program's methods), so a mutant that only
    renames a method runs the same calls."""
    import torch
    import torch.utils._pytree as pytree

    import tritondelegate as td

    calls = torch.load(folder / "calls.pt", weights_only=True)
    program = td.load(folder / "program.tdp", devices="simulated", key=_key(folder))
    position = {name: k for k, name in enumerate(names or program.method_names)}
    methods = [program.load_method(name) for name in program.method_names]
    if len(methods) != len(position):
        raise LookupError(f"the program has {len(methods)} methods, the calls are for {len(position)}")
    return [pytree.tree_leaves(methods[position[name]](*args)) for name, args in calls]


def outcome(folder: Path, reference, names: list[str]) -> tuple[str, str]:
    import torch

    from tritondelegate import ProgramError

    try:
        got = run_program(folder, names)
    except ProgramError:
        return "ProgramError", ""
    except Exception as e:  # noqa: BLE001 - every other exception is a finding
        return "non-ProgramError", f"{type(e).__name__}: {str(e)[:300]}"
    for k, (g, r) in enumerate(zip(got, reference)):
        for a, b in zip(g, r):
            if not (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
                return "different", f"call {k}: an output of another type or shape"
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
                return "different", f"call {k}: outputs differ by up to {diff:.3g}"
    if len(got) != len(reference) or any(len(g) != len(r) for g, r in zip(got, reference)):
        return "different", "another number of outputs"
    return "identical", ""


def show(folder: Path, kind: str, seed: int, index: int) -> None:
    """Prints how mutant ``index`` differs from the good program, field by field, and its outcome."""
    import dataclasses

    import tritondelegate as td
    from tritondelegate.serialize import load_program

    def diff(a, b, path):
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            for f in dataclasses.fields(a):
                yield from diff(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                yield from diff(x, y, f"{path}[{i}]")
        elif isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
            for key in a:
                yield from diff(a[key], b[key], f"{path}[{key!r}]")
        elif a != b:
            yield f"{path}: {a!r} -> {b!r}"[:300]

    warnings.simplefilter("ignore")
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-"))
    shutil.copy(folder / "calls.pt", scratch / "calls.pt")
    for name, content in mutant(_files(folder), kind, seed, index).items():
        (scratch / name).write_bytes(content)
    try:
        with load_program(folder / "program.tdp", key=_key(folder)) as good, \
                load_program(scratch / "program.tdp", key=_key(folder)) as bad:
            print("\n".join(diff(good.program, bad.program, "program")) or "the same program")
    except Exception as e:  # noqa: BLE001
        print(f"the mutant does not load: {type(e).__name__}: {e}")
    names = td.load(folder / "program.tdp", devices="null", key=_key(folder)).method_names
    print(outcome(scratch, run_program(folder), names))
    shutil.rmtree(scratch, ignore_errors=True)


# -------------------------------------------------------------------------------------------------
# Mutants


def _fields(raw: bytes) -> tuple[int, int, int, int]:
    """(flatbuffer offset, size, data offset, data size) from a program file's header."""
    fields = struct.unpack_from("<8sIIQQQQQII", raw)
    return fields[3], fields[4], fields[5], fields[6]


def seal(flatbuffer: bytes, data: bytes, version: int, trailer: bytes = b"") -> bytes:
    """A program file around ``flatbuffer`` and the data segment ``data``, with correct checksums (and
    a signed file's ``trailer`` after it)."""
    from tritondelegate.program import align_up
    from tritondelegate.serialize import header as hdr

    data_off = align_up(hdr.FLATBUFFER_OFFSET + len(flatbuffer), hdr.DATA_SEGMENT_ALIGNMENT)
    head = hdr.pack_header(version, len(flatbuffer), data_off, len(data), zlib.crc32(flatbuffer))
    return head + flatbuffer + bytes(data_off - len(head) - len(flatbuffer)) + data + trailer


def _flip(buf: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    if hi > lo:
        buf[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)


def _word(buf: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    if hi - lo >= 4:
        pos = rng.randrange(lo, hi - 3)
        struct.pack_into("<I", buf, pos, rng.choice(INTERESTING) & 0xFFFFFFFF)


def raw_mutant(files: dict[str, bytes], rng: random.Random) -> dict[str, bytes]:
    """Damage as a disk or a transfer makes it (flips, words, truncations; checksums untouched) in the
    program file, in its data segment (where the constants' checksums must catch it), or in a weights file."""
    _, _, data_off, data_size = _fields(files["program.tdp"])
    regions = [("program.tdp", 0, len(files["program.tdp"]), 3)]
    if data_size:
        regions.append(("program.tdp", data_off, data_off + data_size, 4))
    regions += [(name, 0, len(content), 4) for name, content in files.items() if name != "program.tdp"]
    name, lo, hi, _ = rng.choices(regions, weights=[r[3] for r in regions])[0]
    buf = bytearray(files[name])
    choice = rng.random()
    if choice < 0.1:
        buf = buf[: rng.randrange(len(buf))] if rng.random() < 0.8 else buf + bytes(rng.randrange(1, 64))
    elif choice < 0.3:
        _word(buf, lo, hi, rng)
    else:
        for _ in range(rng.randint(1, 4)):
            _flip(buf, lo, hi, rng)
    return {**files, name: bytes(buf)}


def _leaves(obj, path=()):
    """(owner, key) of every scalar, string and vector element under a generated *T object (whose
    strings are bytes)."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            if isinstance(item, SCALARS):
                yield obj, i
            else:
                yield from _leaves(item)
        return
    for key, value in vars(obj).items():
        if value is None:
            continue
        if isinstance(value, SCALARS):
            yield obj, key
        elif isinstance(value, list) or hasattr(value, "__dict__"):
            if isinstance(value, list):
                yield obj, (key, "vector")
            yield from _leaves(value)


def _get(owner, key):
    return owner[key] if isinstance(owner, list) else getattr(owner, key)


def _set(owner, key, value) -> None:
    if isinstance(owner, list):
        owner[key] = value
    else:
        setattr(owner, key, value)


def _mutate_field(root, rng: random.Random, strings: list[str]) -> None:
    owner, key = rng.choice(list(_leaves(root)))
    if isinstance(key, tuple):  # a vector: drop, duplicate or swap entries
        vec = getattr(owner, key[0])
        if vec and rng.random() < 0.5:
            vec.pop(rng.randrange(len(vec)))
        elif vec:
            i, j = rng.randrange(len(vec)), rng.randrange(len(vec))
            vec[i], vec[j] = vec[j], vec[i]
            if rng.random() < 0.3:
                vec.append(vec[i])
        return
    value = _get(owner, key)
    if isinstance(value, bool):
        _set(owner, key, not value)
    elif isinstance(value, int):
        _set(owner, key, rng.choice([*INTERESTING, value + 1, value - 1, value * 2, value // 2, -value]))
    elif isinstance(value, float):
        _set(owner, key, rng.choice([float("nan"), float("inf"), -value, value * 1e30, 0.0]))
    elif isinstance(value, (str, bytes)):
        _set(owner, key, rng.choice(strings + [b"", b"x" * 9, b"../../../etc/passwd", b"aten::from_file"]))


def resealed_mutant(files: dict[str, bytes], rng: random.Random) -> dict[str, bytes]:
    """The flatbuffer changed (bytes, or fields through the object API), then sealed again."""
    from tritondelegate.program import FORMAT_VERSION
    from tritondelegate.serialize.generated import program_generated as fb
    from tritondelegate.serialize.writer import _finish

    raw = files["program.tdp"]
    fb_off, fb_size, data_off, data_size = _fields(raw)
    flat, data = bytearray(raw[fb_off: fb_off + fb_size]), raw[data_off: data_off + data_size]
    trailer = raw[data_off + data_size:]  # a signed file's signature: kept, as it was
    if rng.random() < 0.4:
        for _ in range(rng.randint(1, 3)):
            (_word if rng.random() < 0.4 else _flip)(flat, 0, len(flat), rng)
        return {**files, "program.tdp": seal(bytes(flat), data, FORMAT_VERSION, trailer)}
    for _ in range(20):  # a mutation that packs (a value out of its field's range does not)
        root = fb.ProgramT.InitFromPackedBuf(bytes(flat), 0)
        strings = sorted({_get(o, k) for o, k in _leaves(root) if not isinstance(k, tuple)
                          and isinstance(_get(o, k), bytes)})
        for _ in range(rng.randint(1, 2)):
            _mutate_field(root, rng, strings)
        try:
            return {**files, "program.tdp": seal(_finish(root), data, FORMAT_VERSION, trailer)}
        except (struct.error, TypeError, ValueError, OverflowError):
            continue
    return files


def mutant(files: dict[str, bytes], kind: str, seed: int, index: int) -> dict[str, bytes]:
    rng = random.Random(seed * 1_000_003 + index * 7919 + (kind == "resealed"))
    return (raw_mutant if kind == "raw" else resealed_mutant)(files, rng)


# -------------------------------------------------------------------------------------------------
# Workers and the campaign


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".tdp", ".safetensors")}


def _diff(a, b, path=()) -> list[tuple]:
    """Paths (field names and indices) where two generated *T objects differ."""
    if type(a) is not type(b):
        return [path]
    if hasattr(a, "tolist"):  # a vector of scalars: a numpy array
        a, b = a.tolist(), b.tolist()
    if isinstance(a, list):
        if len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _diff(x, y, (*path, i))]
    if hasattr(a, "__dict__"):
        return [p for key in vars(a) for p in _diff(getattr(a, key), getattr(b, key), (*path, key))]
    return [] if a == b or (a != a and b != b) else [path]  # NaN equals NaN here


def plan_only(good: bytes, changed: bytes) -> bool:
    """Whether a re-sealed mutant changed nothing but delegates' launch plans (see "different-plan")."""
    from tritondelegate.serialize.generated import program_generated as fb

    def root(raw: bytes):
        fb_off, fb_size, _, _ = _fields(raw)
        return fb.ProgramT.InitFromPackedBuf(raw[fb_off: fb_off + fb_size], 0)

    try:
        paths = _diff(root(good), root(changed))
    except Exception:  # noqa: BLE001 - a flatbuffer the object API cannot read: not a plan edit
        return False
    # Labels: instruction names, and value names (a constant's must match its constant's, checked at load,
    # so a renamed constant never runs)
    cosmetic = [p for p in paths if len(p) == 5 and p[2] in ("instructions", "values") and p[4] == "name"]
    edits = [p for p in paths if p not in cosmetic]
    return bool(edits) and all(
        "plan" in p and p.index("plan") + 1 < len(p) and p[p.index("plan") + 1] in ("launches", "tensors")
        for p in edits)


def work(folder: Path, kind: str, seed: int, start: int, count: int, report) -> None:
    """Runs mutants ``start`` .. ``start + count - 1`` of ``folder``'s program; ``report(i, outcome, detail)``."""
    warnings.simplefilter("ignore")
    import tritondelegate as td

    good = _files(folder)
    reference = run_program(folder)
    names = td.load(folder / "program.tdp", devices="null", key=_key(folder)).method_names
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        shutil.copy(folder / "calls.pt", scratch / "calls.pt")
        for i in range(start, start + count):
            files = mutant(good, kind, seed, i)
            for name, content in files.items():
                (scratch / name).write_bytes(content)
            result, detail = outcome(scratch, reference, names)
            if result == "different" and kind == "resealed" and plan_only(good["program.tdp"], files["program.tdp"]):
                result = "different-plan"
            report(i, result, detail)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def watched(folder: Path, kind: str, seed: int, n: int, timeout: float, counts: dict, cases: dict) -> None:
    """Runs ``n`` mutants in worker processes: a worker that dies is a crash, one silent too long a hang."""
    i = 0
    while i < n:
        cmd = [sys.executable, __file__, "_worker", str(folder), kind, str(seed), str(i), str(n - i)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + timeout + 120  # the first mutant waits for imports and the reference
        while i < n:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else None
            if line and not line.startswith("["):
                continue  # something else the worker printed
            if not line:
                what = "hang" if line is None else "crash"
                if line is None:
                    proc.kill()
                code = proc.wait()
                _record(counts, cases, i, what, f"exit code {code}")
                i += 1
                break
            index, result, detail = json.loads(line)
            _record(counts, cases, index, result, detail)
            i = index + 1
            deadline = time.monotonic() + timeout
        else:
            proc.wait()


def _record(counts: dict, cases: dict, index: int, result: str, detail: str) -> None:
    counts[result] = counts.get(result, 0) + 1
    if result in BAD and len(cases.setdefault(result, [])) < 5:
        cases[result].append((index, detail))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="mutants per program and kind")
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one mutant may take")
    parser.add_argument("--in-process", action="store_true", help="no worker processes, no watchdog")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--show", metavar="KIND:INDEX", help="print how one mutant of the first program differs")
    parser.add_argument("--signed", action="store_true", help="sign the programs and load them with the key")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fuzz-programs-") as tmp:
        if args.show:
            kind, index = args.show.split(":")
            show(build(args.programs.split(",")[0], Path(tmp) / "p"), kind, args.seed, int(index))
            return 0
        for name in args.programs.split(","):
            folder = build(name, Path(tmp) / name, args.signed)
            for kind in args.kinds.split(","):
                counts, cases = {}, {}
                start = time.perf_counter()
                if args.in_process:
                    work(folder, kind, args.seed, 0, args.n, lambda i, r, d: _record(counts, cases, i, r, d))
                else:
                    watched(folder, kind, args.seed, args.n, args.timeout, counts, cases)
                rows.append({"program": name, "kind": kind, "mutants": args.n, "seconds": round(time.perf_counter()
                             - start, 1), **{o: counts.get(o, 0) for o in OUTCOMES}, "cases": cases})
                print(f"{name} {kind}: {counts} in {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
    else:
        header = ["program", "kind", "mutants", *OUTCOMES, "seconds"]
        print(" | ".join(f"{h:>16}" for h in header))
        for row in rows:
            print(" | ".join(f"{row[h]!s:>16}" for h in header))
            for outcome_name, found in row["cases"].items():
                for index, detail in found:
                    print(f"    {outcome_name} #{index}: {detail}")
    return 1 if any(row[o] for row in rows for o in BAD) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        folder, kind, seed, start, count = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])

        def report(i, result, detail):
            print(json.dumps([i, result, detail]), flush=True)

        work(Path(folder), kind, seed, start, count, report)
        sys.exit(0)
    sys.exit(main())
