"""scripts/gpu_check.sh and scripts/gpu_check.py without a GPU: the fast failure, the
budget that bounds a run on a GPU machine, and the failure modes a first GPU run
must survive (a test that hangs, a missing package, a missing compiled module), each
leaving every other step's results in summary.json."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() and importlib.util.find_spec("cupy") is not None


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
@pytest.mark.skipif(_has_gpu(), reason="a GPU machine takes the long path")
def test_without_a_gpu_it_stops_at_once_naming_what_is_missing(tmp_path: Path) -> None:
    """Exit 1 after the preflight alone, every step recorded as not run, the GPU named
    first among what is missing; nothing is imported."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    t0 = time.perf_counter()
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=25,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    assert summary["missing"][0].startswith("an NVIDIA GPU")
    steps = [s.name for s in _gpu_check().plan()]
    assert list(summary["steps"]) == ["preflight", *steps]
    assert all(summary["steps"][s]["status"] == "not run: no GPU" for s in steps)
    assert "no GPU" in done.stderr
    assert wall < 10, wall  # generous for a loaded machine: the run itself takes ~0.1 s


def test_a_step_past_the_budget_is_cut_and_recorded(tmp_path: Path) -> None:
    """Every step runs under the time the budget has left; one cut short is
    recorded as timed out, and the summary is on disk after each step."""
    gc = _gpu_check()
    run = gc.Run(tmp_path, deadline=time.time() + 7.0)

    def command(code: str) -> Any:
        def step(run: Any, record: dict[str, Any], limit: float) -> None:
            outcome = run.process([sys.executable, "-c", code], limit, "out.txt")
            record.update(passed=outcome.status == "passed", status=outcome.status)

        return step

    quick = run.step(gc.Step("quick", 60, command("print('hi')")))
    assert quick["passed"] and (tmp_path / "out.txt").read_text() == "hi\n"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"]["quick"]["passed"]
    slow = run.step(gc.Step("slow", 60, command("import time; time.sleep(30)")))
    assert slow["status"].startswith("timed out") and slow["limit_s"] <= 6
    late = run.step(gc.Step("late", 60, command("pass")))
    assert late["status"] == "not run: the budget is spent"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and list(summary["steps"]) == ["quick", "slow", "late"]


_TESTS = """
import threading

import pytest

pytestmark = pytest.mark.gpu


def test_before():
    pass


def test_hangs():
    threading.Event().wait()  # a thread stuck in a wait, as in cudaEventSynchronize


def test_fails():
    assert 1 == 2


def test_after():
    pass
"""


@pytest.mark.timeout(120)
def test_every_step_is_recorded_whatever_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe's test that hangs (its own timeout ends its process; the tests after
    it, and the next probe in a process of its own, still run), a step whose package
    is missing, a compiled module that is missing: each is recorded, and the steps
    around them run and are recorded too."""
    gc = _gpu_check()
    out = tmp_path / "out"
    out.mkdir()
    probe = tmp_path / "test_probe.py"
    probe.write_text(_TESTS)
    names = ("test_before", "test_hangs", "test_fails")
    monkeypatch.setattr(
        gc,
        "PROBES",
        {"hangs": [f"{probe}::{n}" for n in names], "after": [f"{probe}::test_after"]},
    )
    monkeypatch.setattr(gc, "PROBE_TEST_S", 2)
    run = gc.Run(out, deadline=time.time() + 100)

    def later(run: Any, record: dict[str, Any], limit: float) -> None:
        record.update(passed=True, status="passed")

    plan = [
        gc.Step("probes", 60, gc.probes_step, needs=("pytest", "pytest_timeout")),
        gc.Step("optional", 10, later, needs=("numpy", "no_such_package_for_the_check")),
        gc.Step("compiled", 20, gc.compiled_step(("blobpipe._io._no_such_compiled_module",))),
        gc.Step("later", 10, later),
    ]
    for step in plan:
        run.step(step)
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert list(steps) == ["probes", "optional", "compiled", "later"]
    hangs, after = (steps["probes"]["findings"][f] for f in ("hangs", "after"))
    tests = {name.split("::")[-1]: o for name, o in hangs["tests"].items()}
    assert tests == {
        "test_before": "passed",
        "test_hangs": "hung: ended after 2 s",
        "test_fails": "failed",
    }
    assert [name.split("::")[-1] for name in after["tests"]] == ["test_after"]
    assert after["passed"] and not hangs["passed"] and steps["probes"]["passed"] is False
    assert steps["optional"]["status"] == (
        "not run: needs no_such_package_for_the_check >= 0 (not installed)"
    )
    compiled = steps["compiled"]
    assert compiled["status"] == "not loaded: blobpipe._io._no_such_compiled_module"
    assert compiled["modules"]["blobpipe._io._no_such_compiled_module"]["loaded"] is False
    assert steps["later"]["passed"] is True
    # the progress file holds each test as it came
    events = [json.loads(line) for line in (out / "probe-1.txt.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events[:3]] == ["start", "end", "finish"]


@pytest.mark.timeout(60)
def test_the_compiled_step_records_what_loads(tmp_path: Path) -> None:
    """``gpu_check.py --steps compiled`` on this machine: each compiled module's path
    (or why it did not load), with this Python's extension suffix."""
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "gpu_check.py"),
            *("--out", str(tmp_path), "--steps", "compiled", "--no-gpu-ok"),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    modules = summary["steps"]["compiled"]["modules"]
    assert modules["ext_suffix"].endswith(".so")
    for name in ("blobpipe._io._rowkernel", "blobpipe._io._jpegwindow", "blobpipe._io._pngrows"):
        entry = modules[name]
        assert entry["loaded"] == bool(entry.get("path")), entry
        assert summary["compiled"][name] == entry["loaded"]
    assert done.returncode == (0 if summary["passed"] else 1), done.stderr


@pytest.mark.timeout(60)
def test_the_probes_name_tests_that_exist() -> None:
    """Every probe id selects at least one gpu-marked test (a renamed test would be
    reported as not run on the GPU machine, where no one can fix it)."""
    gc = _gpu_check()
    ids = [i for ids in gc.PROBES.values() for i in ids]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"),
            *("-o", "addopts=", "-m", "gpu", *ids),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for test in ids:
        assert any(c.startswith(test) for c in collected), (test, done.stdout[-2000:])


def test_the_plan_fits_five_minutes() -> None:
    """gpu_check.sh gives gpu_check.py a 285 s budget from its own start and kills it
    at 295 s; inside, every test's timeout is shorter than its step's cap."""
    gc = _gpu_check()
    text = (SCRIPTS / "gpu_check.sh").read_text()
    outer = re.search(r"timeout -k (\d+) (\d+) ", text)
    assert outer is not None and int(outer[1]) + int(outer[2]) <= 300
    assert "--budget 285" in text and int(outer[2]) > 285
    caps = {s.name: s.cap for s in gc.plan()}
    assert caps["probes"] > gc.PROBE_TEST_S and caps["gpu_tests"] > gc.GPU_TEST_S
    assert all(s.needs or s.tools or s.name == "wheels" for s in gc.plan())


def test_the_link_and_its_bandwidth_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PCIe Gen5 x16 (idle at Gen1): 63 GB/s per direction, from the top generation
    and width; the host's top generation caps it where the driver tells it."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            case "$1" in
              *pci.bus_id*) echo "NVIDIA H100 80GB HBM3, 81559, 580.159.04, 00000000:19:00.0";;
              *hostmax*) echo "4";;
              *pcie.link*) echo "1, 5, 16, 16";;
            esac
            """
        )
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gc = _gpu_check()
    run = gc.Run(tmp_path, deadline=time.time() + 30, no_gpu_ok=True)
    record = run.step(gc.Step("link", 10, gc.link_step, tools=("nvidia-smi",)))
    assert (record["gen"], record["gen_max"], record["width_max"]) == (1, 5, 16)
    assert record["gen_hostmax"] == 4 and record["link_gbps"] == pytest.approx(31.5, abs=0.1)
    assert record["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    assert "numa_node" in record and record["passed"]
    assert run.summary["link_gbps"] == record["link_gbps"]


def test_only_the_wheels_of_what_is_missing_are_installed(tmp_path: Path) -> None:
    """A carried wheel is installed only where its package is missing (or, one of
    blobpipe's own requirements, too old): nothing of the image is shadowed."""
    gc = _gpu_check()
    names = [
        "numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl",  # installed: kept
        "pytest_timeout-2.4.0-py3-none-any.whl",  # installed: kept
        "no_such_dist_for_the_check-1.0-py3-none-any.whl",  # missing: installed
    ]
    wheels = [tmp_path / n for n in names]
    assert gc.wanted_wheels(wheels) == [wheels[2]]


def test_the_preflight_imports_nothing_heavy() -> None:
    """The requirement checks look packages up without importing them: that is what
    keeps the failure without a GPU at a fraction of a second."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPTS / 'gpu_check.py')!r})\n"
        "m = sys.modules['g'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "[m.missing_modules(s.needs) for s in m.plan()]\n"
        "print(sorted(n for n in ('numpy', 'cupy', 'torch', 'cv2', 'lmdb') if n in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=25, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_the_steps_processes_end_with_the_check(tmp_path: Path) -> None:
    """``timeout`` ending gpu_check.py (SIGTERM) ends the step's process too, though it
    runs in a session of its own."""
    code = textwrap.dedent(
        f"""\
        import sys, time
        sys.path.insert(0, {str(SCRIPTS)!r})
        import gpu_check as gc
        import signal
        signal.signal(signal.SIGTERM, gc._end_on_sigterm)
        run = gc.Run(gc.Path({str(tmp_path)!r}), deadline=time.time() + 60)
        run.process([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True);"
                     " time.sleep(60)"], 50, "child.txt")
        """
    )
    check = subprocess.Popen([sys.executable, "-c", code])
    child = tmp_path / "child.txt"
    for _ in range(100):
        if child.exists() and child.read_text().strip():
            break
        time.sleep(0.1)
    pid = int(child.read_text().split()[0])
    check.terminate()
    assert check.wait(timeout=20) == 124
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
