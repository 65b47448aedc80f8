"""Load and save time of a 105 MB program file, plain (xxh3 checksums) and signed (HMAC-SHA256), on the
null device: what checksums and signatures cost at load. Needs no GPU.

    python scripts/load_cost.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tritondelegate as td  # noqa: E402


def main(repeats: int = 3) -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4096, 6400).eval(), torch.randn(1, 4096)
    resident = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = td.lower(torch.export.export(model, (x,)), config=resident)
    key = os.urandom(32)
    with tempfile.TemporaryDirectory() as folder:
        for name, k in (("plain", None), ("signed", key)):
            path = os.path.join(folder, f"{name}.tdp")
            saves, loads = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                lowered.save(path, key=k)
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                with td.load(path, devices="null", key=k) as program:
                    program.load_method()
                    loads.append(time.perf_counter() - start)
            print(f"{name}: {os.path.getsize(path) / 1e6:.1f} MB, save {min(saves) * 1e3:.0f} ms, "
                  f"load + load_method {min(loads) * 1e3:.0f} ms (best of {repeats})")


if __name__ == "__main__":
    main()
