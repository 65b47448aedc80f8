"""``python -m tritondelegate demo``: export, lower, save, load and run a Llama-style decoder."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings


def _demo(args) -> dict:
    import torch

    import tritondelegate as td
    from tritondelegate.models import demo_decoder
    from tritondelegate.summary import method_facts

    timings = {}
    start = time.perf_counter()
    model, example = demo_decoder(seed=args.seed, attention=args.attention)
    with torch.no_grad():
        expected = model(*example)
    ep = torch.export.export(model, example)
    timings["export_s"] = time.perf_counter() - start

    start = time.perf_counter()
    config = td.LowerConfig(
        propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=not args.per_call_copy)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)  # the summary lists every copy
        lowered = td.lower(ep, partitioner=td.TritonPartitioner(device="cuda:0"), config=config)
    timings["lower_s"] = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decoder.tdp")
        lowered.save(path)
        file_bytes = os.path.getsize(path)
        start = time.perf_counter()
        program = td.load(path, devices=args.device)
        method = program.load_method("forward")
        timings["load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            out = method(*example)
        timings["first_call_s"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            out = method(*example)
        timings["second_call_s"] = time.perf_counter() - start
        error = (out.float() - expected.float()).abs().max().item()

    facts = method_facts(lowered, "forward")
    stats = method.stats
    return {
        "device": program.device,
        "model": f"Llama-style decoder ({args.attention} attention)",
        "nodes_total": facts["nodes_total"],
        "nodes_delegated": facts["nodes_delegated"],
        "view_nodes": facts["view_nodes"],
        "host_nodes": facts["host_nodes"],
        "delegates": len(facts["delegates"]),
        "kernel_launches_per_call": stats.launches_per_call,
        "max_abs_error": error,
        "program_file_bytes": file_bytes,
        "resident_constant_bytes": sum(r["bytes"] for r in facts["resident_constants"]),
        "load_h2d_bytes": stats.load_h2d_bytes,
        "call_h2d_bytes": stats.call_h2d_bytes,
        "call_d2h_bytes": stats.call_d2h_bytes,
        "arena_bytes": {a["device"]: a["bytes"] for a in facts["arenas"]},
        "arena_lower_bound_bytes": {a["device"]: a["lower_bound_bytes"] for a in facts["arenas"]},
        "timings": timings,
        "summary": lowered.summary(),
    }


def _print_readable(result: dict) -> None:
    share = 100.0 * result["nodes_delegated"] / max(result["nodes_total"], 1)
    print(f"tritondelegate demo: {result['model']} on the {result['device']} device")
    print(f"  delegated {result['nodes_delegated']} of {result['nodes_total']} compute nodes ({share:.1f}%) "
          f"into {result['delegates']} delegates, {result['kernel_launches_per_call']} kernel launches per call")
    print(f"  max abs error vs eager PyTorch: {result['max_abs_error']:.3g}")
    print(f"  constants resident on the device: {result['resident_constant_bytes']} bytes, "
          f"copied once at load ({result['load_h2d_bytes']} bytes)")
    print(f"  per call: {result['call_h2d_bytes']} bytes host->device, {result['call_d2h_bytes']} bytes device->host")
    for device, size in result["arena_bytes"].items():
        print(f"  arena {device}: {size} bytes (lower bound {result['arena_lower_bound_bytes'][device]})")
    t = result["timings"]
    print(f"  export {t['export_s']:.2f}s, lower {t['lower_s']:.2f}s, load {t['load_s']:.2f}s, "
          f"first call {t['first_call_s']:.2f}s, second call {t['second_call_s']:.3f}s")
    print()
    print(result["summary"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritondelegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="lower and run a small Llama-style decoder, compared with eager")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--device", default="auto", choices=["auto", "cuda", "simulated"])
    demo.add_argument("--attention", default="sdpa", choices=["sdpa", "matmul"])
    demo.add_argument("--per-call-copy", action="store_true",
                      help="copy constants every call instead of keeping them resident")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Keep the demo's output readable: torch's pytree deprecation notices, and numpy's notes on the
    # masked-off lanes the Triton interpreter also evaluates, say nothing about the result.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    result = _demo(args)
    if args.json:
        result = {k: v for k, v in result.items() if k != "summary"}
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_readable(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
