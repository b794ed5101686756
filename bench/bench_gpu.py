"""The loader on a real GPU: host→device bandwidth, loader throughput, training-step starvation.

Run: ``python bench/bench_gpu.py [--allow-skip] [--quick] [--steps 300] [--workers N]
[--json OUT]`` (``scripts/gpu_check.sh`` runs it on a machine with a GPU).

All on W3 of the workload benchmark (``_workloads_data.imagenet_raw``: 2,048 raw
3×256×256 Datums, a mean file; TRAIN, shuffle, crop 227, mirror, batch 64). Parts:

1. **Bandwidth**: host→device ``cudaMemcpyAsync`` on one non-blocking stream, timed
   with CUDA events, from pinned memory (``cupyx.empty_pinned``) and from pageable
   memory, at the size of W3's uint8 batch after the host crop, of its float32
   batch and of 64 MiB; and the same bytes through blobpipe's own path (a Blob's
   pinned pool memory, ``backend.copy_to_device`` on a blobpipe stream, which also
   orders each copy after the caller's stream). Targets: blobpipe's path ≥ 90% of
   the plain pinned copy, at every size; and, given the PCIe link's bandwidth per
   direction (``--link-gbps``, which ``scripts/gpu_check.py`` reads off
   ``nvidia-smi``), ≥ 70% of the link, at every size.
2. **Loader throughput**: ``blobpipe.Loader(..., device="cuda")`` on W3, consumed
   as fast as possible (``batch.data.gpu_data()``), with the device transform
   (uint8 crosses the bus) and without it (float32 crosses).
3. **Training step**: every batch feeds a fixed 5 ms of GPU work (a one-thread
   ``clock64`` spin kernel calibrated with CUDA events) on the consumer's own
   stream, synchronised each step like a training loop reading its loss; the
   consumer asks for each batch with that stream current, so the loader orders
   the slot's reuse after the step (the release is recorded on the stream the
   consumer works on). Run once on a synthetic batch already on the device and
   once fed by the loader;
   starvation = the loader's ``statistics().wait_time`` over the run's wall time.
   Target: < 2%.

(The third GPU target, a torch consumer on a side stream seeing no torn batch over
1,000 batches, is the ``gpu`` test
``test_torch_consumer_on_a_side_stream_sees_no_torn_batch`` in ``tests/test_streams.py``.)

Exit status: 0 when every target is met, 1 when one is missed (or, without CuPy or
a GPU, after printing ``skipped: no GPU (...)``; 0 then with ``--allow-skip``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _workloads_data import Prepared, imagenet_raw, prepare

import blobpipe

BATCH = 64
STEP_MS = 5.0
STARVATION_TARGET = 0.02
POOL_BANDWIDTH_TARGET = 0.90  # blobpipe's pinned pool path against a plain pinned copy
LINK_TARGET = 0.70  # blobpipe's pinned pool path against the PCIe link's bandwidth

_SPIN = r"""
extern "C" __global__ void spin(const float* x, long long cycles, float* sink) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (x[0] == -12345.0f) { sink[0] = x[0]; }  // reads the batch; never true here
}
"""


def find_gpu() -> tuple[Any, str]:
    """CuPy and the GPU's name; raises RuntimeError saying what is missing."""
    try:
        import cupy as cp
    except ImportError as exc:
        raise RuntimeError(f"CuPy is not installed ({exc})") from exc
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a broken one
        raise RuntimeError(f"CUDA is not usable: {exc}") from exc
    if count == 0:
        raise RuntimeError("CuPy sees no CUDA device")
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return cp, name.decode() if isinstance(name, bytes) else str(name)


# -- 1. bandwidth ----------------------------------------------------------------


def h2d_gbps(cp: Any, src: np.ndarray, dst: Any, stream: Any, reps: int) -> float:
    """GB/s of ``reps`` back-to-back host→device copies of ``src`` (CUDA events)."""
    nbytes = src.nbytes
    kind = cp.cuda.runtime.memcpyHostToDevice

    def copy() -> None:
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, nbytes, kind, stream.ptr)

    for _ in range(3):  # warm-up: first-touch, driver staging buffers
        copy()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        copy()
    end.record(stream)
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end)
    return reps * nbytes / (ms * 1e-3) / 1e9


def pool_h2d_gbps(backend: Any, nbytes: int, reps: int) -> float:
    """GB/s of ``reps`` host→device copies of ``nbytes`` through blobpipe: a Blob's
    pinned pool memory, ``backend.copy_to_device`` on a blobpipe stream, timed with
    the backend's timing events."""
    src_blob = blobpipe.Blob((nbytes,), np.uint8, backend=backend)
    dst_blob = blobpipe.Blob((nbytes,), np.uint8, backend=backend)
    try:
        src = src_blob.mutable_cpu_data()
        src.fill(1)
        dst = dst_blob.mutable_gpu_data()
        stream = backend.create_stream()
        for _ in range(3):  # warm-up
            backend.copy_to_device(dst, src, stream)
        stream.synchronize()
        start = backend.record_event(stream, timing=True)
        for _ in range(reps):
            backend.copy_to_device(dst, src, stream)
        end = backend.record_event(stream, timing=True)
        end.synchronize()
        seconds = backend.elapsed(start, end)
    finally:
        backend.synchronize()
        src_blob.close()
        dst_blob.close()
    return reps * nbytes / seconds / 1e9


def make_backend() -> Any:
    return blobpipe.get_backend("cuda")


def bandwidth(cp: Any, batch_shape: tuple[int, ...]) -> list[dict[str, Any]]:
    import cupyx

    u8_batch = int(np.prod(batch_shape))
    sizes = [("uint8 batch", u8_batch), ("float32 batch", 4 * u8_batch), ("64 MiB", 64 << 20)]
    stream = cp.cuda.Stream(non_blocking=True)
    backend = make_backend()
    rows = []
    for label, nbytes in sizes:
        reps = max(20, (512 << 20) // nbytes)
        dst = cp.empty(nbytes, dtype=cp.uint8)
        pinned = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
        pageable = np.empty(nbytes, dtype=np.uint8)
        pinned.fill(1)
        pageable.fill(1)
        plain = h2d_gbps(cp, pinned, dst, stream, reps)
        rows.append(
            {
                "size": label,
                "bytes": nbytes,
                "pinned_gbps": plain,
                "pageable_gbps": h2d_gbps(cp, pageable, dst, stream, reps),
                "pool_gbps": pool_h2d_gbps(backend, nbytes, reps),
            }
        )
        rows[-1]["pool_ratio"] = rows[-1]["pool_gbps"] / plain
        del dst, pinned, pageable
    return rows


# -- 2. loader throughput ----------------------------------------------------------------


def make_loader(db: Prepared, crop: int, workers: int, device_transform: bool) -> blobpipe.Loader:
    """W3's recipe: TRAIN, shuffle, crop, mirror, the mean file; batch 64."""
    return blobpipe.Loader(
        db.path,
        batch_size=BATCH,
        device="cuda",
        transform=blobpipe.Transform(crop_size=crop, mirror=True, mean_file=db.mean_file),
        phase="train",
        shuffle=True,
        workers=workers,
        prefetch=4,
        mode="wrap",
        device_transform=device_transform,
    )


def loader_throughput(
    cp: Any, db: Prepared, crop: int, workers: int, device_transform: bool, seconds: float
) -> dict[str, Any]:
    """Images/s of the loader consumed as fast as possible, for about ``seconds``."""
    with make_loader(db, crop, workers, device_transform) as loader:
        it = iter(loader)
        for _ in range(10):  # warm-up: pipeline fill, device-transform kernels compiled
            next(it).data.gpu_data()
        cp.cuda.Device().synchronize()
        s0 = loader.statistics()
        batches = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            next(it).data.gpu_data()
            batches += 1
        cp.cuda.Device().synchronize()
        wall = time.perf_counter() - t0
        s1 = loader.statistics()
        actual_workers = loader.workers
    per_image = 3 * crop * crop * (1 if device_transform else 4) + 4  # + the label
    images = batches * BATCH
    return {
        "workers": actual_workers,
        "device_transform": device_transform,
        "img_per_s": images / wall,
        "bus_gbps": images * per_image / wall / 1e9,
        "wait_fraction": (s1.wait_time - s0.wait_time) / wall,
        "copy_time_per_batch_ms": 1e3 * (s1.copy_time - s0.copy_time) / max(1, batches),
    }


# -- 3. training step ----------------------------------------------------------------


class Spin:
    """A one-thread kernel that keeps the GPU busy for a calibrated time."""

    def __init__(self, cp: Any, stream: Any) -> None:
        self.cp = cp
        self.stream = stream
        self.kernel = cp.RawKernel(_SPIN, "spin")
        self.sink = cp.zeros(1, dtype=cp.float32)
        self.cycles = 1_000_000

    def __call__(self, x: Any) -> None:
        with self.stream:
            self.kernel((1,), (1,), (x, np.int64(self.cycles), self.sink))

    def timed_ms(self, x: Any) -> float:
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.stream)
        self(x)
        end.record(self.stream)
        end.synchronize()
        return float(cp.cuda.get_elapsed_time(start, end))

    def calibrate(self, x: Any, ms: float) -> float:
        """Set the cycle count for ``ms`` per call; returns the measured median ms."""
        self.timed_ms(x)  # compile and load the kernel
        for _ in range(3):
            per_cycle = statistics.median(self.timed_ms(x) for _ in range(3)) / self.cycles
            self.cycles = max(1, round(ms / per_cycle))
        return statistics.median(self.timed_ms(x) for _ in range(5))


def train_synthetic(cp: Any, spin: Spin, steps: int, batch_shape: tuple[int, ...]) -> float:
    x = cp.ones(batch_shape, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        spin(x)
        spin.stream.synchronize()
    return time.perf_counter() - t0


def train_with_loader(
    cp: Any, spin: Spin, db: Prepared, crop: int, workers: int, steps: int
) -> dict[str, Any]:
    # the step's stream is current when each batch is asked for: the loader records
    # the previous batch's release there, after the step that read it
    with make_loader(db, crop, workers, True) as loader, spin.stream:
        it = iter(loader)
        for _ in range(10):  # warm-up, as a training loop's first steps
            spin(next(it).data.gpu_data())
            spin.stream.synchronize()
        s0 = loader.statistics()
        in_next = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            batch = next(it)
            in_next += time.perf_counter() - t
            spin(batch.data.gpu_data())
            spin.stream.synchronize()
        wall = time.perf_counter() - t0
        s1 = loader.statistics()
        actual_workers = loader.workers
    return {
        "workers": actual_workers,
        "wall_s": wall,
        "starvation": (s1.wait_time - s0.wait_time) / wall,
        "next_fraction": in_next / wall,
    }


# -- driver ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--allow-skip", action="store_true", help="exit 0 when there is no GPU")
    ap.add_argument("--quick", action="store_true", help="W3's tiny form (a smoke test)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run (5 ms each)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per loader throughput run")
    ap.add_argument(
        "--workers", type=int, default=None, help="loader workers (default: the CPU count and 2)"
    )
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the results to OUT")
    ap.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="the PCIe link's GB/s per direction: blobpipe's path must reach 70%% of it",
    )
    args = ap.parse_args(argv)
    try:
        cp, gpu = find_gpu()
    except RuntimeError as exc:
        print(f"skipped: no GPU ({exc})")
        return 0 if args.allow_skip else 1

    spec, crop = imagenet_raw(args.quick)
    db = prepare(spec, args.data_dir)
    batch_shape = (BATCH, 3, crop, crop)
    print(
        f"{gpu}; {os.cpu_count()} CPUs; cupy {cp.__version__}; W3: {db.count} raw "
        f"{'×'.join(map(str, spec.shape))} Datums, crop {crop}, mirror, mean file, shuffle "
        f"({'written' if db.written else 'cached'} in {db.seconds:.1f} s)\n"
    )
    targets: list[dict[str, Any]] = []

    bw = bandwidth(cp, batch_shape)
    peak = max(r["pinned_gbps"] for r in bw)
    print("host→device bandwidth (CUDA events):\n")
    print(
        "| size | pinned GB/s | pageable GB/s | blobpipe pool GB/s | pool / pinned | target "
        "| result |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    link = args.link_gbps
    for r in bw:
        if link:
            r["link_fraction"] = r["pool_gbps"] / link
            targets.append(
                {
                    "target": f"H2D from the pinned pool ≥ {LINK_TARGET:.0%} of the PCIe link's "
                    f"{link:g} GB/s ({r['size']})",
                    "measured": r["link_fraction"],
                    "passed": r["link_fraction"] >= LINK_TARGET,
                }
            )
        passed = r["pool_ratio"] >= POOL_BANDWIDTH_TARGET
        targets.append(
            {
                "target": f"H2D from the pinned pool ≥ {POOL_BANDWIDTH_TARGET:.0%} of a plain "
                f"pinned copy ({r['size']})",
                "measured": r["pool_ratio"],
                "passed": passed,
            }
        )
        print(
            f"| {r['size']} ({r['bytes']:,} B) | {r['pinned_gbps']:.1f} | "
            f"{r['pageable_gbps']:.1f} | {r['pool_gbps']:.1f} | {r['pool_ratio']:.1%} | "
            f"≥ {POOL_BANDWIDTH_TARGET:.0%} | {'PASS' if passed else 'FAIL'} |"
        )
    if link:
        print(f"\nblobpipe's path against the PCIe link ({link:g} GB/s per direction):\n")
        for r in bw:
            verdict = "PASS" if r["link_fraction"] >= LINK_TARGET else "FAIL"
            print(f"- {r['size']}: {r['link_fraction']:.1%} (≥ {LINK_TARGET:.0%}) {verdict}")

    # the default (one per CPU) and 2, as on the 2-core development machine
    worker_counts = [args.workers] if args.workers else sorted({os.cpu_count() or 1, 2})
    tp = [
        loader_throughput(cp, db, crop, w, dt, args.seconds)
        for w in worker_counts
        for dt in (True, False)
    ]
    print(f"\nloader throughput on W3 (batch {BATCH}; pinned peak {peak:.1f} GB/s):\n")
    print("| workers | transfer | img/s | bus GB/s | of pinned peak | consumer waiting |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in tp:
        transfer = "uint8, device transform" if r["device_transform"] else "float32"
        print(
            f"| {r['workers']} | {transfer} | {r['img_per_s']:,.0f} | {r['bus_gbps']:.2f} | "
            f"{r['bus_gbps'] / peak:.1%} | {r['wait_fraction']:.1%} |"
        )

    spin = Spin(cp, cp.cuda.Stream(non_blocking=True))
    step_ms = spin.calibrate(cp.ones(batch_shape, dtype=cp.float32), STEP_MS)
    synthetic = train_synthetic(cp, spin, args.steps, batch_shape)
    runs = [train_with_loader(cp, spin, db, crop, w, args.steps) for w in worker_counts]
    print(
        f"\ntraining step simulation on W3: {args.steps} steps of {step_ms:.2f} ms GPU work "
        f"(target {STEP_MS} ms), synchronised per step; synthetic on-device batch "
        f"{synthetic:.3f} s ({1e3 * synthetic / args.steps:.2f} ms/step):\n"
    )
    print(
        "| workers | wall s | vs synthetic | starvation (wait_time) | in next() | target | result |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in runs:
        passed = r["starvation"] < STARVATION_TARGET
        targets.append(
            {
                "target": f"starvation < {STARVATION_TARGET:.0%} with a {STEP_MS:g} ms GPU step "
                f"on W3 ({r['workers']} workers)",
                "measured": r["starvation"],
                "passed": passed,
            }
        )
        print(
            f"| {r['workers']} | {r['wall_s']:.3f} | {r['wall_s'] / synthetic:.3f}× | "
            f"{r['starvation']:.2%} | {r['next_fraction']:.2%} | < {STARVATION_TARGET:.0%} | "
            f"{'PASS' if passed else 'FAIL'} |"
        )
    ok = all(t["passed"] for t in targets)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "gpu": gpu,
            "cpus": os.cpu_count(),
            "cupy": cp.__version__,
            "workload": {"records": db.count, "shape": list(spec.shape), "crop": crop},
            "bandwidth": bw,
            "pinned_peak_gbps": peak,
            "loader_throughput": tp,
            "step_ms": step_ms,
            "synthetic_s": synthetic,
            "training": runs,
            "starvation_target": STARVATION_TARGET,
            "pool_bandwidth_target": POOL_BANDWIDTH_TARGET,
            "link_gbps": link,
            "link_target": LINK_TARGET,
            "targets": targets,
            "passed": ok,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    for t in targets:
        if not t["passed"]:
            print(f"target missed: {t['target']} (measured {t['measured']:.3g})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
