"""scripts/gpu_check.sh and scripts/gpu_check.py without a GPU: the fast failure,
and the budget that bounds a run on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() and importlib.util.find_spec("cupy") is not None


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
@pytest.mark.skipif(_has_gpu(), reason="a GPU machine takes the long path")
def test_without_a_gpu_it_stops_at_once_naming_what_is_missing(tmp_path: Path) -> None:
    """Exit 1 after the preflight alone (0.1 s here, unloaded), with a summary
    naming the GPU and the packages that are missing; nothing is imported."""
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
    assert list(summary["steps"]) == ["preflight"]  # nothing after it ran
    assert "no GPU" in done.stderr
    assert wall < 10, wall  # generous for a loaded machine: the run itself takes ~0.1 s


def test_a_step_past_the_budget_is_cut_and_recorded(tmp_path: Path) -> None:
    """Every step runs under the time the budget has left; one cut short is
    recorded as timed out, and the summary is on disk after each step."""
    gc = _gpu_check()
    run = gc.Run(tmp_path, started=time.time(), budget=7.0)
    quick = run.step("quick", [sys.executable, "-c", "print('hi')"], 60, "quick.txt")
    assert quick["passed"] and (tmp_path / "quick.txt").read_text() == "hi\n"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"]["quick"]["passed"]
    slow = run.step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 60, "slow.txt")
    assert slow["status"].startswith("timed out") and slow["limit_s"] <= 6
    late = run.step("late", [sys.executable, "-c", "pass"], 60, "late.txt")
    assert late["status"] == "not run: the budget is spent"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and list(summary["steps"]) == ["quick", "slow", "late"]


def test_the_preflight_imports_nothing_heavy() -> None:
    """The preflight looks packages up without importing them: that is what keeps the
    failure without a GPU at a fraction of a second (no NumPy, CuPy, torch, OpenCV)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPTS / 'gpu_check.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.preflight()\n"
        "print(sorted(n for n in ('numpy', 'cupy', 'torch', 'cv2', 'lmdb') if n in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=25, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
