"""Caffe's Blob, as the "Blobs, Layers, and Nets" tutorial describes it.

Runs on a CUDA GPU when CuPy sees one, else on the emulated device (device
memory that is separate host memory), so every step behaves as on a GPU:

1. the tutorial's nine accessor calls, printed with the data's head and the
   copies each one made, checked against the tutorial's comments;
2. reshape within the capacity (no allocation) and beyond it;
3. ``update()``: data -= diff, computed on the side that holds the head.

Usage: python examples/blob_basics.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from blobpipe import Backend, BackendUnavailableError, Blob, get_backend, get_pool
from blobpipe.testing import EmulatedBackend


def device_backend() -> Backend:
    try:
        return get_backend("cuda")
    except BackendUnavailableError:
        return EmulatedBackend()


# (accessor, copy the tutorial says it makes: "h2d", "d2h" or None, its comment)
TUTORIAL = [
    ("gpu_data", "h2d", "data copied cpu->gpu"),
    ("cpu_data", None, "no data copied since both have up-to-date contents"),
    ("mutable_gpu_data", None, "no data copied"),
    ("mutable_gpu_data", None, "no data copied when we are still on GPU"),
    ("cpu_data", "d2h", "data copied gpu->cpu, since the gpu side has modified the data"),
    ("gpu_data", None, "no data copied since both have up-to-date contents"),
    ("mutable_cpu_data", None, "still no data copied"),
    ("mutable_gpu_data", "h2d", "data copied cpu->gpu"),
    ("mutable_cpu_data", "d2h", "data copied gpu->cpu"),
]


def nine_steps(backend: Backend) -> bool:
    print("1. The tutorial's nine steps (data starts on the CPU)")
    ok = True
    with Blob((2, 3, 4, 5), backend=backend) as blob:
        blob.mutable_cpu_data()[...] = 1.0  # "Assuming that data are on the CPU initially"
        print(f"   start: head {blob.data.head.name}")
        print(f"   {'#':>2}  {'call':<20} {'head':<12} {'h2d':>4} {'d2h':>4}  tutorial")
        for i, (call, expected, comment) in enumerate(TUTORIAL, 1):
            before = backend.statistics()
            getattr(blob, call)()
            after = backend.statistics()
            h2d = after.h2d_copies - before.h2d_copies
            d2h = after.d2h_copies - before.d2h_copies
            made = "h2d" if h2d else "d2h" if d2h else None
            mark = "" if made == expected and h2d + d2h <= 1 else "   <-- differs"
            ok = ok and not mark
            head = blob.data.head.name
            print(f"   {i:>2}  {call + '()':<20} {head:<12} {h2d:>4} {d2h:>4}  {comment}{mark}")
    return ok


def reshape_within_capacity(backend: Backend) -> bool:
    print("\n2. Reshape reallocates only beyond the capacity")
    pool = get_pool(backend, "host")
    with Blob((4, 3, 8, 16), backend=backend) as blob:
        blob.mutable_cpu_data()[...] = np.arange(blob.count()).reshape(blob.shape)
        allocations = pool.statistics().allocations
        mem = blob.data
        print(f"   {blob.shape_string():<18} capacity {blob.capacity}")
        blob.reshape((2, 3, 8, 16))
        same = blob.data is mem
        print(f"   {blob.shape_string():<18} capacity {blob.capacity}  same memory: {same}")
        blob.reshape((4, 3, 8, 16))
        kept = bool(blob.cpu_data().ravel()[-1] == blob.count() - 1)
        print(f"   {blob.shape_string():<18} capacity {blob.capacity}  bytes kept: {kept}")
        grew = allocations == pool.statistics().allocations
        print(f"   pool allocations while reshaping within capacity: "
              f"{pool.statistics().allocations - allocations}")
        blob.reshape((8, 3, 8, 16))
        blob.mutable_cpu_data()
        print(f"   {blob.shape_string():<18} capacity {blob.capacity}  "
              f"new memory: {blob.data is not mem}")
        return same and kept and grew and blob.data is not mem


def update(backend: Backend) -> bool:
    print("\n3. update(): data -= diff, on the side of the data's head")
    ok = True
    with Blob((3,), backend=backend) as blob:
        for side in ("cpu", "gpu"):
            blob.mutable_cpu_data()[...] = [10.0, 20.0, 30.0]
            blob.mutable_cpu_diff()[...] = [1.0, 2.0, 3.0]
            if side == "gpu":
                blob.mutable_gpu_data()
                blob.gpu_diff()
            head = blob.data.head.name
            before = backend.statistics()
            blob.update()
            after = backend.statistics()
            copies = (after.h2d_copies - before.h2d_copies) + (after.d2h_copies - before.d2h_copies)
            head_after = blob.data.head.name
            result = blob.cpu_data().tolist()
            ok = ok and result == [9.0, 18.0, 27.0] and copies == 0
            print(f"   head {head:<12} -> update() made {copies} copies, "
                  f"now {head_after:<12} data {result}")
        print(f"   asum_data {blob.asum_data()}, sumsq_data {blob.sumsq_data()}")
    return ok


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description=(__doc__ or "").strip().splitlines()[0],
        epilog="Run without arguments; it prints each step.",
    ).parse_args([] if argv is None else argv)
    backend = device_backend()
    print(f"backend: {backend!r}\n")
    results = [nine_steps(backend), reshape_within_capacity(backend), update(backend)]
    print("\nall as the tutorial says" if all(results) else "\nSOMETHING DIFFERS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
