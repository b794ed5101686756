#!/usr/bin/env bash
# The first GPU run, as one command for a machine with an NVIDIA GPU and no network:
# scripts/gpu_check.py's steps (docstring there): the carried wheels of packages the
# machine lacks, the PCIe link, the device-path probes (each test in a process of its
# own), blocking-sync waits, the compiled modules built in place, the GPU benchmark
# (bandwidth against the link), worker scaling on the host, every gpu-marked test.
#
# Carry .whl/ (git-ignored; scripts/fetch_gpu_wheels.sh makes it where there is
# network) to the machine with the checkout: without it, the steps that need lmdb or
# trio say so and the others run. $OUT/summary.json (OUT defaults to /tmp/blobpipe-gpu)
# is written after every step and every test; each step is recorded, whatever fails.
# Worst case: 5 minutes (a 285 s budget counted from here, every step and test under
# its own limit inside it). Without a GPU it stops after the preflight, in well under
# a second, with a summary naming what is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s.%N)
OUTDIR="${OUT:-/tmp/blobpipe-gpu}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
exec timeout -k 5 295 "$PY" scripts/gpu_check.py --out "$OUTDIR" --started "$STARTED" --budget 285
