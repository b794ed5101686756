"""Regenerate blobpipe/_proto/caffe_pb2.py (and .pyi) from proto/caffe.proto.

Usage: python scripts/gen_proto.py [OUTDIR]

Needs grpcio-tools (in the ``dev`` extra). tests/test_proto.py runs this into a
temporary folder and compares, so the checked-in module cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(outdir: Path) -> None:
    from grpc_tools import protoc

    outdir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={outdir}",
            f"--pyi_out={outdir}",
            str(ROOT / "proto" / "caffe.proto"),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "blobpipe" / "_proto")
