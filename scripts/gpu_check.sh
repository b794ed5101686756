#!/usr/bin/env bash
# One prepared command for a machine with an NVIDIA GPU and no network:
#   1. installs the wheels carried in .whl/ (made here by scripts/fetch_gpu_wheels.sh)
#      for the packages that machine's image lacks (lmdb, trio, ...),
#   2. runs the gpu-marked tests with BLOBPIPE_REQUIRE_GPU=1 (a skip is a failure),
#   3. runs the GPU benchmark (pinned vs pageable host->device bandwidth, loader
#      throughput vs the pinned peak, starvation under a simulated training step).
# Budget: under 7 minutes (tests 4, benchmark 2.5 at most). Output also goes to $OUT (when set) for collection.
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

# What this machine's Python has: every package the gpu tests and the benchmark import,
# with the versions found; the missing ones named exactly (carry them as wheels:
# PYVER=<this Python> bash scripts/fetch_gpu_wheels.sh where there is network).
if ! "$PY" - "$OUTDIR" <<'PYEOF' 2>&1 | tee "$OUTDIR/versions.txt"; then
import importlib, json, pathlib, sys
need = {  # module: (distribution, lowest version), as pyproject.toml's dev extra and CUDA
    "numpy": ("numpy", "1.24"), "cupy": ("cupy-cuda12x or cupy-cuda13x", "13"),
    "lmdb": ("lmdb", "1.4"), "cv2": ("opencv-python-headless", "4.8"),
    "anyio": ("anyio", "4.11"), "google.protobuf": ("protobuf", "4.21.1"),
    "pytest": ("pytest", "8"), "pytest_asyncio": ("pytest-asyncio", "0.23"),
    "pytest_timeout": ("pytest-timeout", "2.3"), "hypothesis": ("hypothesis", "6.100"),
    "trio": ("trio", "0.25"), "torch": ("torch", "2"),
}
def key(v):
    return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())
missing, found = [], {"python": sys.version.split()[0]}
for module, (dist, low) in need.items():
    try:
        version = str(getattr(importlib.import_module(module), "__version__", "?"))
    except Exception as exc:
        missing.append(f"{dist} >= {low} ({type(exc).__name__}: {exc})")
        continue
    found[module] = version
    if version != "?" and key(version) < key(low):
        missing.append(f"{dist} >= {low} (found {version})")
print("found:", ", ".join(f"{k} {v}" for k, v in found.items()))
if missing:
    print("missing:\n  " + "\n  ".join(missing))
    summary = {"passed": False, "python": found["python"], "found": found, "missing": missing}
    (pathlib.Path(sys.argv[1]) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(1)
PYEOF
  echo "gpu_check: packages missing (see above and $OUTDIR/summary.json)" >&2
  exit 1
fi
"$PY" -c "import cupy; print('devices', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tee -a "$OUTDIR/versions.txt"

rc=0
BLOBPIPE_REQUIRE_GPU=1 timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  -o addopts="-ra --strict-markers" --junitxml "$OUTDIR/gpu-tests.xml" tests 2>&1 \
  | tee "$OUTDIR/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

tests_rc=$rc
timeout 150 "$PY" bench/bench_gpu.py --json "$OUTDIR/bench-gpu.json" 2>&1 | tee "$OUTDIR/bench-gpu.txt"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || rc=1

# One summary for whoever collects $OUT: each part, its exit status, and the benchmark's
# figures when it got that far (it exits 1 on a missed target, 2+ on an error).
"$PY" - "$OUTDIR" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
bench = out / "bench-gpu.json"
results = json.loads(bench.read_text()) if bench.exists() else None
targets = list(results["targets"]) if results else []
# the third target is a test: a torch consumer on a side stream, 1,000 batches, no torn one
torn = None
if (out / "gpu-tests.xml").exists():
    for case in ET.parse(out / "gpu-tests.xml").iter("testcase"):
        if "no_torn_batch" in case.get("name", ""):
            torn = not any(c.tag in ("failure", "error", "skipped") for c in case)
targets.append({
    "target": "a torch consumer on its own side stream sees no torn batch over 1,000 batches",
    "measured": "passed" if torn else ("failed" if torn is False else "not run"),
    "passed": bool(torn),
})
summary = {
    "targets": targets,
    "gpu_tests": {"passed": tests_rc == 0, "log": "gpu-tests.txt"},
    "gpu_bench": {
        "exit_status": bench_rc,
        "passed": bench_rc == 0,
        "results": results,
        "log": "bench-gpu.txt",
    },
    "passed": tests_rc == 0 and bench_rc == 0 and all(t["passed"] for t in targets),
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"summary: {out / 'summary.json'} (passed: {summary['passed']})")
PYEOF
exit "$rc"
