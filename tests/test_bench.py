"""Smoke tests of the benchmark scripts: they run and print their tables (targets not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.timeout(90)
def test_bench_loader_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_loader.py"),
            "--quick",
            "--data-dir",
            str(tmp_path / "data"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = proc.stdout
    assert "| row | img/s (median) | ratio | to | target | result |" in text
    for label in (
        "memcpy ceiling",
        "plain protobuf loop",
        "blobpipe float32, async, workers=2",
        "blobpipe uint8",
        "torch DataLoader recipe, num_workers=0",
        "OpenCV imdecode loop",
        "blobpipe JPEG float32, async, workers=2",
    ):
        assert label in text
    assert "| workers | float32 raw img/s |" in text
    doc = json.loads(out.read_text())
    rows = {row["key"]: row for row in doc["rows"]}
    assert rows["plain"]["median"] > 0
    assert [row["target"] for row in doc["rows"] if row["key"].startswith("bp_f32_w")].count(
        1.5
    ) == 1
    # a second run reuses the cached LMDBs
    again = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_loader.py"),
            "--quick",
            "--no-torch",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "(cached)" in again.stdout
    assert "skipped: --no-torch" in again.stdout
