#!/usr/bin/env bash
# Download (here, with network) the wheels the GPU machine's image lacks, for its
# Python (PYVER, default 3.12: the GPU image's) on x86_64, into .whl/ (git-ignored);
# scripts/gpu_check.sh installs them. Usage: PYVER=3.11 bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# The versions this project is developed and tested with. The GPU machine's
# image has numpy, CuPy, torch, OpenCV, anyio, protobuf, pytest, pytest-timeout and
# hypothesis, but no lmdb, trio or pytest-asyncio; anyio and protobuf travel too, in case
# the image's are older than pyproject.toml admits (trio's other dependencies, attrs, idna
# and sortedcontainers, the image has). gpu_check.py installs only the wheels of what the
# machine lacks or has too old, and names what is still missing. Carry .whl/ (git-ignored)
# to the machine with the checkout.
for spec in "lmdb==3.0.0" "trio==0.35.0" "outcome==1.3.0.post0" "sniffio==1.3.1" \
            "protobuf==7.36.2" "anyio==4.16.0" "pytest-asyncio==1.5.0" "pytest-timeout==2.4.0" \
            "typing_extensions==4.16.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$spec"
done
ls -la .whl
