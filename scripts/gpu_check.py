"""The first run of blobpipe on a GPU, as one command with a time budget.

Run by ``scripts/gpu_check.sh`` (which installs the carried wheels first). Steps, in
order, each under the time the budget has left, and ``$OUT/summary.json`` written
again after each one, so a run cut short keeps every figure measured so far:

0. preflight: an NVIDIA device node or ``nvidia-smi``, and every package the steps
   import (looked up, not imported: this takes well under a second). Anything
   missing: the summary names it and the run stops with exit status 1.
1. probes: the emulated-device tests of the device-path rules, on real CUDA
   (memory reuse after the consumer's stream, device exports that hold their
   memory, foreign stream handles without warnings, ``"cuda"`` as the thread's
   current device, filler threads on the loader's device, the DLPack consumer's
   stream), a few seconds each.
2. blocking-sync events: the CPU time a host thread spends waiting 0.3 s for a
   kernel, with a spinning event (``Event(block=False)``) and a blocking-sync one.
3. the ``gpu``-marked tests (``BLOBPIPE_REQUIRE_GPU=1``: a skip is a failure).
4. ``bench/bench_gpu.py`` (W3, shortened: ``--steps 200 --seconds 1``).

Worst case, by construction: every step runs under ``timeout`` with the smaller of
its own cap (probes 60 s, blocking 30 s, tests 120 s, benchmark 70 s) and what is
left of the budget (``--budget``: 280 s counted from the start of gpu_check.sh, so
its wheel install, capped at 15 s, and ``nvidia-smi``, capped at 10 s, are inside
it). The whole command therefore ends within 280 s plus the writing of the last
summary (well under a second), whatever hangs: at most 5 minutes. The caps add up
to 280 s; on a GPU the probes take seconds each and the benchmark's W3 database is
written in its first seconds, so the caps are ceilings, not estimates of the time
each step needs (no GPU has run this yet). A step cut by the budget is reported
as ``"timed out"`` with the time it had.

Usage: ``python scripts/gpu_check.py --out DIR [--started EPOCH] [--budget 280]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# module: (distribution as pip names it, lowest version), as pyproject.toml's dev extra
NEED = {
    "numpy": ("numpy", "1.24"),
    "cupy": ("cupy-cuda12x or cupy-cuda13x", "13"),
    "lmdb": ("lmdb", "1.4"),
    "cv2": ("opencv-python-headless", "4.8"),
    "anyio": ("anyio", "4.11"),
    "google.protobuf": ("protobuf", "4.21.1"),
    "pytest": ("pytest", "8"),
    "pytest_asyncio": ("pytest-asyncio", "0.23"),
    "pytest_timeout": ("pytest-timeout", "2.3"),
    "hypothesis": ("hypothesis", "6.100"),
    "trio": ("trio", "0.25"),
    "torch": ("torch", "2"),
}
# the distributions a module may come from (for its version, without importing it)
DISTS = {
    "cupy": ["cupy-cuda12x", "cupy-cuda13x", "cupy"],
    "cv2": ["opencv-python-headless", "opencv-python", "opencv-contrib-python"],
    "google.protobuf": ["protobuf"],
    "pytest_asyncio": ["pytest-asyncio"],
    "pytest_timeout": ["pytest-timeout"],
}

# the device-path rules' tests that run first, one line of the summary each
PROBES = {
    "1 reuse after the consumer's stream": [
        "tests/test_streams.py::test_a_closed_blobs_device_block_waits_for_the_consumers_stream",
        "tests/test_streams.py::test_a_batch_closed_off_its_named_stream_is_not_reused_early",
    ],
    "2 device exports hold their memory": [
        "tests/test_streams.py::test_cupy_from_dlpack_of_a_batch_keeps_its_values",
    ],
    "3 foreign stream handle without warnings": [
        "tests/test_streams.py::test_a_raw_stream_handle_warns_nothing",
    ],
    "4 'cuda' is the thread's current device": [
        "tests/test_streams.py::test_cuda_is_the_threads_current_device",
    ],
    "5 fillers stay on the loader's device": [
        "tests/test_streams.py::test_filler_threads_stay_on_the_loaders_device",
    ],
    "6 the DLPack consumer's stream": [
        "tests/test_streams.py::test_a_dlpack_consumers_stream_orders_the_slots_reuse",
    ],
}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())


def preflight() -> tuple[dict[str, str], list[str]]:
    """What this machine has and what it lacks (nothing is imported)."""
    found = {"python": sys.version.split()[0]}
    missing = []
    if not (Path("/dev/nvidia0").exists() or _which("nvidia-smi")):
        missing.append("an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi)")
    for module, (dist, low) in NEED.items():
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            missing.append(f"{dist} >= {low} (not installed)")
            continue
        version = "?"
        for name in DISTS.get(module, [module]):
            try:
                version = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        found[module] = version
        if version != "?" and _version_key(version) < _version_key(low):
            missing.append(f"{dist} >= {low} (found {version})")
    return found, missing


def _which(name: str) -> bool:
    return any(
        os.access(os.path.join(d, name), os.X_OK) for d in os.environ.get("PATH", "").split(":")
    )


class Run:
    """The summary, written after every step."""

    def __init__(self, out: Path, started: float, budget: float) -> None:
        self.out = out
        self.deadline = started + budget
        self.summary: dict[str, Any] = {"passed": False, "budget_s": budget, "steps": {}}

    def left(self) -> float:
        return self.deadline - time.time() - 1.0  # a second for the last summary

    def write(self) -> None:
        steps = self.summary["steps"]
        self.summary["passed"] = bool(steps) and all(s.get("passed") for s in steps.values())
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")

    def step(self, name: str, cmd: list[str], cap: float, log: str, **env: str) -> dict[str, Any]:
        """Run ``cmd`` under the smaller of ``cap`` and the budget left; record it."""
        limit = min(cap, self.left())
        record: dict[str, Any] = {"log": log, "limit_s": round(limit, 1)}
        self.summary["steps"][name] = record
        if limit < 5:
            record.update(passed=False, status="not run: the budget is spent")
            self.write()
            return record
        t0 = time.time()
        with (self.out / log).open("w") as f:
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=limit,
                    env={**os.environ, **env},
                    check=False,
                )
                record.update(exit_status=proc.returncode, passed=proc.returncode == 0)
                record["status"] = "passed" if proc.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                record.update(passed=False, status=f"timed out after {limit:.0f} s")
        record["wall_s"] = round(time.time() - t0, 1)
        self.write()
        return record


def junit_cases(path: Path) -> list[tuple[str, str]]:
    """(test id, outcome) of every test case in a JUnit file."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        cases.append((f"{case.get('classname', '')}::{case.get('name', '')}", outcome))
    return cases


def pytest_cmd(junit: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=-ra --strict-markers",
        "--junitxml",
        str(junit),
        *args,
    ]


def blocking_probe() -> int:
    """Print the CPU seconds a host thread spends waiting 0.3 s for a kernel, per event kind."""
    import cupy as cp

    spin = cp.RawKernel(
        r"""extern "C" __global__ void spin(long long cycles) {
            long long start = clock64(); while (clock64() - start < cycles) { } }""",
        "spin",
    )
    rate_khz = cp.cuda.Device().attributes.get("ClockRate") or 2_000_000
    cycles = cp.int64(0.3 * rate_khz * 1000)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (cycles,))  # compile and load
    stream.synchronize()
    figures = {}
    for block in (False, True, False, True):
        event = cp.cuda.Event(block=block, disable_timing=True)
        with stream:
            spin((1,), (1,), (cycles,))
        event.record(stream)
        c0, w0 = time.process_time(), time.perf_counter()
        event.synchronize()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        figures.setdefault("blocking" if block else "spinning", []).append(
            {"cpu_s": round(cpu, 4), "wall_s": round(wall, 4)}
        )
    print(json.dumps(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--started", type=float, default=None, help="epoch seconds of the start")
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for everything")
    ap.add_argument("--blocking-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.blocking_probe:
        return blocking_probe()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.started or time.time(), args.budget)

    found, missing = preflight()
    run.summary.update(found=found, missing=missing)
    run.summary["steps"]["preflight"] = {"passed": not missing, "missing": missing}
    run.write()
    print("found:", ", ".join(f"{k} {v}" for k, v in found.items()))
    if missing:
        print("missing:\n  " + "\n  ".join(missing))
        gpu = any(m.startswith("an NVIDIA GPU") for m in missing)
        packages = any(not m.startswith("an NVIDIA GPU") for m in missing)
        what = ", ".join((["no GPU"] if gpu else []) + (["packages missing"] if packages else []))
        print(f"gpu_check: {what} (see {out / 'summary.json'})", file=sys.stderr)
        return 1
    gpu_env = {"BLOBPIPE_REQUIRE_GPU": "1", "PYTHONUNBUFFERED": "1"}

    # 1. the probes of the device-path rules
    ids = [i for ids in PROBES.values() for i in ids]
    junit = out / "probes.xml"
    rec = run.step("probes", pytest_cmd(junit, "-m", "gpu", *ids), 60, "probes.txt", **gpu_env)
    cases = junit_cases(junit)
    findings = {}
    for finding, tests in PROBES.items():
        names = {t.split("::")[-1] for t in tests}
        outcomes = [o for case, o in cases if case.split("::")[-1].split("[")[0] in names]
        findings[finding] = {
            "passed": bool(outcomes) and all(o == "passed" for o in outcomes),
            "outcomes": outcomes or ["not run"],
        }
    rec["findings"] = findings
    run.write()

    # 2. blocking-sync events: CPU time while the host waits
    rec = run.step(
        "blocking_sync",
        [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--blocking-probe"],
        30,
        "blocking.txt",
    )
    try:
        rec["figures"] = json.loads((out / "blocking.txt").read_text().strip().splitlines()[-1])
    except (ValueError, IndexError, OSError):
        rec["figures"] = None
    run.write()

    # 3. the gpu tests
    junit = out / "gpu-tests.xml"
    rec = run.step(
        "gpu_tests", pytest_cmd(junit, "-m", "gpu", "tests"), 120, "gpu-tests.txt", **gpu_env
    )
    cases = junit_cases(junit)
    rec["counts"] = {o: sum(1 for _, x in cases if x == o) for o in {x for _, x in cases}}
    rec["not_passed"] = [n for n, o in cases if o != "passed"][:40]
    torn = [o for n, o in cases if "no_torn_batch" in n]
    rec["torn_batch_target"] = {
        "target": "a torch consumer on its own side stream sees no torn batch over 1,000 batches",
        "measured": torn[0] if torn else "not run",
        "passed": torn == ["passed"],
    }
    run.write()

    # 4. the benchmark
    bench_json = out / "bench-gpu.json"
    cmd = [
        sys.executable,
        "bench/bench_gpu.py",
        "--steps",
        "200",
        "--seconds",
        "1",
        "--json",
        str(bench_json),
    ]
    rec = run.step("gpu_bench", cmd, 70, "bench-gpu.txt", PYTHONUNBUFFERED="1")
    if bench_json.exists():
        results = json.loads(bench_json.read_text())
        rec["targets"] = results.get("targets")
        rec["results"] = results
    run.write()
    print(f"summary: {out / 'summary.json'} (passed: {run.summary['passed']})")
    return 0 if run.summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
