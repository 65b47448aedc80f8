"""Kernel binaries at lower time: ``LowerConfig(kernel_archs=("sm_90",))``.

Every distinct kernel variant the program's launch plans use is compiled with Triton's compiler for
each requested arch, on this machine, GPU or not (in a worker process: ``kernels/compile.py``). Each
binary is stored once in the program file with Triton's cache key for it, the metadata Triton keeps
beside it, the Triton version and the arch. On a GPU machine with the same Triton, the runtime puts
them in Triton's cache before the first call, so no kernel is compiled there.

Worker replies are cached on disk (``TRITONDELEGATE_CACHE_DIR``, default ``~/.cache/tritondelegate``)
by the request and the kernels' source, and Triton's own cache keeps each compiled variant: lowering
the same program again does not compile again.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

from .errors import LoweringError
from .plan import KernelArgKind, Base
from .program import DEVICE_ALIGNMENT, KernelBinary, Program

ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100}


@dataclass
class CompiledBinaries:
    binaries: list[KernelBinary]
    data: list[bytes]
    launches: list[list[int]]  # per launch (of concrete_methods, in order): binary per arch


def check_archs(archs) -> tuple[str, ...]:
    archs = tuple(archs)
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"LowerConfig.kernel_archs: unknown arch(s) {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(ARCHS)}")
    return archs


def launch_request(delegate, launch) -> dict:
    args = []
    for a in launch.args:
        if a.kind != KernelArgKind.TENSOR:
            args.append(a.value)
            continue
        desc = delegate.plan.tensors[a.value]
        offset = desc.byte_offset + (delegate.scratch_offset if desc.base == Base.SCRATCH else 0)
        args.append({"tensor": desc.dtype, "offset": offset % DEVICE_ALIGNMENT})  # every base is this aligned
    return {"kernel": launch.kernel, "args": args, "constexprs": {k: v.value for k, v in launch.constexprs.items()}}


def sample_sizes(symbols) -> list[dict[str, int]]:
    """Symbol values at which a dynamic method's kernel variants are compiled: Triton specializes an
    integer argument by whether it is 1 or a multiple of 16, so each symbol takes 1 (or its minimum),
    a multiple of 16 and an odd prime in its range, and its maximum. A size whose variant is not among
    them compiles on its first call (Triton's JIT), as without binaries."""
    per_symbol = []
    for s in symbols:
        lo, hi = max(s.min, 1), s.max
        picks = {lo, hi, next((n for n in range(16 * ((lo + 15) // 16), hi + 1, 16)), hi),
                 next((n for n in range(hi, lo - 1, -1) if n > 2 and all(n % k for k in range(2, int(n ** 0.5) + 1))),
                      hi)}
        per_symbol.append(sorted(p for p in picks if lo <= p <= hi))
    return [dict(zip((s.name for s in symbols), values)) for values in itertools.product(*per_symbol)]


def concrete_methods(program: Program) -> list:
    """Every method, and each dynamic one at each of its :func:`sample_sizes`."""
    from .runtime.sized import specialize

    out = []
    for m in program.methods:
        out += [specialize(m, env) for env in sample_sizes(m.symbols)] if m.symbols else [m]
    return out


def request_for(program: Program, archs) -> dict:
    launches = [launch_request(d, launch) for m in concrete_methods(program) for d in m.delegates
                for launch in d.plan.launches]
    return {"archs": [ARCHS[a] for a in archs], "launches": launches}


def compile_binaries(program: Program, archs) -> CompiledBinaries:
    """Compile (or fetch from the cache) every kernel variant of ``program`` for ``archs``."""
    request = request_for(program, check_archs(archs))
    reply = _cached_reply(request)
    binaries, data = [], []
    for v in reply["variants"]:
        blob = _cubin(v)
        metadata = next(text for name, text in v["files"].items() if name.endswith(".json"))
        binaries.append(KernelBinary(kernel=v["kernel"], arch=v["arch"], triton_version=reply["triton"],
                                     cache_key=v["hash"], name=v["name"], metadata=metadata,
                                     nbytes=len(blob), checksum=zlib.crc32(blob)))
        data.append(blob)
    return CompiledBinaries(binaries, data, reply["launches"])


def _cubin(variant: dict) -> bytes:
    return base64.b64decode(next(text for name, text in variant["files"].items() if name.endswith(".cubin")))


def _sources_digest() -> str:
    """What the compiled kernels depend on in this package: the kernel sources."""
    digest = hashlib.sha256()
    folder = os.path.join(os.path.dirname(__file__), "kernels")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _cache_dir() -> str:
    return os.environ.get("TRITONDELEGATE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                        "tritondelegate")


def _cached_reply(request: dict) -> dict:
    import triton

    key = hashlib.sha256(json.dumps([request, triton.__version__, _sources_digest()], sort_keys=True).encode())
    path = os.path.join(_cache_dir(), "binaries", f"{key.hexdigest()}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    reply = _run_worker(request)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(reply, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: no cache, still correct
    return reply


def _run_worker(request: dict) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tritondelegate.kernels.compile"], input=json.dumps(request),
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise LoweringError(f"compiling kernel binaries failed (LowerConfig.kernel_archs):\n{tail}")
    return json.loads(done.stdout)
