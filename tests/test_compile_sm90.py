"""Every kernel variant that representative models launch compiles for an H100/H200 (sm_90), with the
installed Triton and its bundled ptxas, on a machine without a GPU (scripts/compile_check.py).

The interpreter cannot show a compiler crash or a shared-memory overflow; this can. The suite compiles
every case but the fp16 ones that have a bf16 twin (the same kernels with the other 16-bit type: the
same tiles, registers within a few), which are left to the script's full run
(``python scripts/compile_check.py``): that keeps the suite within its time.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from workers import share_of_cores

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # Under pytest-xdist (README's command) the workers share the cores: this test compiles in its share.
    command = [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--json", str(tmp_path / "r.json"),
               "--jobs", str(share_of_cores()), "--skip-fp16-twins"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "total" in proc.stdout
