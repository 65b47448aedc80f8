"""Compile the kernel variants of launch plans for GPU archs, without a GPU (a worker process).

    python -m tritondelegate.kernels.compile < request.json > reply.json   (TRITON_INTERPRET=0)

Each launch is specialized the way ``JITFunction.run`` specializes it on a GPU (argument types,
constexprs, the divisibility-by-16 and equal-to-1 attributes of integers and addresses, launch
options), and each distinct variant is compiled with ``triton.compile`` for every requested arch. The
reply carries, per variant, Triton's own cache key (``hash``) and the files Triton's cache keeps for it
(the metadata JSON and the cubin), so a GPU machine with the same Triton finds the kernel compiled.

It runs in its own process because Triton decides compiled vs interpreted when a kernel is defined:
a process that interprets kernels (the simulated device) cannot also compile them.

Request: ``{"archs": [90], "launches": [{"kernel": name, "args": [...], "constexprs": {...}}]}`` where a
tensor argument is ``{"tensor": dtype, "offset": byte offset of its address from an aligned base}``.
Reply: ``{"triton": version, "variants": [...], "launches": [[variant index per arch], ...]}``.
"""

from __future__ import annotations

import base64
import json
import os
import sys

ALIGNED_BASE = 1 << 20  # bases (arenas, segments, allocations) are at least this aligned mod 16


def specialize(kernel, backend, args, constexprs):
    """(options, signature, constexprs, attrs) of one launch, computed as ``JITFunction.run`` does."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(constexprs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton >= 3.7
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


def _address(dtype_name: str, offset: int):
    from triton.runtime.jit import MockTensor

    from ..dtypes import parse_dtype

    class Address(MockTensor):
        def data_ptr(self):
            return ALIGNED_BASE + offset

    return Address(parse_dtype(dtype_name))


def decode_args(args: list) -> list:
    return [_address(a["tensor"], a["offset"]) if isinstance(a, dict) else a for a in args]


def variant_key(kernel_name, options, signature, constexprs, attrs) -> str:
    return repr((kernel_name, sorted(signature.items()), sorted(constexprs.items(), key=repr),
                 sorted(attrs.items(), key=repr), sorted(options.__dict__.items(), key=repr)))


def _compiled_files(compiled) -> dict[str, str]:
    """The metadata JSON (text) and the binary (base64) Triton's cache keeps for ``compiled``."""
    files = {}
    for filename, path in compiled.metadata_group.items():
        if filename.endswith(".json"):
            with open(path) as f:
                files[filename] = f.read()
        elif filename.endswith(".cubin"):
            with open(path, "rb") as f:
                files[filename] = base64.b64encode(f.read()).decode("ascii")
    return files


def compile_request(request: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from .table import KERNELS

    variants, index, per_launch = [], {}, []
    for arch in request["archs"]:
        target = GPUTarget("cuda", int(arch), 32)
        backend = make_backend(target)
        for i, launch in enumerate(request["launches"]):
            kernel = KERNELS[launch["kernel"]]
            options, signature, constexprs, attrs = specialize(
                kernel, backend, decode_args(launch["args"]), launch["constexprs"])
            key = (arch, variant_key(launch["kernel"], options, signature, constexprs, attrs))
            if key not in index:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                          options=options.__dict__)
                index[key] = len(variants)
                variants.append({"kernel": launch["kernel"], "arch": f"sm_{arch}", "hash": compiled.hash,
                                 "name": compiled.name, "files": _compiled_files(compiled)})
            if len(per_launch) <= i:
                per_launch.append([])
            per_launch[i].append(index[key])
    return {"triton": triton.__version__, "variants": variants, "launches": per_launch}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("the compile worker needs TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    json.dump(compile_request(json.load(sys.stdin)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
