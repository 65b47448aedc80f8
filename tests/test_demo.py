import json
import subprocess
import sys


def test_demo_json():
    proc = subprocess.run([sys.executable, "-m", "tritondelegate", "demo", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] in ("cuda", "simulated")
    assert result["nodes_delegated"] >= 0.9 * result["nodes_total"]
    assert result["max_abs_error"] < 1e-3
    assert result["delegates"] >= 1
    # Constants are resident: loaded once, and each call copies only the token ids in, logits out.
    assert result["load_h2d_bytes"] == result["resident_constant_bytes"] > 0
    assert result["call_h2d_bytes"] == 16 * 8
    assert result["call_d2h_bytes"] == 16 * 256 * 4
    for device, size in result["arena_bytes"].items():
        assert result["arena_lower_bound_bytes"][device] <= size


def test_demo_readable_output():
    proc = subprocess.run([sys.executable, "-m", "tritondelegate", "demo", "--per-call-copy", "--attention", "matmul"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "max abs error vs eager PyTorch" in proc.stdout
    assert "per-call copies" in proc.stdout
