#!/usr/bin/env bash
# One prepared command for a machine with an NVIDIA GPU and no network:
#   1. installs the wheels carried in .whl/ (made here by scripts/fetch_gpu_wheels.sh)
#      for the packages that machine's image lacks (lmdb, trio, ...),
#   2. runs the gpu-marked tests with BLOBPIPE_REQUIRE_GPU=1 (a skip is a failure),
#   3. runs the GPU benchmark (pinned vs pageable host->device bandwidth, loader
#      throughput vs the pinned peak, starvation under a simulated training step).
# Budget: well under 5 minutes. Output also goes to $OUT (when set) for collection.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/blobpipe-gpu}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUTDIR/nvidia-smi.txt"
"$PY" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tee "$OUTDIR/versions.txt"

rc=0
BLOBPIPE_REQUIRE_GPU=1 timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  -o addopts="-ra --strict-markers" tests 2>&1 | tee "$OUTDIR/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

tests_rc=$rc
timeout 120 "$PY" bench/bench_gpu.py --json "$OUTDIR/bench-gpu.json" 2>&1 | tee "$OUTDIR/bench-gpu.txt"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || rc=1

# One summary for whoever collects $OUT: each part, its exit status, and the benchmark's
# figures when it got that far (it exits 1 on a missed target, 2+ on an error).
"$PY" - "$OUTDIR" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, pathlib, sys
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
bench = out / "bench-gpu.json"
summary = {
    "gpu_tests": {"passed": tests_rc == 0, "log": "gpu-tests.txt"},
    "gpu_bench": {
        "exit_status": bench_rc,
        "passed": bench_rc == 0,
        "results": json.loads(bench.read_text()) if bench.exists() else None,
        "log": "bench-gpu.txt",
    },
    "passed": tests_rc == 0 and bench_rc == 0,
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"summary: {out / 'summary.json'} (passed: {summary['passed']})")
PYEOF
exit "$rc"
