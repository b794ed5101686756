"""Check that pip resolves blobpipe next to each supported protobuf major version.

Usage: python scripts/check_protobuf_range.py [REQUIREMENT ...]

For each protobuf pin (the oldest release pyproject.toml admits, then the
newest 5.x, 6.x and 7.x) runs ``pip install --dry-run --ignore-installed`` of this checkout
together with the pin (and any extra REQUIREMENTs, e.g. a pinned framework),
and reads pip's JSON report: the resolution must succeed and pick a protobuf
that satisfies the pin. Installs nothing. Needs PyPI (network); exits 1 when a
pin does not resolve, 2 when pip cannot run at all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent



def pins() -> list[str]:
    """``protobuf==OLDEST`` from pyproject's dependency, then one range per newer major."""
    match = re.search(r'"protobuf>=([^,"]+),<8"', (ROOT / "pyproject.toml").read_text())
    if match is None:
        raise SystemExit('pyproject.toml has no "protobuf>=X,<8" dependency')
    return [f"protobuf=={match[1]}", "protobuf>=5,<6", "protobuf>=6,<7", "protobuf>=7,<8"]


def resolve(pin: str, extra: list[str]) -> tuple[bool, str]:
    """(resolved, what): the protobuf pip picks next to blobpipe, or pip's error."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--report",
                str(report),
                str(ROOT),
                pin,
                *extra,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            errors = [x for x in done.stderr.splitlines() if x.startswith("ERROR")]
            return False, " | ".join(errors[-2:]) or f"pip exited {done.returncode}"
        installs = json.loads(report.read_text())["install"]
    versions = {
        item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs
    }
    if "blobpipe" not in versions:
        return False, "pip's report does not install blobpipe"
    protobuf = versions.get("protobuf")
    if protobuf is None:
        return False, "pip's report installs no protobuf"
    from packaging.requirements import Requirement

    if not Requirement(pin).specifier.contains(protobuf, prereleases=True):
        return False, f"pip picked protobuf {protobuf}, outside {pin}"
    return True, f"protobuf {protobuf}, numpy {versions.get('numpy', '?')}"


def main(argv: list[str]) -> int:
    try:
        import packaging.requirements  # noqa: F401  (pip's own dependency, checked up front)
    except ImportError:
        print("needs the `packaging` module: pip install packaging", file=sys.stderr)
        return 2
    failures = 0
    for pin in pins():
        ok, what = resolve(pin, argv)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {pin:<20} {what}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
