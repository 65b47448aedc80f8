"""The one benchmark harness: models whose constants dominate, lowered once per mode, loaded, timed.

Modes, for the same model and the same inputs:

* ``per_call_copy``  the default config: the method copies every constant host-to-device on every call.
* ``resident``       ``skip_h2d_for_constants=True``: constants are copied into the device arena once,
                     at load; a call copies only its input in and its output out.
* ``resident_io``    also ``skip_h2d_for_method_inputs`` and ``skip_d2h_for_method_outputs``: the input
                     is passed as a device tensor and the output comes back as one; a call copies nothing.
* ``resident_graphs`` ``resident`` loaded with ``graphs=True``: each delegate is recorded once and
                     replayed as one CUDA graph, so the per-kernel launch cost is paid once per delegate.
* ``eager``          PyTorch eager on the same device, weights already there, input and output on it.
* ``torch_compile``  ``torch.compile`` of the eager model, on a GPU only, skipped (with the reason)
                     where it fails.

Timing. On CUDA every call runs on one side stream (the method gets ``stream=``) and the timed function
ends by synchronizing that stream, so a timing covers the device work, not only the host call. On the
simulated device the "device" is host memory and the kernels run under the Triton interpreter: timings
measure the interpreter, and only the byte and launch counts carry over to a GPU.
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import tritondelegate.kernels  # noqa: F401  (first: decides compiled vs interpreted Triton)

import pytest
import torch
import triton
import triton.language as tl
from torch import nn

import tritondelegate as td
from tritondelegate.kernels.traffic import method_traffic
from tritondelegate.models import MLP, demo_decoder

DEVICE = "cuda" if torch.cuda.is_available() else "simulated"
# Where eager runs and where "device" tensors live: the simulated device's memory is host memory.
TORCH_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"

LOWERED_MODES = {
    "per_call_copy": td.PropagateDeviceConfig(),
    "resident": td.PropagateDeviceConfig(skip_h2d_for_constants=True),
    "resident_io": td.PropagateDeviceConfig(
        skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True, skip_h2d_for_constants=True
    ),
    "resident_graphs": td.PropagateDeviceConfig(skip_h2d_for_constants=True),
}
MODES = (*LOWERED_MODES, "eager", "torch_compile")


# --- models -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A model and its input, rebuilt deterministically (seed 0) whenever it is needed."""

    name: str
    family: str  # "mlp" or "decoder"
    widths: tuple[int, ...] = ()  # MLP: [in, h1, ..., out]
    decoder: tuple[tuple[str, int], ...] = ()  # DecoderConfig overrides
    batch: int = 8  # MLP rows: few, so the weights dominate the bytes a call touches

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        if self.family == "mlp":
            torch.manual_seed(0)
            model = MLP(list(self.widths)).eval()
            return model, (torch.randn(self.batch, self.widths[0]),)
        return demo_decoder(seed=0, **dict(self.decoder))  # input: 16 token ids


def mlp(width: int, depth: int) -> Case:
    """``depth`` square Linear layers of ``width`` (fp32): about 4 * depth * width^2 bytes of weights."""
    return Case(f"mlp-w{width}-d{depth}", "mlp", widths=(width,) * (depth + 1))


def decoder(dim: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int) -> Case:
    overrides = dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                     vocab_size=vocab)
    return Case(f"decoder-d{dim}-l{layers}-v{vocab}", "decoder", decoder=tuple(overrides.items()))


# Size lists by device. The simulated device interprets every kernel on the CPU: a few MB at most.
# On a GPU "small" and "large" together ("default") span about 1 MB to 1 GB of fp32 weights; each
# list runs in a few minutes so scripts/gpu_bench.sh can run them as separate, time-boxed steps.
SIZES = {
    "simulated": {
        "quick": [mlp(256, 4), decoder(64, 2, 4, 2, 176, 256)],                  # 1.1 MB, 0.2 MB
        "small": [mlp(256, 4), decoder(128, 2, 4, 2, 352, 1024)],                # 1.1 MB, 2.5 MB
        "large": [mlp(512, 4), mlp(256, 16)],                                    # 4.2 MB, 4.2 MB (depth)
    },
    "cuda": {
        "quick": [mlp(256, 4), decoder(256, 2, 4, 2, 704, 4096)],                # 1.1 MB, 14 MB
        "small": [mlp(256, 4), mlp(1024, 4), decoder(256, 2, 4, 2, 704, 4096)],  # 1.1 MB, 17 MB, 14 MB
        # 269 MB, 1.07 GB, 495 MB, 67 MB (depth): the headline sizes first, in case time runs out
        "large": [mlp(4096, 4), mlp(8192, 4), decoder(1024, 8, 16, 4, 2816, 16384), mlp(1024, 16)],
    },
}
SIZE_GROUPS = ("quick", "small", "large", "default")


def cases(group: str, names: list[str] | None = None) -> list[Case]:
    """The cases of a size group on this machine's device; ``default`` is ``small`` then ``large``.
    ``names`` picks cases by name from all of this device's lists instead."""
    table = SIZES[DEVICE]
    if names:
        known = {c.name: c for group_cases in table.values() for c in group_cases}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown case(s) {', '.join(unknown)} on the {DEVICE} device; valid: {', '.join(known)}")
        return [known[n] for n in names]
    if group == "default":
        return table["small"] + [c for c in table["large"] if c not in table["small"]]
    if group not in table:
        raise ValueError(f"unknown size group {group!r}; valid: {', '.join(SIZE_GROUPS)}")
    return table[group]


# (timed rounds, warmup rounds) by benchmark kind; the first call compiles the Triton kernels.
ROUNDS = {
    "cuda": {"latency": (20, 3), "load": (5, 1), "launch": (100, 5), "generation": (10, 2)},
    "simulated": {"latency": (5, 1), "load": (5, 1), "launch": (3, 1), "generation": (3, 1)},
}


def rounds(kind: str) -> tuple[int, int]:
    timed, warmup = ROUNDS[DEVICE][kind]
    override = os.environ.get("TD_BENCH_ROUNDS")
    return (int(override) if override else timed), warmup


# --- timing -----------------------------------------------------------------------------------------
def synchronized(call: Callable[[], object], stream) -> Callable[[], object]:
    """``call`` run on ``stream`` and waited for, so the time covers the device work. On the simulated
    device (``stream`` None) every copy and kernel has finished when the host call returns."""
    if stream is None:
        def run():
            with torch.no_grad():
                return call()
        return run

    def run():
        with torch.no_grad(), torch.cuda.stream(stream):
            out = call()
        stream.synchronize()
        return out

    return run


def stream_span_ms(call: Callable[[], object], stream, n: int) -> float | None:
    """Median milliseconds between CUDA events recorded on ``stream`` before and after ``call``."""
    if stream is None:
        return None
    spans = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad(), torch.cuda.stream(stream):
            start.record(stream)
            call()
            end.record(stream)
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return statistics.median(spans)


def host_call_ms(call: Callable[[], object], stream, n: int) -> float | None:
    """Median milliseconds until ``call`` returns to the host, before waiting for the device (the host's
    share of a call: argument checks, copies it has to wait for, launches)."""
    if stream is None:
        return None
    times = []
    for _ in range(n):
        with torch.no_grad(), torch.cuda.stream(stream):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        stream.synchronize()
    return statistics.median(times) * 1e3


def measure(benchmark, call: Callable[[], object], stream, kind: str):
    """Time ``call`` (pedantic: fixed rounds after warmup rounds; each round waits for the stream).
    Returns (last output, extra facts). On CUDA the facts add the host's share of a call and the
    span between CUDA events around it on the stream."""
    timed, warmup = rounds(kind)
    out = benchmark.pedantic(synchronized(call, stream), rounds=timed, warmup_rounds=warmup)
    facts = {"rounds": timed, "warmup_rounds": warmup}
    if stream is not None and not benchmark.disabled:
        facts["host_call_ms"] = host_call_ms(call, stream, min(timed, 10))
        facts["stream_span_ms"] = stream_span_ms(call, stream, min(timed, 10))
    return out, facts


def median_s(benchmark) -> float | None:
    """The median of the rounds just timed (None with ``--benchmark-disable``)."""
    return None if benchmark.disabled or benchmark.stats is None else benchmark.stats.stats.median


def max_abs_error(out, reference: torch.Tensor) -> float:
    return (out.detach().float().cpu() - reference.float()).abs().max().item()


# --- session state ----------------------------------------------------------------------------------
class Bench:
    """Session state: lowered program files by (case, mode), kept on disk for the session, and the one
    case held in memory (models, loaded methods), released when the next case comes."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.stream = torch.cuda.Stream() if DEVICE == "cuda" else None
        self._files: dict[tuple[str, str], str] = {}
        self._weight_bytes: dict[str, int] = {}
        self._held: Prepared | None = None

    def prepare(self, case: Case) -> Prepared:
        if self._held is None or self._held.case != case:
            self._held = None
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            self._held = Prepared(case, self)
            self._weight_bytes[case.name] = self._held.weight_bytes
        return self._held

    def program_path(self, case: Case, mode: str) -> str:
        """The program file of ``case`` lowered for ``mode`` (lowered and saved on first use)."""
        path = self._files.get((case.name, mode))
        if path is None:
            path = self.prepare(case).lower_and_save(mode)
            self._files[(case.name, mode)] = path
        return path

    def weight_bytes(self, case: Case) -> int:
        if case.name not in self._weight_bytes:
            self.prepare(case)
        return self._weight_bytes[case.name]


class Prepared:
    """One case in memory: the model, its input, the eager reference output, the loaded methods."""

    def __init__(self, case: Case, bench: Bench):
        self.case, self.bench = case, bench
        self.model, self.inputs = case.build()
        with torch.no_grad():
            self.reference = self.model(*self.inputs)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._exported = None
        self._eager = None

    def lower_and_save(self, mode: str) -> str:
        if self._exported is None:
            self._exported = torch.export.export(self.model, self.inputs)
        config = td.LowerConfig(propagate_device=LOWERED_MODES[mode])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", td.PerCallCopyWarning)  # the per-call copies are the point
            lowered = td.lower(self._exported, partitioner=td.TritonPartitioner(device="cuda:0"), config=config)
        path = os.path.join(self.bench.workdir, f"{self.case.name}.{mode}.tdp")
        lowered.save(path)
        return path

    def device_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(TORCH_DEVICE) for t in self.inputs)

    def runner(self, mode: str) -> tuple[Callable[[], object], Callable[[object], dict]]:
        """(one call, facts about it given its output) for ``mode``; skips where the mode cannot run."""
        if mode in LOWERED_MODES:
            return self._lowered(mode)
        if mode == "eager":
            return self._eager_runner(compiled=False)
        if mode == "torch_compile":
            return self._eager_runner(compiled=True)
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")

    def _facts(self, mode: str, out, **counts) -> dict:
        return {"model": self.case.name, "family": self.case.family, "mode": mode, "device": DEVICE,
                "weight_bytes": self.weight_bytes, "max_abs_error": max_abs_error(out, self.reference), **counts}

    def _lowered(self, mode: str):
        program = td.load(self.bench.program_path(self.case, mode))
        stream = self.bench.stream
        method = program.load_method("forward", stream=stream, graphs=mode == "resident_graphs")
        # resident_io takes device tensors (host tensors on the simulated device, whose memory is the host's)
        args = self.device_inputs() if mode == "resident_io" else self.inputs
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # inputs made on the default stream are ready before the side stream reads them

        def call():
            return method(*args, stream=stream)

        # The program's traffic model (kernels/traffic.py): the same for every lowered mode of a model.
        traffic = method_traffic(next(m for m in program.program.methods if m.name == "forward"))

        def facts(out):
            s = method.stats
            return self._facts(
                mode, out, device=program.device, load_h2d_bytes=s.load_h2d_bytes, call_h2d_bytes=s.call_h2d_bytes,
                call_d2h_bytes=s.call_d2h_bytes, call_copies=s.call_copies, launches_per_call=s.launches_per_call,
                synchronizations_per_call=s.synchronizations_per_call, traffic=traffic,
            )

        return call, facts

    def _eager_model(self):
        """The model on the device (a copy: the CPU model stays the reference)."""
        if self._eager is None:
            self._eager = copy.deepcopy(self.model).to(TORCH_DEVICE)
        return self._eager

    def _eager_runner(self, compiled: bool):
        mode = "torch_compile" if compiled else "eager"
        if compiled and DEVICE != "cuda":
            pytest.skip("torch_compile runs on a GPU only: on the simulated device it would time CPU code")
        if compiled and os.environ.get("TD_BENCH_COMPILE", "1") == "0":
            pytest.skip("TD_BENCH_COMPILE=0")
        model = self._eager_model()
        args = self.device_inputs()
        fn = model
        if compiled:
            try:
                torch._dynamo.reset()  # a fresh compile per model: earlier models' guards don't count
                fn = torch.compile(model)
                with torch.no_grad():
                    fn(*args)  # compiles
            except Exception as exc:  # noqa: BLE001  (any compiler failure: report it, skip the mode)
                first_line = (str(exc).strip().splitlines() or [""])[0][:300]
                pytest.skip(f"torch.compile failed here: {type(exc).__name__}: {first_line}")
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # the model and inputs, moved on the default stream, are in place

        def call():
            return fn(*args)

        def facts(out):
            # Weights moved to the device once (model.to); inputs are device tensors, the output stays there.
            moved = self.weight_bytes if DEVICE == "cuda" else 0
            return self._facts(mode, out, load_h2d_bytes=moved, call_h2d_bytes=0, call_d2h_bytes=0,
                               launches_per_call=None)

        return call, facts


# --- load time and host-to-device bandwidth ----------------------------------------------------------
LOAD_KINDS = {"cuda": ("resident_load", "pinned", "pageable"), "simulated": ("resident_load", "host_copy")}


def load_runner(bench: Bench, case: Case, kind: str) -> tuple[Callable[[], object], int]:
    """(one load or one plain copy, the bytes it moves). ``resident_load`` is ``load_method`` of the
    resident program (arena allocation, constants copied from the mapped file, delegate setup); the
    plain copies move the same number of bytes: from pinned or pageable host memory to the GPU, or on
    the simulated device host to host."""
    program = td.load(bench.program_path(case, "resident"))
    nbytes = program.load_method("forward").stats.load_h2d_bytes
    if kind == "resident_load":
        return (lambda: program.load_method("forward", stream=bench.stream)), nbytes
    if kind == "host_copy":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        return (lambda: dst.copy_(src)), nbytes
    if kind in ("pinned", "pageable"):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return (lambda: dst.copy_(src, non_blocking=True)), nbytes
    raise ValueError(f"unknown load kind {kind!r}; valid here: {', '.join(LOAD_KINDS[DEVICE])}")


# --- host cost of one kernel launch ------------------------------------------------------------------
LAUNCH_CHAINS = (1, 64)  # kernels per call: the difference isolates the cost of one more launch
LAUNCH_IMPLS = ("runtime", "triton_pointwise", "triton_minimal", "eager")
LAUNCH_NUMEL = 8


class AddChain(nn.Module):
    """``n`` tiny adds in a row: one pointwise kernel each once lowered."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = x + 1.0
        return x


@triton.jit
def add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # out[i] = x[i] + 1: the smallest kernel, fewest arguments
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask, other=0.0) + 1.0, mask=mask)


def _pointwise_add(x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """``out = x + 1`` through the runtime's own pointwise kernel with the arguments its launcher
    builds (the launcher writes into a recorder instead of a launch plan)."""
    from tritondelegate.kernels.refs import TRef
    from tritondelegate.kernels.elementwise import launch_pointwise
    from tritondelegate.kernels.table import KERNELS

    class Recorder:
        def launch(self, kernel, grid, *args, **constexprs):
            self.launched = (kernel, tuple(int(g) for g in grid), args, constexprs)

    tensors = {0: x, 1: out}
    shape, strides = tuple(x.shape), tuple(x.stride())
    recorder = Recorder()
    launch_pointwise(recorder, "add", TRef(1, 1, out.dtype, shape, strides, 0), [TRef(0, 0, x.dtype, shape, strides, 0), 1.0])
    name, grid, args, constexprs = recorder.launched
    args = [tensors[a.index] if isinstance(a, TRef) else a for a in args]
    kernel = KERNELS[name]
    return lambda: kernel[grid](*args, **constexprs)


def launch_runner(n: int, impl: str, stream) -> tuple[Callable[[], object], dict]:
    """(a call that runs ``n`` tiny adds, facts). Device tensors in and out: no copies anywhere."""
    x = torch.randn(LAUNCH_NUMEL, device=TORCH_DEVICE)
    if impl == "runtime":
        model = AddChain(n)
        ep = torch.export.export(model, (x.cpu(),))
        config = td.LowerConfig(propagate_device=LOWERED_MODES["resident_io"])
        method = td.lower(ep, partitioner=td.TritonPartitioner(device="cuda:0"), config=config).load().load_method("forward")
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return (lambda: method(x, stream=stream)), {"launches": method.stats.launches_per_call}
    if impl == "eager":
        def call():
            y = x
            for _ in range(n):
                y = y + 1.0
            return y
        return call, {"launches": n}
    bufs = [x, torch.empty_like(x)]
    if impl == "triton_pointwise":
        steps = [_pointwise_add(bufs[0], bufs[1]), _pointwise_add(bufs[1], bufs[0])]
    elif impl == "triton_minimal":
        steps = [lambda: add_one_kernel[(1,)](bufs[0], bufs[1], LAUNCH_NUMEL, BLOCK=LAUNCH_NUMEL),
                 lambda: add_one_kernel[(1,)](bufs[1], bufs[0], LAUNCH_NUMEL, BLOCK=LAUNCH_NUMEL)]
    else:
        raise ValueError(f"unknown launch impl {impl!r}; valid: {', '.join(LAUNCH_IMPLS)}")
    if DEVICE == "cuda":
        torch.cuda.synchronize()

    def call():
        for i in range(n):
            steps[i % 2]()

    return call, {"launches": n}


# --- machine facts -----------------------------------------------------------------------------------
def environment() -> dict:
    info = {
        "device": DEVICE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if DEVICE == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info
