"""``python -m bench.report RESULTS.json [MORE.json ...] [--plot PATH | --no-plot]``

Prints markdown tables from pytest-benchmark JSON written by ``pytest bench/``: latency per mode with
the ratios per_call_copy/resident, resident/eager and resident_io/eager, and the modelled traffic per
call next to its lower bound; bytes copied per call and at
load; load time against the measured copy bandwidth; the host cost of one kernel launch; decode
tokens/s of generation with a KV cache per mode, with bytes and launches per step and memory. Writes a PNG
plot of latency against weight bytes per mode when matplotlib is installed (``pip install
'tritondelegate[plot]'``). Several JSON files (e.g. the steps of scripts/gpu_bench.sh) are merged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

MODES = ("per_call_copy", "resident", "resident_io", "resident_graphs", "eager", "torch_compile")
LOWERED = ("per_call_copy", "resident", "resident_io", "resident_graphs")
GENERATION_MODES = ("state_on_host", "state_on_device", "state_on_device_graphs", "state_on_device_graphs_dot",
                    "state_on_device_graphs_one_pass", "state_on_device_graphs_int8", "state_on_device_graphs_int4",
                    "state_on_device_graphs_lookup", "hf_eager")


def _bytes(n) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(seconds) -> str:
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _ratio(a, b) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}x"


def _traffic(t: dict | None) -> str:
    """A method's modelled traffic per call (kernels/traffic.py) next to its lower bound."""
    if not t:
        return "—"
    return f"{_bytes(t['bytes'])} ({_bytes(t['lower_bound'])}, {t['ratio']:.2f}x)"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def load_results(paths: list[str]) -> tuple[dict, list[dict]]:
    machine, benchmarks = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        machine = machine or data.get("machine_info", {})
        machine.setdefault("datetime", data.get("datetime"))
        benchmarks += data.get("benchmarks", [])
    return machine, benchmarks


def _median(b: dict) -> float:
    return b["stats"]["median"]


def _kind(b: dict) -> str:
    name = b.get("name", "")
    return name.split("[", 1)[0]


def collect(benchmarks: list[dict]):
    """{model: {mode: benchmark}}, {model: {kind: benchmark}}, {(ops, impl): benchmark},
    {model: {mode: benchmark}} (generation), in run order."""
    latency, load, launch, generation = defaultdict(dict), defaultdict(dict), {}, defaultdict(dict)
    runtime = []  # the runtime's own host cost (null device) and the time to a first result
    for b in benchmarks:
        info = b.get("extra_info", {})
        kind = _kind(b)
        if kind == "test_latency":
            latency[info["model"]][info["mode"]] = b
        elif kind == "test_load":
            load[info["model"]][info["kind"]] = b
        elif kind == "test_launch":
            launch[(info["ops"], info["impl"])] = b
        elif kind == "test_generation":
            generation[info["model"]][info["mode"]] = b
        elif kind in ("test_null_device_overhead", "test_first_call", "test_lower"):
            runtime.append(b)
    return latency, load, launch, generation, runtime


def runtime_section(runtime: list[dict]) -> str:
    rows = []
    for b in runtime:
        info = b.get("extra_info", {})
        if _kind(b) == "test_null_device_overhead":
            rows.append([f"{info['model']}: runtime host cost, null device, {info['mode']}",
                         f"{info['us_per_call']:.1f} µs per call", f"{info['us_per_launch']:.2f} µs per launch "
                         f"({info['launches_per_call']} launches)"])
        elif _kind(b) == "test_lower":
            rows.append([f"{info['model']}: td.lower at {info['layers']} layers", f"{b['stats']['median']:.2f} s",
                         f"{info['nodes']} exported nodes"])
        else:
            rows.append([f"{info['model']}: first result in a fresh process, {info['mode']}",
                         f"{info['first_call_s']:.2f} s", info.get("arch", "")])
    return "\n".join(["## Runtime overhead, first call and lowering", "",
                      "The null device does every step of a call except the copies and launches themselves; "
                      "the first call is a new process with an empty Triton cache.", "",
                      _table(["what", "time", "detail"], rows), ""])


def _bandwidth(load: dict, model: str) -> float | None:
    """Bytes per second of a plain pageable copy (host copy on the simulated device) of this model's
    resident bytes: what a per-call copy of the constants moves at."""
    for kind in ("pageable", "host_copy"):
        b = load.get(model, {}).get(kind)
        if b:
            return b["extra_info"]["bytes"] / _median(b)
    return None


def latency_section(latency: dict, load: dict) -> str:
    modes = [m for m in MODES if any(m in by_mode for by_mode in latency.values())]
    header = ["model", "weights", "launches/call", "modelled traffic (lower bound, ratio)",
              *[f"{m} (ms)" for m in modes],
              "per_call_copy / resident", "resident / eager", "resident_io / eager",
              "resident_graphs / eager"]
    rows = []
    for model, by_mode in latency.items():
        t = {m: _median(b) for m, b in by_mode.items()}
        any_b = next(iter(by_mode.values()))["extra_info"]
        launches = next((b["extra_info"].get("launches_per_call") for m, b in by_mode.items() if m in LOWERED), None)
        traffic = next((b["extra_info"].get("traffic") for m, b in by_mode.items() if m in LOWERED), None)
        rows.append([model, _bytes(any_b["weight_bytes"]), launches if launches is not None else "—",
                     _traffic(traffic), *[_ms(t.get(m)) for m in modes],
                     _ratio(t.get("per_call_copy"), t.get("resident")),
                     _ratio(t.get("resident"), t.get("eager")),
                     _ratio(t.get("resident_io"), t.get("eager")),
                     _ratio(t.get("resident_graphs"), t.get("eager"))])
    out = ["## Latency per call (median)", "", _table(header, rows), ""]

    header = ["model", *[f"{m} h2d / d2h per call" for m in LOWERED], "loaded once (resident)",
              "per_call_copy − resident (ms)", "extra h2d bytes / copy bandwidth (ms)"]
    rows = []
    for model, by_mode in latency.items():
        info = {m: b["extra_info"] for m, b in by_mode.items()}
        cells = []
        for m in LOWERED:
            i = info.get(m)
            cells.append("—" if i is None else f"{_bytes(i['call_h2d_bytes'])} / {_bytes(i['call_d2h_bytes'])}")
        loaded = info.get("resident", {}).get("load_h2d_bytes")
        diff = estimate = None
        if "per_call_copy" in by_mode and "resident" in by_mode:
            diff = _median(by_mode["per_call_copy"]) - _median(by_mode["resident"])
            bandwidth = _bandwidth(load, model)
            extra = info["per_call_copy"]["call_h2d_bytes"] - info["resident"]["call_h2d_bytes"]
            estimate = extra / bandwidth if bandwidth else None
        rows.append([model, *cells, _bytes(loaded), _ms(diff), _ms(estimate)])
    out += ["## Bytes copied per call", "",
            "Bytes from `method.stats` after the timed calls. The last column is what the extra per-call "
            "bytes cost at the plain copy bandwidth measured in the same run (pageable host-to-device on "
            "CUDA, a host copy on the simulated device); `—` where that run measured none.", "",
            _table(header, rows), ""]

    rows = []
    for model, by_mode in latency.items():
        for mode in MODES:
            b = by_mode.get(mode)
            if b is None or b["extra_info"].get("host_call_ms") is None:
                continue
            i = b["extra_info"]
            launches = i.get("launches_per_call")
            rows.append([model, mode, _ms(_median(b)), f"{i['host_call_ms']:.3f}", f"{i['stream_span_ms']:.3f}",
                         launches if launches is not None else "—", _bytes(i.get("call_h2d_bytes"))])
    if rows:
        header = ["model", "mode", "wall (ms)", "host call (ms)", "stream span (ms)", "launches/call", "h2d per call"]
        out += ["## Where the time goes (CUDA)", "",
                "`wall`: the timed call including the wait for its stream. `host call`: until the call returns "
                "to the host, before that wait (argument checks, copies the host waits for, launches). "
                "`stream span`: CUDA events recorded on the stream around the call.", "",
                _table(header, rows), ""]
    return "\n".join(out)


def load_section(load: dict) -> str:
    kinds = [k for k in ("resident_load", "pinned", "pageable", "host_copy") if any(k in v for v in load.values())]
    header = ["model", "bytes", *[f"{k} (ms)" for k in kinds], *[f"{k} GB/s" for k in kinds]]
    rows = []
    for model, by_kind in load.items():
        nbytes = next(iter(by_kind.values()))["extra_info"]["bytes"]
        times = [_ms(_median(by_kind[k])) if k in by_kind else "—" for k in kinds]
        rates = [f"{nbytes / _median(by_kind[k]) / 1e9:.2f}" if k in by_kind and nbytes else "—" for k in kinds]
        rows.append([model, _bytes(nbytes), *times, *rates])
    return "\n".join(["## Load time of resident constants vs plain copies of the same bytes", "",
                      "`resident_load` is the whole `load_method` (arena allocation, constant copies from the "
                      "mapped file, delegate setup).", "", _table(header, rows), ""])


def launch_section(launch: dict) -> str:
    impls = list(dict.fromkeys(impl for _, impl in launch))
    chains = sorted({ops for ops, _ in launch})
    header = ["impl", *[f"{n} op(s) (µs)" for n in chains], "µs per launch (longest chain)"]
    if len(chains) >= 2:
        header.append(f"marginal µs per launch ({chains[0]}→{chains[-1]})")
    rows = []
    for impl in impls:
        t = {n: _median(launch[(n, impl)]) for n in chains if (n, impl) in launch}
        row = [impl, *[f"{t[n] * 1e6:.1f}" if n in t else "—" for n in chains]]
        longest = chains[-1]
        row.append(f"{t[longest] * 1e6 / longest:.2f}" if longest in t else "—")
        if len(chains) >= 2:
            lo, hi = chains[0], chains[-1]
            row.append(f"{(t[hi] - t[lo]) * 1e6 / (hi - lo):.2f}" if lo in t and hi in t else "—")
        rows.append(row)
    return "\n".join(["## Host cost of one kernel launch", "",
                      "Chains of tiny adds on an [8] tensor, device tensors in and out, each call synchronized. "
                      "`runtime`: a lowered method; `triton_pointwise`: the runtime's pointwise kernel with the "
                      "same arguments, launched directly; `triton_minimal`: a 3-argument kernel; `eager`: "
                      "`x + 1.0` in PyTorch.", "", _table(header, rows), ""])


def _tokens_per_s(b: dict | None) -> float | None:
    return None if b is None else b["extra_info"]["steps"] / _median(b)


def _device_memory(info: dict) -> str:
    """constants / state / arenas on the device(s) the program keeps them; the host's state, if any."""
    cells = []
    for device, m in (info.get("memory") or {}).items():
        parts = [f"{k} {_bytes(m[k])}" for k in ("constants", "state", "arenas") if m.get(k)]
        if parts:
            cells.append(f"{device}: {', '.join(parts)}")
    return "; ".join(cells) or "—"


def generation_section(generation: dict) -> str:
    header = ["model", "mode", "decode tokens/s", "ms/step", "h2d / d2h per step", "launches/step",
              "graph replays/step", "memory", "tokens = eager"]
    rows, ratios = [], []
    for model, by_mode in generation.items():
        for mode in GENERATION_MODES:
            b = by_mode.get(mode)
            if b is None:
                continue
            i = b["extra_info"]
            per_step = (f"{_bytes(i['h2d_bytes_per_step'])} / {_bytes(i['d2h_bytes_per_step'])}"
                        if i.get("h2d_bytes_per_step") is not None else "—")
            launches = i.get("launches_per_step")
            rows.append([model, mode, f"{_tokens_per_s(b):.3g}", _ms(_median(b) / i["steps"]), per_step,
                         launches if launches is not None else "—", i.get("graph_replays_per_step", "—"),
                         _device_memory(i), "yes" if i.get("tokens_match_eager") else "**no**"])
        t = {m: _tokens_per_s(by_mode.get(m)) for m in GENERATION_MODES}
        any_info = next(iter(by_mode.values()))["extra_info"]
        speedup = lambda a, b: "—" if t[a] is None or not t[b] else f"{t[a] / t[b]:.3g}x"  # noqa: E731
        ratios.append([model, _bytes(any_info["weight_bytes"]), _bytes(any_info["cache_bytes"]),
                       speedup("state_on_device", "state_on_host"),
                       speedup("state_on_device_graphs", "state_on_device"),
                       speedup("state_on_device_graphs", "state_on_device_graphs_dot"),
                       speedup("state_on_device_graphs", "state_on_device_graphs_one_pass"),
                       speedup("state_on_device_graphs_int8", "state_on_device_graphs"),
                       speedup("state_on_device_graphs_int4", "state_on_device_graphs"),
                       speedup("state_on_device_graphs_lookup", "state_on_device_graphs"),
                       speedup("state_on_device_graphs", "hf_eager")])
    return "\n".join([
        "## Generation: decode throughput with a KV cache", "",
        "Greedy decode steps after one prefill (`steps` per timed round, median round). `state_on_host`: the "
        "cache copied host-to-device and back every call; `state_on_device`: the cache is program state on "
        "the device; `_graphs`: decode replayed as CUDA graphs; `_dot`: lowered without the GEMV variant "
        "(every projection on tl.dot's 16-row tiles); `_one_pass`: decode attention never splits its keys; "
        "`_int8`, `_int4`: the linears weight-only quantized (`td.quantize_linears`; tokens checked against "
        "the quantized model eager); `_lookup`: prompt lookup decoding (`td.PromptLookup()`: the same tokens "
        "in fewer calls); `hf_eager`: transformers' LlamaForCausalLM "
        "with the same weights and its static cache, eager, on the same device. Bytes, launches and memory "
        "from `method.stats` and `program.memory()`.", "",
        _table(header, rows), "",
        _table(["model", "weights", "KV cache", "state_on_device / state_on_host (tokens/s)",
                "graphs / state_on_device", "GEMV / tl.dot (graphs)", "split keys / one pass (graphs)",
                "int8 / float (graphs)", "int4 / float (graphs)", "prompt lookup / plain (graphs)",
                "state_on_device_graphs / hf_eager"],
               ratios), ""])


def machine_section(machine: dict) -> str:
    td = machine.get("tritondelegate", {})
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "?"
    parts = [f"device: **{td.get('device', '?')}**"]
    if td.get("gpu"):
        parts.append(f"GPU: {td['gpu']} (CUDA {td.get('cuda')})")
    parts += [f"CPU: {cpu}, {td.get('cpu_count', '?')} cores, torch threads {td.get('torch_threads', '?')}",
              f"torch {td.get('torch', '?')}",
              f"triton {td.get('triton', '?')}", f"sizes: {td.get('sizes', '?')}",
              f"run: {machine.get('datetime') or td.get('date', '?')}"]
    lines = ["# tritondelegate benchmarks", "", "; ".join(parts), ""]
    if td.get("device") == "simulated":
        lines += ["Simulated device: kernels run under the Triton interpreter on the CPU, so these timings "
                  "measure the interpreter, not a GPU. Only the byte and launch counts carry over.", ""]
    return "\n".join(lines)


def plot(latency: dict, path: str, device: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (`pip install 'tritondelegate[plot]'`): no plot written."
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = dict(zip(MODES, ("tab:red", "tab:blue", "tab:green", "tab:orange", "tab:gray", "tab:purple")))
    for family, marker, style in (("mlp", "o", "-"), ("decoder", "s", "--")):
        for mode in MODES:
            points = sorted(
                (b["extra_info"]["weight_bytes"], _median(b) * 1e3)
                for by_mode in latency.values() for m, b in by_mode.items()
                if m == mode and b["extra_info"].get("family") == family
            )
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker=marker, color=colors[mode], label=f"{family} {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("weight bytes")
    ax.set_ylabel("median latency per call (ms)")
    ax.set_title(f"latency vs weight bytes ({device} device)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"Plot written to {path}."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="pytest-benchmark JSON file(s) from `pytest bench/`")
    parser.add_argument("--plot", help="PNG path (default: the first results file with .png)")
    parser.add_argument("--no-plot", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)
    machine, benchmarks = load_results(args.results)
    if not benchmarks:
        print(f"no benchmarks in {', '.join(args.results)}", file=sys.stderr)
        return 1
    latency, load, launch, generation, runtime = collect(benchmarks)
    sections = [machine_section(machine)]
    if latency:
        sections.append(latency_section(latency, load))
    if load:
        sections.append(load_section(load))
    if launch:
        sections.append(launch_section(launch))
    if generation:
        sections.append(generation_section(generation))
    if runtime:
        sections.append(runtime_section(runtime))
    print("\n".join(sections))
    if latency and not args.no_plot:
        path = args.plot or os.path.splitext(args.results[0])[0] + ".png"
        print(plot(latency, path, machine.get("tritondelegate", {}).get("device", "?")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
