#!/usr/bin/env bash
# Run the benchmark suite (bench/) on a CUDA machine, in time-boxed steps, and write the JSON and the report.
#
#   bash scripts/gpu_bench.sh [SIZES]        SIZES: quick, small, large or default (default: default)
#
# Results go to $OUT when it is set (the device machine's output folder), else to bench/results/:
#   gpu-env.txt           versions, GPU, nvidia-smi
#   gpu-launch.json       host cost of one kernel launch
#   gpu-runtime.json      runtime host cost per launch (null device), first call JIT vs kernel binaries
#   gpu-small.json        latency per mode and load time vs copy bandwidth, the small models together
#   gpu-<case>.json       the same, one file per large model (or per model for SIZES other than default)
#   gpu-generation.json   decode tokens/s with a KV cache: cache copied per call, program state on the
#                         device, with CUDA graphs, with prompt lookup decoding, transformers' Llama eager;
#                         and transformers' Mixtral
#                         (8 experts, top 2) lowered and eager (bench/test_generation.py)
#   gpu-generation-long.json  the same for a 3000-token context (split vs one-pass decode attention)
#   gpu-generation-quantized.json  decode tokens/s with int8 and 4-bit weight-only quantized linears
#   gpu-generation-quantized-moe.json  the same for the MoE decoder, its experts quantized too
#   gpu-*.log             each step's pytest output
#   gpu-report.md         python -m bench.report over every gpu-*.json written
#   gpu-latency.png       the plot (when matplotlib is installed; the report says when it is not)
#
# Each step is its own pytest run with its own JSON (the headline sizes early), so a step that runs out of
# time loses only itself. The whole script stays within BUDGET_S seconds (default 500, to fit a
# 600-second command): a step gets at most STEP_TIMEOUT_S (default 240) and whatever budget is left,
# and is skipped when fewer than 30 seconds are left. Other knobs: TD_BENCH_ROUNDS (timed rounds per
# benchmark), TD_BENCH_COMPILE=0 (skip torch.compile), PYTHON (interpreter, default python).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
SIZES=${1:-default}
RESULTS=${OUT:-bench/results}
BUDGET_S=${BUDGET_S:-500}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-240}
START=$(date +%s)
mkdir -p "$RESULTS"
rm -f "$RESULTS"/gpu-*  # this script's files from an earlier run: the report merges every gpu-*.json

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__); print("cuda available:", torch.cuda.is_available()); print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  "$PY" -c 'import pytest_benchmark; print("pytest-benchmark", pytest_benchmark.__version__)' || echo "pytest-benchmark missing"
  nvidia-smi || true
} 2>&1 | tee "$RESULTS/gpu-env.txt"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_bench.sh: torch.cuda.is_available() is False; this script measures a GPU (run 'pytest bench/' for the simulated device)" >&2
  exit 2
fi

# step NAME PYTEST-ARGS...: one pytest run, time-boxed, JSON and log named after the step.
step() {
  local name=$1; shift
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < 30 )); then
    echo "== $name: skipped, ${left}s of the ${BUDGET_S}s budget left" | tee -a "$RESULTS/gpu-skipped.txt"
    return
  fi
  local limit=$(( left < STEP_TIMEOUT_S ? left : STEP_TIMEOUT_S ))
  echo "== $name (at most ${limit}s)"
  timeout -k 10 "$limit" "$PY" -m pytest bench/ -q -p no:randomly "$@" \
    --benchmark-json="$RESULTS/gpu-$name.json" >"$RESULTS/gpu-$name.log" 2>&1
  local rc=$?
  tail -n 3 "$RESULTS/gpu-$name.log"; echo
  if (( rc == 124 || rc == 137 )); then
    echo "== $name: timed out after ${limit}s (no JSON for this step)" | tee -a "$RESULTS/gpu-skipped.txt"
  elif (( rc != 0 )); then
    echo "== $name: pytest exit $rc (see gpu-$name.log)"
  fi
}

step launch bench/test_launch.py
# The runtime's own host cost (null device) and the time to a first result, JIT vs kernel binaries.
step runtime bench/test_overhead.py bench/test_first_call.py
# Generation (DESIGN.md's first workload): SIZES=quick runs its small model only, anything else both.
step generation bench/test_generation.py --bench-sizes "$([[ "$SIZES" == quick ]] && echo quick || echo default)" \
  -k "not int8 and not int4"
# A long context (3000-token prompt, 4096-position cache): decode attention split over the keys or not.
[[ "$SIZES" == quick ]] || step generation-long bench/test_generation.py --bench-case kv-d1024-l2-v16384-s4096
# Weight-only quantized linears (int8 per row, 4 bits per group of 64) on the 495 MB decoder: its own
# step (each mode lowers a quantized copy), compared with the graphs mode of the generation step.
[[ "$SIZES" == quick ]] || step generation-quantized bench/test_generation.py --bench-case kv-d1024-l8-v16384-s1024 \
  -k "int8 or int4"
# The same for the Mixture-of-Experts decoder (0.83 GB in bf16): its experts quantized too.
[[ "$SIZES" == quick ]] || step generation-quantized-moe bench/test_generation.py \
  --bench-case moe-d1024-l4-e8k2-v16384-s1024 -k "int8 or int4"
if [[ "$SIZES" == default ]]; then
  # The small models share one process; each large one gets its own step (and JSON).
  step small bench/test_latency.py bench/test_load.py --bench-sizes small
  SIZES=large
fi
for case in $("$PY" -c "from bench import harness; print(' '.join(c.name for c in harness.cases('$SIZES')))"); do
  step "$case" bench/test_latency.py bench/test_load.py --bench-case "$case"
done

shopt -s nullglob
jsons=("$RESULTS"/gpu-*.json)
if (( ${#jsons[@]} )); then
  "$PY" -m bench.report "${jsons[@]}" --plot "$RESULTS/gpu-latency.png" >"$RESULTS/gpu-report.md"
  cat "$RESULTS/gpu-report.md"
else
  echo "gpu_bench.sh: no step wrote results" >&2
  exit 1
fi
echo "== done in $(( $(date +%s) - START ))s; results in $RESULTS"
