#!/usr/bin/env bash
# The first GPU run, as one command for a machine with an NVIDIA GPU and no network:
#   1. installs the wheels carried in .whl/ (made by scripts/fetch_gpu_wheels.sh where
#      there is network) for the packages that machine's image lacks (lmdb, trio, ...);
#   2. runs scripts/gpu_check.py: a preflight (GPU, packages), short probes of the
#      device-path rules on real CUDA, the CPU time of blocking-sync waits, the
#      gpu-marked tests (a skip is a failure), then bench/bench_gpu.py.
# $OUT/summary.json (OUT defaults to /tmp/blobpipe-gpu) is written after every step.
# Worst case: 5 minutes. The wheel install is capped at 15 s and every later step runs
# under the time left of a 280 s budget counted from this script's start (see the
# docstring of scripts/gpu_check.py). Without a GPU it stops after the preflight, in
# well under a second, with a summary naming what is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s.%N)
OUTDIR="${OUT:-/tmp/blobpipe-gpu}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if { [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null; } && compgen -G ".whl/*.whl" >/dev/null; then
  timeout 15 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -5
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if command -v nvidia-smi >/dev/null; then
  timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    >"$OUTDIR/nvidia-smi.txt" 2>&1
fi
exec "$PY" scripts/gpu_check.py --out "$OUTDIR" --started "$STARTED" --budget 280
