"""Time to the first result on a fresh machine: a new process, an empty Triton cache, then load the
program and call it once. ``jit``: every kernel variant compiles on first use; ``binaries``: the program
carries them (``LowerConfig(kernel_archs=...)``) and Triton's cache is filled from the file at load.
Needs a GPU (on the CPU the simulated device interprets kernels: nothing compiles)."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate.models import demo_decoder

FIRST_CALL_MODES = ("jit", "binaries")
CHILD = """
import sys, time, torch
start = time.perf_counter()
import tritondelegate as td
program = td.load(sys.argv[1], devices="cuda")
method = program.load_method("forward")
ids = torch.zeros(1, 16, dtype=torch.long)
method(ids)
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: first-call compile time")
@pytest.mark.parametrize("mode", FIRST_CALL_MODES)
def test_first_call(benchmark, tmp_path, mode):
    benchmark.group = "first call"
    major, minor = torch.cuda.get_device_capability()
    model, example = demo_decoder(seed=0)
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True),
                            kernel_archs=(f"sm_{major}{minor}",) if mode == "binaries" else ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        td.lower(torch.export.export(model, example), config=config).save(tmp_path / "decoder.tdp")
    seconds = []

    def fresh_process():
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"triton{len(seconds)}")}
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "decoder.tdp")], env=env,
                              capture_output=True, text=True, check=True)
        seconds.append(float(done.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(fresh_process, rounds=2, iterations=1)
    benchmark.extra_info.update(model="demo decoder", mode=mode, device="cuda",
                                first_call_s=min(seconds), arch=f"sm_{major}{minor}")
