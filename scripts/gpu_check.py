"""The first run of blobpipe on a GPU, as one command with a time budget.

Run by ``scripts/gpu_check.sh``. Steps, in this order, each declaring what it needs
(modules, a GPU, a C compiler); a step whose needs are not met is recorded as not
run, naming them, and every other step still runs. ``$OUT/summary.json`` is written
again after every step and after every test within one, so a run cut short, or a
step that hangs, keeps every figure measured so far.

1. ``wheels``: the carried wheels (``.whl/``, made by ``scripts/fetch_gpu_wheels.sh``;
   git-ignores it, so the machine has it only when it is carried there) of the
   packages this machine lacks, or has older than blobpipe needs, installed into
   ``/tmp/site``; nothing the image has is shadowed.
2. ``link``: the GPU, its PCIe link (generation and width, current and maximum) and
   NUMA node (``nvidia-smi``, sysfs), and the link's bandwidth per direction.
3. ``probes``: the device-path rules' tests on real CUDA, each in a process of its
   own with a timeout of its own (a test that hangs ends its process, no other).
4. ``blocking_sync``: the CPU time of a thread waiting 0.3 s for a kernel, with a
   spinning event and a blocking-sync one; passes when every blocking-sync wait costs
   under 10% of its wall time in CPU.
5. ``build``: the compiled modules built in place for this Python
   (``setup.py build_ext --inplace``): ``.so`` files built elsewhere are for another
   Python and are not carried.
6. ``compiled``: which compiled modules load, and from where: the benchmark measures
   NumPy's fallback where one does not.
7. ``gpu_bench``: ``bench/bench_gpu.py`` on W3 (shortened): host-to-device bandwidth
   against the link (blobpipe's path at least 70% of it) and against a plain pinned
   copy, loader throughput, starvation.
8. ``workers``: ``bench/bench_workers.py``: W3 and W4 on the host, 1, 2, 4, 8 and 16
   workers (about 20 s): the many-core figures.
9. ``gpu_tests``: every ``gpu``-marked test (``BLOBPIPE_REQUIRE_GPU=1``: a skip for
   want of a GPU is a failure), each under its own timeout; after a test that hangs
   the run goes on with the tests after it.

Time: every step runs under the smaller of its cap and what the budget has left
(``--budget``, counted from the start of ``gpu_check.sh``), in a process group killed
at its limit; a test runs under pytest-timeout's thread method (which ends a process
whose main thread is stuck in a CUDA call), inside its step's limit. Without a GPU
the run stops after the preflight, in well under a second.

Usage: ``python scripts/gpu_check.py --out DIR [--started EPOCH] [--budget 285]
[--steps a,b] [--no-gpu-ok]`` (the last two for tests of the check itself).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")  # where carried wheels are installed

# module: (distribution as pip names it, lowest version blobpipe and its tests admit)
MODULES = {
    "numpy": ("numpy", "1.24"),
    "google.protobuf": ("protobuf", "4.21.1"),
    "anyio": ("anyio", "4.11"),
    "lmdb": ("lmdb", "1.4"),
    "cv2": ("opencv-python-headless", "4.8"),
    "cupy": ("cupy-cuda12x or cupy-cuda13x", "13"),
    "pytest": ("pytest", "8"),
    "pytest_timeout": ("pytest-timeout", "2.3"),
    "pytest_asyncio": ("pytest-asyncio", "0.23"),
    "hypothesis": ("hypothesis", "6.100"),
    "trio": ("trio", "0.25"),
    "setuptools": ("setuptools", "61"),
}
# the distributions a module may come from (for its version, without importing it)
DISTS = {
    "cupy": ["cupy-cuda12x", "cupy-cuda13x", "cupy"],
    "cv2": ["opencv-python-headless", "opencv-python", "opencv-contrib-python"],
    "google.protobuf": ["protobuf"],
    "pytest_asyncio": ["pytest-asyncio"],
    "pytest_timeout": ["pytest-timeout"],
}
BLOBPIPE = ("numpy", "google.protobuf", "anyio", "lmdb")  # what ``import blobpipe`` imports
TESTS = (*BLOBPIPE, "cv2", "pytest", "pytest_timeout")  # tests/_helpers.py and the runner
# installed where present, or the cases and modules that need them are left out
TESTS_OPTIONAL = ("trio", "pytest_asyncio", "hypothesis")

# the device-path rules' tests that run first, each finding in its own process
PROBES = {
    "1 reuse after the consumer's stream": [
        "tests/test_streams.py::test_a_closed_blobs_device_block_waits_for_the_consumers_stream",
        "tests/test_streams.py::test_a_batch_let_go_off_its_named_stream_is_not_reused_early",
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
    "7 per-thread default streams let go in another thread": [
        "tests/test_device_rules.py::"
        "test_a_per_thread_default_stream_named_here_is_waited_for_when_let_go_elsewhere",
    ],
    "8 no stream 0 reaches CuPy": [
        "tests/test_device_rules.py::test_a_cuda_export_to_a_stream_0_consumer_warns_nothing",
    ],
}
PROBE_TEST_S = 20  # a probe's test hangs past this
GPU_TEST_S = 30  # a gpu test hangs past this
BLOCKING_CPU_FRACTION = 0.10  # a blocking-sync wait's CPU time, at most, of its wall time
LINK_FRACTION = 0.70  # blobpipe's host-to-device bandwidth, at least, of the link's
# GB/s per lane and direction, after line coding, by PCIe generation
LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.split(r"[.+]", v)[:3] if p.isdigit())


def module_version(module: str) -> str | None:
    """The installed version of ``module`` ("?" when not known), None when it is not
    importable; looked up, not imported."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    for name in DISTS.get(module, [module]):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """What of ``modules`` is not installed, or older than blobpipe admits."""
    missing = []
    for module in modules:
        dist, low = MODULES.get(module, (module, "0"))
        version = module_version(module)
        if version is None:
            missing.append(f"{dist} >= {low} (not installed)")
        elif version != "?" and _version_key(version) < _version_key(low):
            missing.append(f"{dist} >= {low} (found {version})")
    return missing


# the process groups of the steps' processes running now: killed with this process
_GROUPS: set[int] = set()


def _end_on_sigterm(signum: int, frame: object) -> None:
    """``timeout`` in gpu_check.sh ends this process: its steps' processes (each in a
    session of its own) end with it."""
    for group in list(_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(124)


def has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


@dataclass
class Step:
    """One step: ``run(run, record, limit)`` fills ``record`` (its part of the summary)."""

    name: str
    cap: float  # seconds, at most
    run: Callable[[Run, dict[str, Any], float], None]
    needs: tuple[str, ...] = ()  # modules
    gpu: bool = False
    tools: tuple[str, ...] = ()  # executables, any one of which will do


@dataclass
class Outcome:
    """How a process ended."""

    status: str  # "passed", "failed", "timed out after N s"
    exit_status: int | None
    wall_s: float


@dataclass
class Run:
    """The summary, written after every step and every test."""

    out: Path
    deadline: float
    no_gpu_ok: bool = False
    summary: dict[str, Any] = field(default_factory=lambda: {"passed": False, "steps": {}})

    def left(self) -> float:
        return self.deadline - time.time() - 1.0  # a second for the last summary

    def write(self) -> None:
        steps = self.summary["steps"]
        self.summary["passed"] = bool(steps) and all(s.get("passed") for s in steps.values())
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of the steps' processes: this checkout (and the installed
        wheels) importable, output unbuffered."""
        paths = [str(ROOT)]
        if self.summary.get("site"):
            paths.append(str(SITE))
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def process(
        self,
        cmd: list[str],
        limit: float,
        log: str,
        env: dict[str, str] | None = None,
        poll: Callable[[], bool] | None = None,
    ) -> Outcome:
        """Run ``cmd`` (output to ``log`` in the output folder) for at most ``limit``
        seconds, its whole process group killed then, or earlier when ``poll`` (called
        about twice a second meanwhile) returns True."""
        t0 = time.time()
        with (self.out / log).open("a") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env or self.env(),
                start_new_session=True,
            )
            _GROUPS.add(proc.pid)
            while proc.poll() is None and time.time() - t0 < limit:
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
                if poll is not None and poll():
                    break
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                _GROUPS.discard(proc.pid)
                return Outcome(f"timed out after {limit:.0f} s", None, round(time.time() - t0, 1))
        _GROUPS.discard(proc.pid)
        code = proc.returncode
        return Outcome("passed" if code == 0 else "failed", code, round(time.time() - t0, 1))

    def step(self, step: Step) -> dict[str, Any]:
        """Run ``step`` if its needs are met and the budget allows; record it."""
        record: dict[str, Any] = {"passed": False}
        self.summary["steps"][step.name] = record
        unmet = missing_modules(step.needs)
        if step.gpu and not has_gpu() and not self.no_gpu_ok:
            unmet.insert(0, "an NVIDIA GPU")
        if step.tools and not any(shutil.which(t) for t in step.tools):
            unmet.append(" or ".join(step.tools))
        limit = min(step.cap, self.left())
        if unmet:
            record.update(status="not run: needs " + ", ".join(unmet), needs=unmet)
        elif limit < 3:
            record.update(status="not run: the budget is spent")
        else:
            record["limit_s"] = round(limit, 1)
            t0 = time.time()
            try:
                step.run(self, record, limit)
            except Exception as exc:  # a bug in the step's own code: the others still run
                record.update(passed=False, status=f"error in the check: {exc!r}")
            record["wall_s"] = round(time.time() - t0, 1)
        self.write()
        return record


# -- tests, one process at a time, resumed after a hang ----------------------------------------


def pytest_cmd(*args: str, per_test: float) -> list[str]:
    """pytest for a check step: none of the project's addopts, each test under its own
    timeout (the thread method: it ends a process stuck in a CUDA call), one JSON line
    per test (``_pytest_progress``), an unknown ini option (pytest-asyncio's, where it
    is missing) no error."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "-p",
        "_pytest_progress",
        "-o",
        "addopts=",
        "-o",
        f"timeout={per_test:g}",
        "-o",
        "timeout_method=thread",
        "-W",
        "ignore::pytest.PytestConfigWarning",
        "--continue-on-collection-errors",
        *args,
    ]


def run_tests(
    run: Run, record: dict[str, Any], args: list[str], limit: float, per_test: float, log: str
) -> None:
    """Run the tests ``args`` selects, each under ``per_test`` seconds, for at most
    ``limit`` seconds in all, into ``record["tests"]`` (test id: outcome), written as
    they come. A process that ends in a test (its timeout, or the limit) leaves that
    test recorded as hung; the run goes on without the tests already done."""
    deadline = time.time() + limit
    tests: dict[str, str] = record.setdefault("tests", {})
    reasons: dict[str, str] = record.setdefault("reasons", {})
    errors: list[str] = record.setdefault("collection_errors", [])
    opts: list[str] = []
    if missing_modules(("trio",)):
        opts += ["-k", "not trio"]
        record["note"] = "trio is not installed: its cases are left out"
    if missing_modules(("pytest_asyncio",)):
        opts += ["-p", "no:asyncio"]
    progress = run.out / f"{log}.jsonl"
    progress.unlink(missing_ok=True)
    seen = 0
    in_flight: list[str | None] = [None]
    since = [0.0]  # when the test in flight was seen to start

    def ingest() -> bool:
        """Take in the new lines; True once the test in flight has outlived its own
        timeout by 10 s (a hang that holds the GIL, which the thread method cannot end)."""
        nonlocal seen
        if not progress.exists():
            return False
        lines = progress.read_text(encoding="utf-8").splitlines()
        new = False
        for line in lines[seen:]:
            if not line.endswith("}"):
                break  # a line still being written
            seen += 1
            event = json.loads(line)
            if event["event"] == "start":
                in_flight[0] = event["test"]
                since[0] = time.time()
            elif event["event"] == "finish":
                in_flight[0] = None
            elif event["event"] == "end":
                tests[event["test"]] = event["outcome"]
                if "reason" in event:
                    reasons[event["test"]] = event["reason"]
                new = True
            elif event["event"] == "collect_error" and event["node"] not in errors:
                errors.append(event["node"])
                reasons[event["node"]] = event.get("reason", "")
                new = True
        if new:
            count(record)
            run.write()
        return in_flight[0] is not None and time.time() - since[0] > per_test + 10

    env = run.env(BLOBPIPE_PROGRESS=str(progress), BLOBPIPE_REQUIRE_GPU="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), env["PYTHONPATH"]])
    while True:
        left = deadline - time.time()
        if left < 3:
            record["status"] = "cut by its time limit"
            break
        deselect = [a for t in tests for a in ("--deselect", t)]
        outcome = run.process(
            pytest_cmd(*opts, *deselect, *args, per_test=per_test), left, log, env, ingest
        )
        ingest()
        hung = in_flight[0]
        in_flight[0] = None
        if hung is not None:  # its timeout ended the process, or the limit did
            after = f" (after it {tests[hung]})" if hung in tests else ""
            tests[hung] = f"hung: ended after {per_test:g} s{after}"
            count(record)
            run.write()
            continue
        record["exit_status"] = outcome.exit_status
        if outcome.exit_status not in (0, 1, 5):  # 5: nothing selected (all done)
            record["status"] = f"pytest {outcome.status} (exit status {outcome.exit_status})"
        break
    count(record)
    outcomes = set(tests.values())
    # a skip for want of a GPU fails (BLOBPIPE_REQUIRE_GPU); others (an optional
    # package) are listed with their reasons
    record["passed"] = (
        "passed" in outcomes
        and outcomes <= {"passed", "xfailed", "skipped"}
        and not errors
        and "status" not in record
    )
    record.setdefault("status", "passed" if record["passed"] else "failed")


def count(record: dict[str, Any]) -> None:
    tests = record.get("tests", {})
    counts: dict[str, int] = {}
    for outcome in tests.values():
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    record["counts"] = counts
    record["not_passed"] = [t for t, o in tests.items() if o not in ("passed", "xfailed")][:60]


# -- the steps --------------------------------------------------------------------------------


WHEELS = ROOT / ".whl"  # carried wheels (scripts/fetch_gpu_wheels.sh)


def wanted_wheels(wheels: list[Path]) -> list[Path]:
    """The wheels of packages this machine lacks, or (blobpipe's own requirements)
    has older than blobpipe admits: installing no other shadows nothing the image has
    (its protobuf, say, which torch uses too)."""
    wanted = []
    for wheel in wheels:
        dist = wheel.name.split("-")[0].lower().replace("_", "-")
        known = [m for m, (d, _) in MODULES.items() if d == dist]
        if known:
            needed = bool(missing_modules((known[0],)))
        else:  # a dependency of one (trio's outcome and sniffio)
            needed = module_version(dist.replace("-", "_")) is None
        if needed:
            wanted.append(wheel)
    return wanted


def wheels_step(run: Run, record: dict[str, Any], limit: float) -> None:
    """Install the carried wheels of the packages this machine lacks or has too old."""
    wheels = sorted(WHEELS.glob("*.whl"))
    wanted = wanted_wheels(wheels)
    record["carried"] = [w.name for w in wheels]
    record["installed"] = [w.name for w in wanted]
    if not wanted:
        record.update(passed=True, status="nothing to install" if wheels else "no .whl/ here")
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE)]
    outcome = run.process([*cmd, *map(str, wanted)], limit, "wheels.txt")
    record.update(passed=outcome.status == "passed", status=outcome.status)
    if outcome.status == "passed":
        run.summary["site"] = str(SITE)
        sys.path.insert(0, str(SITE))  # as PYTHONPATH puts it, for the steps' own checks
        importlib.invalidate_caches()


def _smi(fields: str) -> list[str] | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return [v.strip() for v in done.stdout.splitlines()[0].split(",")]


def _int(value: str | None) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def link_step(run: Run, record: dict[str, Any], limit: float) -> None:
    """The GPU, its PCIe link and NUMA node, and the link's bandwidth per direction."""
    names = "name,memory.total,driver_version,pci.bus_id"
    gpu = _smi(names)
    link = _smi(
        "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    )
    hostmax = _smi("pcie.link.gen.hostmax")  # newer drivers: the host side's top generation
    if gpu is not None:
        record["gpu"] = dict(zip(names.split(","), gpu, strict=False))
    if link is not None:
        gen, gen_max, width, width_max = (_int(v) for v in link)
        record.update(gen=gen, gen_max=gen_max, width=width, width_max=width_max)
        if hostmax is not None:
            record["gen_hostmax"] = _int(hostmax[0])
        # an idle link trains down: its top generation (within the host's) and width
        gens = [g for g in (gen_max, record.get("gen_hostmax")) if g]
        top = min(gens) if gens else None
        if top in LANE_GBPS and width_max:
            record["link_gbps"] = round(LANE_GBPS[top] * width_max, 2)
    if gpu is not None:
        bus = gpu[3].lower()
        bus = bus[4:] if bus.count(":") == 2 and len(bus.split(":")[0]) == 8 else bus
        numa = Path("/sys/bus/pci/devices") / bus / "numa_node"
        try:
            record["numa_node"] = int(numa.read_text().strip())
            cpus = numa.with_name("local_cpulist")
            record["local_cpus"] = cpus.read_text().strip()
        except (OSError, ValueError):
            record["numa_node"] = None
    run.summary["link_gbps"] = record.get("link_gbps")
    record["passed"] = "link_gbps" in record
    record["status"] = "passed" if record["passed"] else "link not read (nvidia-smi)"


def probes_step(run: Run, record: dict[str, Any], limit: float) -> None:
    deadline = time.time() + limit
    findings: dict[str, Any] = {}
    record["findings"] = findings
    for k, (finding, ids) in enumerate(PROBES.items(), 1):
        one: dict[str, Any] = {"log": f"probe-{k}.txt"}
        findings[finding] = one
        left = min(deadline - time.time(), 2 * PROBE_TEST_S + 10)
        if left < 3:
            one.update(passed=False, status="not run: the step's time is spent")
            continue
        run_tests(run, one, ["-m", "gpu", *ids], left, PROBE_TEST_S, one["log"])
    record["passed"] = all(f.get("passed") for f in findings.values())
    record["status"] = "passed" if record["passed"] else "failed"


def blocking_step(run: Run, record: dict[str, Any], limit: float) -> None:
    log = "blocking.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--blocking-probe"]
    outcome = run.process(cmd, limit, log)
    record.update(status=outcome.status, exit_status=outcome.exit_status)
    try:
        figures = json.loads((run.out / log).read_text().strip().splitlines()[-1])
    except (ValueError, IndexError, OSError):
        record["passed"] = False
        return
    record["figures"] = figures
    worst = max(f["cpu_s"] / max(f["wall_s"], 1e-9) for f in figures["blocking"])
    record["target"] = {
        "target": f"a blocking-sync wait costs < {BLOCKING_CPU_FRACTION:.0%} of its wall time "
        "in CPU",
        "measured": round(worst, 4),
        "passed": worst < BLOCKING_CPU_FRACTION,
    }
    record["passed"] = outcome.status == "passed" and record["target"]["passed"]


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
    figures: dict[str, list[dict[str, float]]] = {}
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


def build_step(run: Run, record: dict[str, Any], limit: float) -> None:
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    outcome = run.process(cmd, limit, "build.txt")
    record.update(passed=outcome.status == "passed", status=outcome.status)


#: the compiled modules, each optional (NumPy or OpenCV does the same work where one is missing)
COMPILED = ("blobpipe._io._rowkernel", "blobpipe._io._jpegwindow", "blobpipe._io._pngrows")


def compiled_modules(names: tuple[str, ...] = COMPILED) -> dict[str, Any]:
    """Which of ``names`` import here, and from where (the error where one does not)."""
    import importlib
    import sysconfig

    found: dict[str, Any] = {"ext_suffix": sysconfig.get_config_var("EXT_SUFFIX")}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            found[name] = {"loaded": False, "error": str(exc)[:200]}
        else:
            found[name] = {"loaded": True, "path": getattr(module, "__file__", None)}
    return found


def compiled_step(
    names: tuple[str, ...] = COMPILED,
) -> Callable[[Run, dict[str, Any], float], None]:
    """The step that records which of ``names`` load, in a fresh process of this Python."""

    def step(run: Run, record: dict[str, Any], limit: float) -> None:
        code = (
            "import json, sys; sys.path.insert(0, 'scripts'); import gpu_check; "
            f"print(json.dumps(gpu_check.compiled_modules({tuple(names)!r})))"
        )
        outcome = run.process([sys.executable, "-c", code], limit, "compiled.txt")
        try:
            found = json.loads((run.out / "compiled.txt").read_text().strip().splitlines()[-1])
        except (ValueError, IndexError, OSError):
            record.update(passed=False, status=outcome.status)
            return
        record["modules"] = found
        missing = [n for n in names if not found.get(n, {}).get("loaded")]
        run.summary["compiled"] = {n: found.get(n, {}).get("loaded", False) for n in names}
        record["passed"] = outcome.status == "passed" and not missing
        record["status"] = "passed" if record["passed"] else "not loaded: " + ", ".join(missing)

    return step


def bench_step(run: Run, record: dict[str, Any], limit: float) -> None:
    out = run.out / "bench-gpu.json"
    cmd = [sys.executable, "bench/bench_gpu.py", "--steps", "200", "--seconds", "1"]
    cmd += ["--json", str(out)]
    if run.summary.get("link_gbps"):
        cmd += ["--link-gbps", str(run.summary["link_gbps"])]
    outcome = run.process(cmd, limit, "bench-gpu.txt")
    record.update(passed=outcome.status == "passed", status=outcome.status)
    if out.exists():
        results = json.loads(out.read_text())
        record["targets"] = results.get("targets")
        record["results"] = results
    record["compiled"] = run.summary.get("compiled", "not known (the compiled step did not run)")


def workers_step(run: Run, record: dict[str, Any], limit: float) -> None:
    out = run.out / "workers.json"
    cmd = [sys.executable, "bench/bench_workers.py", "--workers", "1,2,4,8,16"]
    cmd += ["--seconds", "1", "--json", str(out)]
    outcome = run.process(cmd, limit, "workers.txt")
    record.update(passed=outcome.status == "passed", status=outcome.status)
    if out.exists():
        record["results"] = json.loads(out.read_text())


def gpu_tests_step(run: Run, record: dict[str, Any], limit: float) -> None:
    run_tests(run, record, ["-m", "gpu", "tests"], limit, GPU_TEST_S, "gpu-tests.txt")
    torn = [o for n, o in record.get("tests", {}).items() if "no_torn_batch" in n]
    record["torn_batch_target"] = {
        "target": "a torch consumer on its own side stream sees no torn batch over 1,000 batches",
        "measured": torn[0] if torn else "not run",
        "passed": torn == ["passed"],
    }


def plan() -> list[Step]:
    """The steps, in order (the module docstring says what each does)."""
    bench = (*BLOBPIPE, "cupy")
    return [
        Step("wheels", 15, wheels_step),
        Step("link", 10, link_step, gpu=True, tools=("nvidia-smi",)),
        Step("probes", 90, probes_step, needs=(*TESTS, "cupy"), gpu=True),
        Step("blocking_sync", 15, blocking_step, needs=("cupy",), gpu=True),
        Step("build", 45, build_step, needs=("setuptools",), tools=("cc", "gcc")),
        Step("compiled", 10, compiled_step(), needs=BLOBPIPE),
        Step("gpu_bench", 60, bench_step, needs=bench, gpu=True),
        Step("workers", 40, workers_step, needs=(*BLOBPIPE, "cv2")),
        Step("gpu_tests", 120, gpu_tests_step, needs=(*TESTS, "cupy"), gpu=True),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--started", type=float, default=None, help="epoch seconds of the start")
    ap.add_argument("--budget", type=float, default=285.0, help="seconds for everything")
    ap.add_argument("--steps", default=None, help="only these steps (comma-separated)")
    ap.add_argument("--no-gpu-ok", action="store_true", help="run the steps without a GPU")
    ap.add_argument("--blocking-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.blocking_probe:
        return blocking_probe()
    if args.out is None:
        ap.error("--out is required")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    run = Run(out, (args.started or time.time()) + args.budget, no_gpu_ok=args.no_gpu_ok)
    run.summary["budget_s"] = args.budget
    steps = plan()
    if args.steps:
        chosen = args.steps.split(",")
        steps = [s for s in steps if s.name in chosen]

    found = {"python": sys.version.split()[0]}
    for module in MODULES:
        found[module] = module_version(module) or "not installed"
    gpu = has_gpu()
    run.summary.update(found=found, gpu=gpu)
    run.summary["steps"]["preflight"] = {
        "passed": gpu or args.no_gpu_ok,
        "status": "a GPU" if gpu else "no GPU",
    }
    run.write()
    print("found:", ", ".join(f"{k} {v}" for k, v in found.items()))
    if not gpu and not args.no_gpu_ok:
        for step in steps:
            run.summary["steps"][step.name] = {"passed": False, "status": "not run: no GPU"}
        needs = sorted({m for s in steps for m in missing_modules(s.needs)})
        run.summary["missing"] = ["an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi)", *needs]
        run.write()
        print(
            f"gpu_check: no GPU (no /dev/nvidia0, no nvidia-smi); see {out / 'summary.json'}",
            file=sys.stderr,
        )
        return 1
    for step in steps:
        record = run.step(step)
        print(f"{step.name}: {record.get('status')}", flush=True)
    missing = sorted({m for s in run.summary["steps"].values() for m in s.get("needs", [])})
    run.summary["missing"] = missing
    run.write()
    print(f"summary: {out / 'summary.json'} (passed: {run.summary['passed']})")
    return 0 if run.summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
