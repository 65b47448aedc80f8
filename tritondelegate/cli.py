"""``python -m tritondelegate demo | generate | inspect``: export, lower, save, load and run a Llama-style decoder.

``demo`` runs one forward call; ``generate`` runs greedy generation with a KV cache: prefill and decode
as two methods of one program sharing the cache, every token checked against eager PyTorch.
``inspect PROGRAM`` prints what a program file holds, read with the loader's checks.
"""

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


# The generate command's model: the demo decoder's config, 64 positions of cache, and one prefill
# method for every prompt length up to 32 (a bounded dynamic dimension).
GENERATE_MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176, max_seq_len=64)
GENERATE_MAX_PROMPT_LEN = 32


def _check_generate_args(args) -> None:
    """That the prompt, the tokens after it and a lookup's draft fit the demo's cache."""
    positions, prompt_len = GENERATE_MODEL["max_seq_len"], args.prompt_len
    if not 1 <= prompt_len <= positions:
        raise SystemExit(f"--prompt-len must be in 1..{positions}")
    if not 1 <= args.tokens <= positions - prompt_len + 1:
        raise SystemExit(f"--tokens must be in 1..{positions - prompt_len + 1} "
                         f"(a {prompt_len}-token prompt in a {positions}-position cache)")
    if args.lookup and not 1 <= args.lookup <= positions - 2:
        raise SystemExit(f"--lookup must be in 1..{positions - 2} (0: off)")


def _generate(args) -> dict:
    import torch

    import tritondelegate as td
    from tritondelegate.generate import Generator
    from tritondelegate.models import export_prefill_decode, generate_eager, kv_cache_decoder, llm_constant_methods

    cfg, prompt_len = GENERATE_MODEL, args.prompt_len
    _check_generate_args(args)
    timings = {}
    start = time.perf_counter()
    model = kv_cache_decoder(seed=args.seed, **cfg)
    if args.quantize:  # weight-only: the program keeps the integers and dequantizes in its matmuls
        td.quantize_linears(model, group_size=args.group_size, zero_point=args.quantize.startswith("u"),
                            bits=int(args.quantize[-1]), embeddings=args.quantize_embeddings)
    prompt = torch.randint(0, cfg["vocab_size"], (1, prompt_len))
    # Exported once with an example length; the program takes any prompt length up to the bound (the
    # generator prefills a longer one in calls of that many). Prefill returns its last position's logits
    # only: the next token's.
    programs = export_prefill_decode(model, 16, max_prompt_len=GENERATE_MAX_PROMPT_LEN, last_logits=True,
                                     verify_len=args.lookup + 1 if args.lookup else None)
    timings["export_s"] = time.perf_counter() - start

    start = time.perf_counter()
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
        skip_h2d_for_constants=True, state_on_device=not args.state_on_host))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)  # the per-step bytes below show the copies
        lowered = td.lower(programs, partitioner=td.TritonPartitioner(device="cuda:0"), config=config,
                           constant_methods=llm_constant_methods(model))
    timings["lower_s"] = time.perf_counter() - start
    # The lowered program keeps the cache values it was lowered with; eager generation may now write them.
    expected_tokens, expected_logits = generate_eager(model, prompt, args.tokens)
    expected_logits[0] = expected_logits[0][:, -1:]  # prefill's: the last position's

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decoder.tdp")
        lowered.save(path)
        start = time.perf_counter()
        program = td.load(path, devices=args.device)
        generator = Generator(program, graphs=args.graphs, decode="verify" if args.lookup else "decode")
        timings["load_s"] = time.perf_counter() - start
        lookup = td.PromptLookup(num_tokens=args.lookup) if args.lookup else None
        with torch.no_grad():
            result = generator.generate(prompt, args.tokens, keep_logits=True, lookup=lookup)

    tokens, expected = result.tokens[0].tolist(), expected_tokens[0].tolist()
    mismatch = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    run = result.as_dict()
    return {
        "device": program.device,
        "model": "Llama-style decoder with a static KV cache",
        "config": cfg,
        "prompt_len": prompt_len,
        "new_tokens": args.tokens,
        "state_on_device": not args.state_on_host,
        "graphs": args.graphs,
        "quantize": args.quantize and f"{args.quantize}, " + (
            f"groups of {args.group_size}" if args.group_size else "per row") + (
            ", embeddings too" if args.quantize_embeddings else ""),
        "tokens": tokens,
        "eager_tokens": expected,
        "tokens_match": mismatch is None,
        "first_mismatch": mismatch,
        # every position's logits, prefill's last then each decode call's (with lookup, several a call)
        "max_abs_logit_error": (torch.cat(result.logits, 1).float() - torch.cat(expected_logits, 1).float()
                                ).abs().max().item(),
        **{k: run[k] for k in ("prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s")},
        "decode_steps": run["steps"],
        "lookup": args.lookup and {"num_tokens": args.lookup, "drafted": run["drafted"], "accepted": run["accepted"]},
        # What a decode step should move: the token ids and their position in, the logits out.
        "expected_step_h2d_bytes": prompt.shape[0] * 8 + 8,
        "expected_step_d2h_bytes": prompt.shape[0] * cfg["vocab_size"] * 4,
        "cache_bytes": sum(b.numel() * b.element_size() for b in model.cache_buffers().values()),
        "memory": run["memory"],
        "methods": {name: _method_summary(lowered, name, method)
                    for name, method in (("prefill", generator.prefill), (generator.decode.name, generator.decode))},
        "timings": timings,
    }


def _method_summary(lowered, name: str, method) -> dict:
    from tritondelegate.summary import method_facts

    facts = method_facts(lowered, name)
    return {"nodes_total": facts["nodes_total"], "nodes_delegated": facts["nodes_delegated"],
            "host_nodes": facts["host_nodes"], "delegates": len(facts["delegates"]),
            "launches_per_call": method.stats.launches_per_call, "load_h2d_bytes": method.stats.load_h2d_bytes}


def _print_generation(result: dict) -> None:
    c = result["config"]
    where = "on the device" if result["state_on_device"] else "on the host, copied every call"
    print(f"tritondelegate generate: {result['model']} ({c['n_layers']} layers, dim {c['dim']}, "
          f"vocab {c['vocab_size']}, {c['max_seq_len']} positions) on the {result['device']} device")
    methods = "prefill, decode and verify" if result["lookup"] else "prefill and decode"
    print(f"  one program, methods {methods}; KV cache ({result['cache_bytes']} bytes) {where}"
          + (", decode replayed as CUDA graphs" if result["graphs"] else ""))
    if result["quantize"]:
        print(f"  linears weight-only quantized ({result['quantize']}), dequantized in the kernels that read them")
    for name, m in result["methods"].items():
        print(f"  {name}: delegated {m['nodes_delegated']} of {m['nodes_total']} compute nodes into "
              f"{m['delegates']} delegates, {m['launches_per_call']} kernel launches per call")
        for h in m["host_nodes"]:
            print(f"    on the host: {h['node']} [{h['op']}]: {h['reason']}")
    n = result["new_tokens"]
    if result["tokens_match"]:
        print(f"  all {n} tokens match eager PyTorch; max abs logit error {result['max_abs_logit_error']:.3g}")
    else:
        print(f"  MISMATCH at token {result['first_mismatch']} of {n}: got {result['tokens']}, "
              f"eager {result['eager_tokens']}; max abs logit error {result['max_abs_logit_error']:.3g}")
    print(f"  prefill: {result['prompt_len']} tokens in {result['prefill_s']:.3f} s "
          f"({result['prefill_tokens_per_s']:.1f} tokens/s)")
    if result["decode_steps"]:
        steps = result["decode_steps"]
        print(f"  decode: {len(steps)} steps in {result['decode_s']:.3f} s "
              f"({result['decode_tokens_per_s']:.2f} tokens/s)")
        if result["lookup"]:
            look = result["lookup"]
            print(f"  prompt lookup: {n - 1} tokens after the first in {len(steps)} calls of the 'verify' method; "
                  f"{look['accepted']} of {look['drafted']} drafted tokens kept (up to {look['num_tokens']} a call)")
        h2d = sorted({s["h2d_bytes"] for s in steps})
        d2h = sorted({s["d2h_bytes"] for s in steps})
        if result["state_on_device"]:
            expected = ("the token ids and positions in, their logits out" if result["lookup"] else
                        "the token id and position in, the logits out") + ", nothing else"
        else:
            expected = f"the {result['cache_bytes']}-byte cache both ways, besides the ids, position and logits"
        print(f"  per decode step: {'/'.join(map(str, h2d))} bytes host->device, {'/'.join(map(str, d2h))} bytes "
              f"device->host ({expected}); {steps[-1]['launches']} kernels"
              + (f", replayed as {steps[-1]['graph_replays']} graph(s)" if steps[-1]["graph_replays"] else ""))
    if result["device"] == "simulated":
        print("  (simulated device: kernels run under the Triton interpreter; the speeds are not a GPU's)")
    for device, m in result["memory"].items():
        print(f"  memory {device}: " + ", ".join(f"{k} {v} bytes" for k, v in m.items()))
    t = result["timings"]
    print(f"  export {t['export_s']:.2f}s, lower {t['lower_s']:.2f}s, load {t['load_s']:.2f}s")


def _inspect(args) -> int:
    from tritondelegate.inspection import describe, format_description, format_launches
    from tritondelegate.errors import ProgramError
    from tritondelegate.serialize.reader import load_program

    try:
        key = None
        if args.key_file:
            with open(args.key_file, "rb") as kf:
                key = kf.read()
        with load_program(args.program, key=key) as f:
            facts = describe(f.program)
            program = f.program
    except (ProgramError, OSError) as exc:
        print(f"tritondelegate inspect: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            from tritondelegate.plot import plot_arenas

            panels = plot_arenas(program, args.plot)
        except ImportError as exc:
            print(f"tritondelegate inspect: --plot needs matplotlib (pip install 'tritondelegate[plot]'): {exc}",
                  file=sys.stderr)
            return 2
        print(f"tritondelegate inspect: {panels} panels (arenas, segments) drawn into {args.plot}", file=sys.stderr)
    if args.json:
        json.dump(facts, sys.stdout, indent=2)
        print()
    else:
        print(format_description(facts))
        if args.launches:
            print(format_launches(facts))
    return 0


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
    gen = sub.add_parser("generate", help="greedy generation with a KV cache (prefill + decode), checked "
                                          "token by token against eager")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--tokens", type=int, default=8, help="tokens to generate (default 8)")
    gen.add_argument("--prompt-len", type=int, default=11,
                     help=f"prompt tokens, 1..{GENERATE_MODEL['max_seq_len']} (default 11; one program for every "
                          f"length: up to {GENERATE_MAX_PROMPT_LEN} in one prefill call, longer ones in calls of "
                          "that many)")
    gen.add_argument("--device", default="auto", choices=["auto", "cuda", "simulated"])
    gen.add_argument("--graphs", action="store_true", help="load decode with CUDA graphs")
    gen.add_argument("--state-on-host", action="store_true",
                     help="keep the KV cache on the host (state_on_device=False): copied in and out every call")
    gen.add_argument("--quantize", choices=["int8", "uint8", "int4", "uint4"],
                     help="weight-only quantized linears (td.quantize_linears): 8 or 4 bits, symmetric (int) or "
                          "with zero points (uint)")
    gen.add_argument("--group-size", type=int, help="with --quantize: a scale per group of this many input "
                                                     "features (a power of two >= 16; default: one per row)")
    gen.add_argument("--quantize-embeddings", action="store_true",
                     help="with --quantize: the embedding table too (td.quantize_linears(embeddings=True))")
    gen.add_argument("--lookup", type=int, metavar="N", default=0,
                     help="prompt lookup decoding: each decode call runs the last token and up to N drafted from "
                          "the text so far (a third method, 'verify', of 1..N+1 tokens), keeping those greedy "
                          "decoding picks (td.PromptLookup; default 0: off)")
    gen.add_argument("--seed", type=int, default=0)
    insp = sub.add_parser("inspect", help="what a program file holds: methods, delegates, constants, state, memory")
    insp.add_argument("program", help="a program file written by LoweredProgram.save")
    insp.add_argument("--json", action="store_true", help="print one JSON object")
    insp.add_argument("--key-file", metavar="FILE",
                      help="the secret a signed program was saved with (LoweredProgram.save(path, key=...))")
    insp.add_argument("--launches", action="store_true",
                      help="also list each method's launches in order: kernel, grid, bytes read and written, "
                           "their share of the method's modelled bytes, FLOPs, the nodes each computes "
                           "(--json always holds them, as each delegate's launch_plan)")
    insp.add_argument("--plot", metavar="FILE.png",
                      help="also draw each arena and segment (values by lifetime and offset) into a PNG "
                           "(needs matplotlib: pip install 'tritondelegate[plot]')")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    # Keep the demo's output readable: torch's pytree deprecation notices, and numpy's notes on the
    # masked-off lanes the Triton interpreter also evaluates, say nothing about the result.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    if args.command == "generate":
        result = _generate(args)
        if args.json:
            json.dump(result, sys.stdout, indent=2)
            print()
        else:
            _print_generation(result)
        return 0 if result["tokens_match"] else 1
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
