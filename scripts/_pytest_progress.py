"""A pytest plugin for ``scripts/gpu_check.py``: one JSON line per test, written and
flushed as it happens, to the file ``BLOBPIPE_PROGRESS`` names.

A line ``{"event": "start", "test": id}`` when a test starts, ``{"event": "end",
"test": id, "outcome": ...}`` when its outcome is known (``passed``, ``failed``,
``skipped``, ``xfailed``, ``error``) and ``{"event": "finish", "test": id}`` after its
teardown, so a process killed in a test (a hang that its
timeout ends with ``os._exit``, or the check's own kill) leaves the outcome of every
test before it and the name of the one it was in. Collection errors are
``{"event": "collect_error", "node": id, "reason": ...}``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_PATH = os.environ.get("BLOBPIPE_PROGRESS", "")


def _emit(**record: Any) -> None:
    if not _PATH:
        return
    with open(_PATH, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[-1])[:300]
    lines = str(longrepr or "").strip().splitlines()
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _emit(event="start", test=nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _emit(event="finish", test=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        if report.when == "teardown" and report.outcome != "failed":
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "failed"  # a strict xpass fails
        elif report.failed and report.when != "call":
            outcome = "error"
        else:
            outcome = report.outcome
        record: dict[str, Any] = {
            "event": "end",
            "test": report.nodeid,
            "outcome": outcome,
            "seconds": round(report.duration, 3),
        }
        if outcome != "passed":
            record["reason"] = _reason(report)
        _emit(**record)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit(event="collect_error", node=report.nodeid, reason=_reason(report))
