#!/usr/bin/env bash
# GPU check: the CUDA-marked tests, every kernel test natively on the GPU, and the demo's JSON.
# Usage on a CUDA machine, from the repository root: scripts/gpu_check.sh [OUTDIR]
# Writes junit XML, logs and demo.json to OUTDIR (default: $OUT, else bench/results/gpu_check).
set -uo pipefail
out="${1:-${OUT:-bench/results/gpu_check}}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/versions.txt"
status=0
python -m pytest tests/test_cuda.py -q -rs --junitxml="$out/cuda.xml" 2>&1 | tee "$out/cuda.log" || status=1
python -m pytest tests -q -x -m "not slow" --ignore=tests/test_demo.py \
  -k "not damaged" --junitxml="$out/all.xml" 2>&1 | tail -40 | tee "$out/all.log" || status=1
python -m tritondelegate demo --json > "$out/demo.json" 2> "$out/demo.err" || status=1
cat "$out/demo.json"
exit $status
