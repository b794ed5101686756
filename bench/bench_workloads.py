"""The Loader on the workloads Caffe users run, against a plain loop and PyTorch's recipe.

Run: ``python bench/bench_workloads.py [--quick] [--rounds N] [--workloads W1,W3,...]
[--json OUT] [--data-dir DIR] [--markdown] [--check] [--no-torch] [--no-dali]
[--prefault MIB]``

Workloads (LMDBs generated once and cached under ``bench/_data/``, see
``_workloads_data.py``; batch sizes from Caffe's example prototxts):

* **W1 MNIST** (lenet): raw 1×28×28 Datums, 60,000 records, TEST, key order,
  ``Transform(scale=0.00390625)``, batch 64.
* **W2 CIFAR-10** (cifar10_quick): raw 3×32×32, 50,000 records, TRAIN, key order,
  mirror, a 3×32×32 mean file, batch 100.
* **W3 ImageNet raw** (caffenet's train_val over ``create_imagenet.sh`` output): raw
  3×256×256, 2,048 records, TRAIN, ``order="shuffle"``, crop 227, mirror, a 3×256×256
  mean file. Batch 64, not caffenet's 256: a 256-image float32 batch is 158 MB, and
  two cores gain nothing from it but page faults.
* **W3-test**: W3's TEST form: centre crop 227, no mirror, key order, the mean file.
* **W4 ImageNet JPEG**: encoded JPEGs (quality 90, sides 240–500 px drawn per image),
  2,048 records, TRAIN, shuffle, crop 227, mirror, ``mean_value=(104, 117, 123)``, batch 64.
* **W5 pass-through**: W3's records as uint8 (``Transform(dtype="uint8")``: no crop,
  mean or scale), key order, batch 64, against one bulk memcpy of the same bytes.

``--workloads W3`` selects W3 and W3-test (a name selects itself and its ``-`` forms).
``--quick`` (a smoke test, one round unless ``--rounds``): a few hundred records, W3 at
3×96×96 with crop 80, W4 with sides 100–160 and crop 96.

Contenders (``_contenders.py``): the plain one-thread loop (the baseline), the PyTorch
DataLoader recipe with 2 workers (when torch is installed; it forks, so its rounds run
after all the others), NVIDIA DALI's CPU pipeline with 2 threads set up for Caffe's exact
output, and for W4 its ROI decode as well (``_dali.py``; when DALI is installed:
``pip install -e '.[bench-dali]'``; each checked against ``blobpipe.Transform`` given the
same crops and flips), the blobpipe Loader with 2 workers on device "cpu" in its
``async for`` and blocking forms, and for W5 the memcpy (for W4, the decoder alone, for
orientation). The blocking form runs a second time as an A/A control: unchecked, its
ratio to the blocking row shows how far two measurements of the same code differ in
that run (the noise that a ratio such as ``async for`` / blocking is read against). A
last row, ``Batches`` driven by hand in one thread (``next_plan`` and ``fill``, no
Loader), has no target: it shows what the batch work itself costs, so a
Loader row below it is limited by the pipeline (thread hand-offs, the GIL), one above it
by the work. Each as a **first epoch** (open, one pass, close; in a fresh Python
process, libraries imported before the clock starts) and as **later epochs** of a
pipeline kept open (its first epoch untimed); ``_contenders.py`` says how each is timed.

Every round runs every (contender, first/later) pass of a workload once, in an order
rotated each round, before moving to the next workload; after each pass the benchmark
waits, untimed, until the process is idle (a kept-open Loader stops once its ring is
full), so no pass runs into the next. Rates are images/s; a row's img/s is the median
over rounds and its ratio the median over rounds of the ratio to the baseline measured
in the same round (the plain loop; the memcpy for W5).

Targets (2 workers on a 2-core machine): the Loader's later epochs ≥ 1.6× the plain loop
(W3, W3-test: ≥ 1.5×), its first epochs ≥ 1.3×; W5's later epochs ≥ 0.25 of the memcpy;
``async for`` ≥ 0.95× the blocking form (first and later epochs); and ahead of every peer
that runs (the torch recipe, DALI, DALI's ROI decode: ≥ 1.00×, first and later epochs).
The table marks each
Loader row PASS or MISS; ``--check`` exits 1 on a miss (otherwise the exit status is 0).
Deterministic workloads (W1, W3-test, W5) also check that every contender's first batch
equals the baseline's; a difference is a miss.

To show what limits a row, the run also measures the memory bandwidth: one thread's
``np.copyto`` of a large buffer (GB/s copied; a copy reads and writes each byte, so the
bytes moved per second are twice that). Per workload it prints the bytes moved per
image: read (the record's pixels inside the crop, or the JPEG file) plus written (the
output row); the float32 mean a mean file adds is read at the crop too, but the same
mean serves every image and mostly stays in cache, so it is listed apart and not
counted. The ceiling is the moved bandwidth over the bytes moved per image. For first
epochs it measures, each round in a fresh process, what a Loader pays before its batches:
opening (``Batches`` lists the keys, indexes the data file, reads the first record) and the
first touch of its ring's fresh memory (5 batch buffers, host Blobs as the ring's),
against the time the first epoch may take to be 1.3× the plain loop's
(``bench_first.py`` takes a first epoch apart stage by stage).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _contenders as cs
import _fresh as fresh_memory
from _dali import DaliPipeline, dali_version
from _make import make
from _workloads_data import DbSpec, Prepared, imagenet_raw, prepare, warm_page_cache

import blobpipe
from blobpipe._io._budget import Budget

FORMAT = 1  # of the JSON document
LATER_TARGET = 1.6
FIRST_TARGET = 1.3
ASYNC_TARGET = 0.95
PASSTHROUGH_TARGET = 0.25
TRANSFORM_TOLERANCE = 1e-3
PEER_TARGET = 1.0
#: the rows whose later epochs' GIL budget is measured and shown (``blobpipe._io._budget``)
BUDGETED = ("batches", "blocking", "async")
#: the most of a batch's CPU time that may hold the GIL (Amdahl's serial fraction s of the
#: blocking Loader's later epochs): 3% lets ≥ 32 workers feed large records, 30% small ones
GIL_SMALL = 0.30
GIL_LARGE = 0.03
#: the pipelines users would pick instead, each a target for the Loader where it runs
PEERS = ("torch", "dali", "dali-roi")


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    db: DbSpec
    recipe: cs.Recipe  # its mean_file is filled in from the prepared database
    first_target: float | None = FIRST_TARGET
    later_target: float | None = LATER_TARGET
    passthrough: bool = False  # W5: the baseline is the memcpy
    gil_target: float | None = None  # the most GIL share s of the blocking Loader

    @property
    def baseline(self) -> str:
        return "memcpy" if self.passthrough else "plain"


def workloads(quick: bool) -> list[Workload]:
    """W1–W5 at full size, or tiny (``quick``)."""
    imagenet, crop = imagenet_raw(quick)
    jpeg_crop = 96 if quick else 227
    mnist = DbSpec(
        name="mnist",
        kind="raw",
        count=640 if quick else 60_000,
        pool=100 if quick else 1000,
        keys="index",
        shape=(1, 28, 28),
        labels=10,
    )
    cifar = DbSpec(
        name="cifar10",
        kind="raw",
        count=500 if quick else 50_000,
        pool=100 if quick else 1000,
        keys="index",
        shape=(3, 32, 32),
        mean_file=True,
        labels=10,
    )
    jpeg = DbSpec(
        name="imagenet_jpeg",
        kind="jpeg",
        count=192 if quick else 2048,
        pool=32 if quick else 256,
        keys="imagenet",
        sides=(100, 160) if quick else (240, 500),
        quality=90,
    )
    r = cs.Recipe
    return [
        Workload(
            "W1", "MNIST", mnist, r(batch=64, phase="test", scale=0.00390625), gil_target=GIL_SMALL
        ),
        Workload(
            "W2", "CIFAR-10", cifar, r(batch=100, phase="train", mirror=True), gil_target=GIL_SMALL
        ),
        Workload(
            "W3",
            "ImageNet raw, TRAIN",
            imagenet,
            r(batch=64, phase="train", shuffle=True, crop=crop, mirror=True),
            later_target=1.5,
            gil_target=GIL_LARGE,
        ),
        Workload(
            "W3-test",
            "ImageNet raw, TEST",
            imagenet,
            r(batch=64, phase="test", crop=crop),
            later_target=1.5,
            gil_target=GIL_LARGE,
        ),
        Workload(
            "W4",
            "ImageNet JPEG, TRAIN",
            jpeg,
            r(
                batch=64,
                phase="train",
                shuffle=True,
                crop=jpeg_crop,
                mirror=True,
                mean_value=(104.0, 117.0, 123.0),
                encoded=True,
            ),
            gil_target=GIL_LARGE,
        ),
        Workload(
            "W5",
            "pass-through, uint8",
            imagenet,
            r(batch=64, phase="test", dtype="uint8"),
            first_target=None,
            later_target=PASSTHROUGH_TARGET,
            passthrough=True,
        ),
    ]


def describe(run: Run) -> str:
    """One line: the records and the recipe of a workload."""
    p, r = run.prepared, run.recipe
    if p.spec.kind == "raw":
        records = "raw " + "×".join(map(str, p.spec.shape)) + " Datums"
    else:
        lo, hi = p.spec.sides
        records = (
            f"JPEG Datums (quality {p.spec.quality}, sides {lo}–{hi} px, "
            f"{p.payload_bytes / 1e3:.0f} kB on average)"
        )
    steps = [r.phase.upper(), "shuffle" if r.shuffle else "key order"]
    if r.crop:
        steps.append(f"crop {r.crop}" if r.phase == "train" else f"centre crop {r.crop}")
    if r.mirror:
        steps.append("mirror")
    if r.mean_file is not None:
        steps.append("mean file")
    if r.mean_value:
        steps.append("mean_value=(" + ", ".join(f"{v:g}" for v in r.mean_value) + ")")
    if r.scale != 1.0:
        steps.append(f"scale {r.scale:g}")
    if r.dtype != "float32":
        steps.append(f"dtype {r.dtype}, no transform")
    baseline = "; against one np.copyto of the same bytes" if run.workload.passthrough else ""
    return (
        f"{run.workload.name} {run.workload.title}: {p.count:,} {records}; "
        f"{', '.join(steps)}; batch {r.batch}{baseline}"
    )


def select(all_: list[Workload], spec: str | None) -> list[Workload]:
    if not spec:
        return all_
    chosen: set[str] = set()
    for token in (t.strip() for t in spec.split(",")):
        names = [w.name for w in all_ if w.name == token or w.name.startswith(token + "-")]
        if not names:
            known = ", ".join(w.name for w in all_)
            raise SystemExit(f"unknown workload {token!r} (known: {known})")
        chosen.update(names)
    return [w for w in all_ if w.name in chosen]


# -- rows and checks ---------------------------------------------------------------------------


@dataclass
class Check:
    kind: str  # "first" or "later"
    against: str  # a contender key
    target: float
    measured: float | None = None

    @property
    def passed(self) -> bool:
        return self.measured is not None and self.measured >= self.target


@dataclass
class Row:
    contender: cs.Contender
    checks: list[Check] = field(default_factory=list)
    rates: dict[str, list[float]] = field(default_factory=lambda: {"first": [], "later": []})
    same_first_batch: bool | None = None
    # later passes measured in this process: each pass's GIL budget and its batch count
    budgets: list[tuple[Budget, int]] = field(default_factory=list)
    # filled in by evaluate(): whether anything was checked, and what failed
    checked: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def result(self) -> str | None:
        """ "PASS", "MISS", or None (nothing checked, or skipped)."""
        if self.contender.skipped or not self.checked:
            return None
        return "MISS" if self.problems else "PASS"

    def median(self, kind: str) -> float | None:
        return statistics.median(self.rates[kind]) if self.rates[kind] else None

    def gil(self, of: Callable[[Budget, int], float]) -> float | None:
        """The median over the later passes of ``of(budget, batches)``."""
        return statistics.median(of(b, n) for b, n in self.budgets) if self.budgets else None


@dataclass
class Run:
    workload: Workload
    prepared: Prepared
    recipe: cs.Recipe
    rows: list[Row]
    firsts: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    # first-epoch fixed costs, one sample per round (see fixed_costs)
    fixed: list[dict[str, float]] = field(default_factory=list)
    # by contender key, the largest difference of its rows from blobpipe.Transform's given
    # the same crops and flips ("plain": the plain loop's and the torch recipe's per-record
    # work; "dali", "dali-roi": DALI's pipelines that run)
    transform_errors: dict[str, float] = field(default_factory=dict)
    # later epochs timed together in one later pass (the sweep's small databases)
    later_epochs: int = 1

    @property
    def plain_error(self) -> float | None:
        return self.transform_errors.get("plain")

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.contender.key == key)

    def ratio(self, row: Row, kind: str, against: str | None = None) -> float | None:
        """The median over rounds of ``row``'s rate over ``against``'s (default: the
        baseline) in the same round."""
        base = self.row(against or self.workload.baseline)
        pairs = list(zip(row.rates[kind], base.rates[kind], strict=True))
        return statistics.median(a / b for a, b in pairs) if pairs else None


def build(w: Workload, prepared: Prepared, host: cs.AsyncHost, torch: bool, dali: bool) -> Run:
    recipe = dataclasses.replace(
        w.recipe,
        mean_file=prepared.mean_file
        if prepared.mean_file and w.recipe.dtype == "float32"
        else None,
    )
    files = cs.Files(loader=prepared.path, first=prepared.first, plain=prepared.copy)
    c, h, wd = prepared.spec.shape if prepared.spec.kind == "raw" else (3, 0, 0)
    out_shape = recipe.out_shape(c, h, wd)
    rows: list[Row] = []
    errors: dict[str, float] = {}
    if w.passthrough:
        rows.append(Row(cs.Memcpy(files, recipe)))
    else:
        plain = make("plain", files, recipe, out_shape)
        assert isinstance(plain, cs.PlainLoop)
        dataset = cs.LmdbDataset(files.first, [], recipe)
        errors["plain"] = max(
            cs.check_against_transform(recipe, files.plain, plain.rows_of),
            cs.check_against_transform(recipe, files.plain, dataset.rows_of),
        )
        rows.append(Row(plain))
        tr = make("torch", files, recipe, out_shape)
        if not torch and tr.skipped is None:
            tr.skipped = "skipped (--no-torch)"
        rows.append(Row(tr))
    for key in ("dali", "dali-roi"):
        d = make(key, files, recipe, out_shape)
        if not dali and d.skipped is None:
            d.skipped = "skipped (--no-dali)"
        if d.skipped is None:
            assert isinstance(d, DaliPipeline)
            errors[key] = cs.check_against_transform(recipe, files.plain, d.rows_of)
        if key == "dali" or d.skipped is None:  # the ROI row only where it can run
            rows.append(Row(d))
    if recipe.encoded:
        rows.append(Row(cs.DecodeOnly(files)))
    running = [r.contender.key for r in rows if r.contender.skipped is None]
    for key in ("async", "blocking"):
        contender = make(key, files, recipe, out_shape, host)
        checks = []
        if w.first_target is not None:
            checks.append(Check("first", w.baseline, w.first_target))
        if w.later_target is not None:
            checks.append(Check("later", w.baseline, w.later_target))
        for peer in (p for p in PEERS if p in running):
            checks += [Check("first", peer, PEER_TARGET), Check("later", peer, PEER_TARGET)]
        if key == "async":
            checks += [
                Check("first", "blocking", ASYNC_TARGET),
                Check("later", "blocking", ASYNC_TARGET),
            ]
        rows.append(Row(contender, checks))
    # the blocking form a second time, unchecked: two measurements of the same code
    rows.append(Row(make("again", files, recipe, out_shape)))
    rows.append(Row(make("batches", files, recipe, out_shape)))
    return Run(w, prepared, recipe, rows, transform_errors=errors)


# -- measuring ---------------------------------------------------------------------------------


def settle(timeout: float = 3.0, window: float = 0.01) -> None:
    """Wait (untimed) until this process is idle: a kept-open Loader fills its ring after
    a pass and stops, and no pass should run while it does."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(window)
        if time.process_time() - c0 < 0.05 * (time.perf_counter() - t0):
            return


def copy_bandwidth(src: np.ndarray, dst: np.ndarray, repeats: int = 3) -> float:
    """GB/s copied by one thread's ``np.copyto`` (median of ``repeats``)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


_PROBE = b"\x5a" * (1 << 20)


def _hash(n: int) -> None:
    for _ in range(n):
        hashlib.sha256(_PROBE).digest()


def parallel_headroom(n: int = 32) -> float:
    """Speedup of a GIL-free workload (sha256 of 1 MiB) on 2 threads over 1: 2.00× means
    two idle cores; less, that the machine was shared at that moment."""
    t0 = time.perf_counter()
    _hash(n)
    one = time.perf_counter() - t0
    with ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(_hash, n // 2) for _ in range(2)]:
            f.result()
        two = time.perf_counter() - t0
    return one / two


def quiet_headroom(target: float = 1.7, patience: float = 20.0) -> float:
    """The parallel headroom, measured again (every half second) while it is below
    ``target``, for at most ``patience`` seconds: a round starts when the machine has
    two cores to give, or after that wait; returns the last measurement."""
    deadline = time.perf_counter() + patience
    headroom = parallel_headroom()
    while headroom < target and time.perf_counter() < deadline:
        time.sleep(0.5)
        headroom = parallel_headroom()
    return headroom


def run_pass(run: Run, row: Row, kind: str, keep: bool) -> None:
    c = row.contender
    epochs = 1 if kind == "first" else run.later_epochs
    sample = c.first(keep) if kind == "first" else c.later(keep, epochs)
    if sample.images != epochs * run.prepared.count:
        raise RuntimeError(
            f"{run.workload.name} {c.label} ({kind}): {sample.images} images, "
            f"expected {epochs * run.prepared.count}"
        )
    row.rates[kind].append(sample.images / sample.seconds)
    if kind == "later" and sample.budget is not None and c.key in BUDGETED:
        per_epoch = -(-run.prepared.count // run.recipe.batch)
        row.budgets.append((sample.budget, sample.budget_epochs * per_epoch))
    if sample.first_batch is not None:
        run.firsts[(c.key, kind)] = sample.first_batch
    settle()


_FIXED_PROBE = """
import json, sys, time
import numpy as np
import blobpipe
spec = json.loads(sys.argv[1])
t = blobpipe.Transform(**spec["transform"])
t0 = time.perf_counter()
with blobpipe.Batches(spec["db"], spec["batch"], transform=t, phase=spec["phase"],
                      order=spec["order"], mode="epoch") as b:
    plan = b.next_plan()
    t1 = time.perf_counter()
    slot = int(np.prod(plan.data_shape)) * plan.dtype.itemsize
slots = []
t2 = time.perf_counter()
for _ in range(spec["slots"]):  # as the ring's slots: host Blobs, filled without a zero fill
    blob = blobpipe.Blob(plan.data_shape, plan.dtype, backend="cpu")
    blob.overwrite_cpu_data().reshape(-1).view(np.uint8)[::4096] = 0
    slots.append(blob)
t3 = time.perf_counter()
print(json.dumps({"open_ms": 1e3 * (t1 - t0), "ring_mb": spec["slots"] * slot / 2**20,
                  "touch_ms": 1e3 * (t3 - t2)}))
"""

#: the Loader's default ring: this many batch slots (prefetch 4, and one for the previous
#: batch), allocated in its first epoch (batches of a few hundred KiB: more, see _chunk.py)
RING_SLOTS = 5


def fixed_costs(run: Run) -> dict[str, float]:
    """What a Loader's first epoch pays before the batches themselves, measured in a fresh
    process on the first-epoch database (public API only): opening (``Batches`` lists the
    keys, indexes the data file, reads the first record, plans one batch) and the first
    touch of its ring's fresh memory (``RING_SLOTS`` batch-sized buffers; the plain loop
    touches one). Every first epoch of the Loader pays both; they are why a first epoch of
    small records, or of large batches on a machine where fresh memory is slow, falls short
    of its target."""
    r = run.recipe
    spec = {
        "db": str(run.prepared.first),
        "batch": r.batch,
        "phase": r.phase,
        "order": "shuffle" if r.shuffle else "key",
        "slots": RING_SLOTS,
        "transform": {
            "scale": r.scale,
            "mirror": r.mirror,
            "crop_size": r.crop,
            "mean_file": None if r.mean_file is None else str(r.mean_file),
            "mean_value": list(r.mean_value),
            "dtype": r.dtype,
        },
    }
    proc = subprocess.run(
        [sys.executable, "-c", _FIXED_PROBE, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    sample: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return sample


def measure(runs: list[Run], rounds: int, probe_bytes: int) -> tuple[list[float], list[float]]:
    """Every round: the probes, then every workload's passes in a rotated order. The
    contenders that fork run their rounds after all the others. Returns the copy
    bandwidth (of ``probe_bytes``) and the parallel headroom of each round."""
    src = cs.private_empty((probe_bytes,), np.uint8)
    dst = cs.private_empty((probe_bytes,), np.uint8)
    src.fill(1)
    bandwidth, headroom = [], []
    for forks in (False, True):
        for rnd in range(rounds):
            if not forks:
                bandwidth.append(copy_bandwidth(src, dst))
                headroom.append(parallel_headroom())
            for run in runs:
                items = [
                    (row, kind)
                    for row in run.rows
                    if row.contender.skipped is None and row.contender.forks == forks
                    for kind in ("first", "later")
                ]
                if not items:
                    continue
                if forks and rnd == 0:
                    for row in {id(r): r for r, _ in items}.values():
                        row.contender.start()
                shift = rnd % len(items)
                for row, kind in items[shift:] + items[:shift]:
                    run_pass(run, row, kind, keep=rnd == 0)
                if not forks:
                    run.fixed.append(fixed_costs(run))
                    settle()
    return bandwidth, headroom


def compare_first_batches(run: Run) -> None:
    """For a deterministic recipe, every contender's first batch must equal the baseline's."""
    if not run.recipe.deterministic:
        return
    ref = run.firsts.get((run.workload.baseline, "first"))
    if ref is None:
        return
    for row in run.rows:
        got = [v for (key, _), v in run.firsts.items() if key == row.contender.key]
        if not got:
            continue
        row.same_first_batch = all(
            g.shape == ref.shape and np.allclose(g, ref, rtol=1e-6, atol=1e-5) for g in got
        )


def evaluate(run: Run) -> None:
    """Measure every row's checks and list what failed: a ratio under its target, a first
    batch unlike the baseline's, a plain loop computing other values than Caffe's."""
    for row in run.rows:
        if row.contender.skipped:
            continue
        for c in row.checks:
            c.measured = run.ratio(row, c.kind, c.against)
            if not c.passed:  # three decimals: 1.299 must not read as 1.30
                got = "—" if c.measured is None else f"{c.measured:.3f}×"
                row.problems.append(f"{c.kind} vs {c.against} {got} < {c.target:.2f}×")
        target = run.workload.gil_target
        serial = row.gil(lambda b, n: b.serial)
        if row.contender.key == "blocking" and target is not None and serial is not None:
            row.checked = True
            if serial > target:
                row.problems.append(f"GIL share {serial:.3f} > {target:.2f}")
        if row.same_first_batch is False:
            row.problems.append("first batch differs from the baseline's")
        error = run.transform_errors.get(row.contender.key)
        if error is not None and error > TRANSFORM_TOLERANCE:
            row.problems.append(f"differs from blobpipe.Transform (max |Δ| {error:.3g})")
        row.checked = (
            row.checked or bool(row.checks) or row.same_first_batch is not None or error is not None
        )


# -- reporting ---------------------------------------------------------------------------------


def bytes_per_image(run: Run) -> dict[str, float]:
    """Read (pixels inside the crop, or the JPEG file), written (the output row), moved
    (their sum), and the float32 mean read at the crop (not counted in moved)."""
    p, r = run.prepared, run.recipe
    channels = p.spec.shape[0] if p.spec.kind == "raw" else 3
    if p.spec.kind == "jpeg":
        read = p.payload_bytes
        plane = p.pixels / channels
    else:
        plane = p.pixels / channels
        read = channels * (r.crop * r.crop if r.crop else plane)
    out_plane = r.crop * r.crop if r.crop else plane
    written = channels * out_plane * np.dtype(r.dtype).itemsize
    mean = channels * out_plane * 4 if r.mean_file is not None else 0.0
    return {"read": read, "written": written, "moved": read + written, "mean_read": mean}


def _fmt_rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _fmt_ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _target_text(run: Run, row: Row) -> str:
    parts = []
    base = run.workload.baseline
    for c in row.checks:
        if c.against == base:
            parts.append(f"{c.kind} ≥ {c.target:.2f}×")
    peers = sorted({c.against for c in row.checks if c.against in PEERS}, key=PEERS.index)
    if peers:
        parts.append(f"≥ {PEER_TARGET:.2f}× " + ", ".join(peers))
    if any(c.against == "blocking" for c in row.checks):
        parts.append(f"≥ {ASYNC_TARGET:.2f}× blocking")
    if row.contender.key == "blocking" and run.workload.gil_target is not None:
        parts.append(f"GIL share ≤ {run.workload.gil_target:.2f}")
    return ", ".join(parts)


def _control_text(run: Run, row: Row) -> str:
    """The A/A control's ratios to the blocking row: the noise of this run."""
    got = [run.ratio(row, kind, "blocking") for kind in ("first", "later")]
    first, later = (_fmt_ratio(r) for r in got)
    return f"(A/A control) first {first}, later {later} the blocking row"


def _result_text(row: Row) -> str:
    if row.contender.skipped:
        return row.contender.skipped
    if row.problems:
        return "MISS: " + "; ".join(row.problems)
    return "PASS" if row.checks else ""


HEADER = (
    "workload",
    "contender",
    "first epoch img/s",
    "ratio",
    "later epochs img/s",
    "ratio",
    "target",
    "result",
)


def main_table(runs: list[Run]) -> list[tuple[str, ...]]:
    lines = []
    for run in runs:
        for row in run.rows:
            skipped = row.contender.skipped is not None
            lines.append(
                (
                    f"{run.workload.name} {run.workload.title}",
                    row.contender.label,
                    "—" if skipped else _fmt_rate(row.median("first")),
                    "—" if skipped else _fmt_ratio(run.ratio(row, "first")),
                    "—" if skipped else _fmt_rate(row.median("later")),
                    "—" if skipped else _fmt_ratio(run.ratio(row, "later")),
                    _control_text(run, row)
                    if row.contender.key == "again"
                    else _target_text(run, row),
                    _result_text(row),
                )
            )
    return lines


PEERS_HEADER = (
    "workload",
    "plain loop img/s",
    "torch DataLoader",
    "DALI CPU (best)",
    "blobpipe for",
    "blobpipe async for",
    "GIL share · bound 32 workers",
)


def peers_table(runs: list[Run]) -> list[tuple[str, ...]]:
    """One row per workload, the contenders as columns: each cell the later-epoch and
    first-epoch ratios to the workload's baseline (W5: the memcpy), later · first; the
    baseline's later-epoch rate in the second column (the README's table)."""

    def cell(run: Run, keys: tuple[str, ...]) -> str:
        rows = [r for r in run.rows if r.contender.key in keys and r.contender.skipped is None]
        if not rows:
            return "—"
        best = max(rows, key=lambda r: run.ratio(r, "later") or 0.0)
        return f"{_fmt_ratio(run.ratio(best, 'later'))} · {_fmt_ratio(run.ratio(best, 'first'))}"

    lines = []
    for run in runs:
        base = run.row(run.workload.baseline)
        lines.append(
            (
                f"{run.workload.name} {run.workload.title}",
                f"{_fmt_rate(base.median('later'))}"
                + (" (memcpy)" if run.workload.baseline != "plain" else ""),
                cell(run, ("torch",)),
                cell(run, ("dali", "dali-roi")),
                cell(run, ("blocking",)),
                cell(run, ("async",)),
                _gil_cell(run.row("blocking")),
            )
        )
    return lines


def _gil_cell(row: Row) -> str:
    serial = row.gil(lambda b, n: b.serial)
    bound = row.gil(lambda b, n: b.bound(32))
    return "—" if serial is None or bound is None else f"{serial:.1%} · {bound:.1f}×"


GIL_HEADER = (
    "workload",
    "contender",
    "wall µs/batch",
    "GIL µs/batch",
    "GIL-free µs/batch",
    "GIL share s",
    "GIL busy",
    "bound 2",
    "bound 32",
    "target",
)


def gil_table(runs: list[Run]) -> list[tuple[str, ...]]:
    """The later epochs' GIL budget per batch (medians over rounds; a pipeline's over the
    untimed epoch before its timed ones too, so that what its ring filled before the
    clock counts in it, not only the batches' hand-off): wall time, CPU time
    counted as holding the GIL and CPU time of the compiled modules without it, the GIL
    share s of the CPU time (Amdahl's serial fraction), the share of the wall time the
    GIL was held (busy), and the speed-up over one thread that 2 and 32 workers can reach
    at most, ``1 / (s + (1 - s) / N)``."""
    lines = []
    for run in runs:
        for row in run.rows:
            if not row.budgets:
                continue
            us = [row.gil(lambda b, n, f=f: 1e6 * f(b) / n) for f in _PER_BATCH]
            target = run.workload.gil_target
            checked = row.contender.key == "blocking" and target is not None
            lines.append(
                (
                    run.workload.name,
                    row.contender.label,
                    *(f"{v:,.1f}" for v in us if v is not None),
                    f"{row.gil(lambda b, n: b.serial):.1%}",
                    f"{row.gil(lambda b, n: b.busy):.0%}",
                    f"{row.gil(lambda b, n: b.bound(2)):.2f}×",
                    f"{row.gil(lambda b, n: b.bound(32)):.1f}×",
                    f"≤ {target:.0%}" if checked and target is not None else "",
                )
            )
    return lines


_PER_BATCH: tuple[Callable[[Budget], float], ...] = (
    lambda b: b.wall,
    lambda b: b.held,
    lambda b: b.free,
)


MEMORY_HEADER = (
    "workload",
    "read B/img",
    "written B/img",
    "moved B/img",
    "mean B/img (cached)",
    "ceiling img/s",
    "best Loader later img/s",
    "of ceiling",
)


def memory_table(runs: list[Run], moved_gbps: float) -> list[tuple[str, ...]]:
    lines = []
    for run in runs:
        b = bytes_per_image(run)
        ceiling = moved_gbps * 1e9 / b["moved"]
        best = max((run.row(k).median("later") or 0.0) for k in ("async", "blocking"))
        lines.append(
            (
                run.workload.name,
                f"{b['read']:,.0f}",
                f"{b['written']:,.0f}",
                f"{b['moved']:,.0f}",
                f"{b['mean_read']:,.0f}" if b["mean_read"] else "—",
                f"{ceiling:,.0f}",
                f"{best:,.0f}",
                f"{best / ceiling:.0%}",
            )
        )
    return lines


FIXED_HEADER = (
    "workload",
    "open ms",
    "ring MB",
    "ring first touch ms",
    "plain first epoch ms",
    "fixed share of the 1.3× budget",
)


def fixed_table(runs: list[Run]) -> list[tuple[str, ...]]:
    """Medians of the first-epoch fixed costs, against the time a Loader's first epoch may
    take to meet 1.3× the plain loop's (its ``1 / 1.3``)."""
    lines = []
    for run in runs:
        if not run.fixed or run.workload.passthrough:
            continue
        open_ms = statistics.median(f["open_ms"] for f in run.fixed)
        touch = [f["touch_ms"] for f in run.fixed]
        plain = run.row(run.workload.baseline).median("first")
        epoch_ms = 1e3 * run.prepared.count / plain if plain else float("nan")
        budget = epoch_ms / FIRST_TARGET
        share = (open_ms + statistics.median(touch)) / budget
        lines.append(
            (
                run.workload.name,
                f"{open_ms:.1f}",
                f"{run.fixed[0]['ring_mb']:.0f}",
                f"{statistics.median(touch):.1f} (max {max(touch):.0f})",
                f"{epoch_ms:.0f}",
                f"{share:.0%}",
            )
        )
    return lines


def render(
    header: tuple[str, ...], lines: list[tuple[str, ...]], markdown: bool, right: set[int]
) -> str:
    if markdown:
        out = [
            "| " + " | ".join(header) + " |",
            "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |",
        ]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]

    def fmt(cells: tuple[str, ...]) -> str:
        padded = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, lines)])


def versions() -> dict[str, str | None]:
    import cv2

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "lmdb": dist("lmdb"),
        "protobuf": dist("protobuf"),
        "anyio": dist("anyio"),
        "blobpipe": blobpipe.__version__,
        "torch": cs.torch_version(),
        "dali": dali_version(),
    }


def json_doc(
    runs: list[Run],
    args: argparse.Namespace,
    bandwidth: list[float],
    headroom: list[float],
    load0: float,
    elapsed: float,
) -> dict[str, Any]:
    copied = statistics.median(bandwidth)
    out_runs = []
    for run in runs:
        b = bytes_per_image(run)
        contenders = []
        for row in run.rows:
            c = row.contender
            contenders.append(
                {
                    "key": c.key,
                    "label": c.label,
                    "skipped": c.skipped,
                    **{
                        kind: None
                        if c.skipped
                        else {
                            "img_s": row.rates[kind],
                            "median": row.median(kind),
                            "ratio": run.ratio(row, kind),
                        }
                        for kind in ("first", "later")
                    },
                    "checks": [
                        {
                            "kind": ch.kind,
                            "against": ch.against,
                            "target": ch.target,
                            "measured": ch.measured,
                            "passed": ch.passed,
                        }
                        for ch in row.checks
                    ],
                    "same_first_batch": row.same_first_batch,
                    "result": row.result,
                    "gil_budget": [
                        {
                            "batches": n,
                            "wall_s": b.wall,
                            "cpu_s": b.cpu,
                            "free_s": b.free,
                            "serial": b.serial,
                        }
                        for b, n in row.budgets
                    ],
                    "problems": row.problems,
                }
            )
        out_runs.append(
            {
                "name": run.workload.name,
                "title": run.workload.title,
                "records": run.prepared.count,
                "baseline": run.workload.baseline,
                "recipe": run.recipe.to_doc(),
                "database": {
                    "path": str(run.prepared.path),
                    "written": run.prepared.written,
                    "value_bytes": run.prepared.value_bytes,
                    "payload_bytes": run.prepared.payload_bytes,
                    "pixels": run.prepared.pixels,
                },
                "per_record_vs_transform_max_abs_diff": run.plain_error,
                "dali_vs_transform_max_abs_diff": {
                    k: v for k, v in run.transform_errors.items() if k != "plain"
                },
                "bytes_per_image": b,
                "ceiling_img_s": 2 * copied * 1e9 / b["moved"],
                "contenders": contenders,
            }
        )
    # the A/A control (the blocking row's code again) is not counted
    rows = [
        row
        for run in runs
        for row in run.rows
        if row.result is not None and row.contender.key != "again"
    ]
    missed = sum(row.result == "MISS" for row in rows)
    return {
        "benchmark": "bench_workloads",
        "format": FORMAT,
        "quick": args.quick,
        "prefault": args.prefault,
        "rounds": args.rounds,
        "workers": cs.WORKERS,
        "device": "cpu",
        "environment": {
            "cpus": os.cpu_count(),
            "loadavg_start": load0,
            "parallel_headroom_2_threads": headroom,
            "versions": versions(),
        },
        "memcpy": {
            "copied_gbps": bandwidth,
            "copied_gbps_median": copied,
            "moved_gbps_median": 2 * copied,
        },
        "workloads": out_runs,
        "summary": {"rows_checked": len(rows), "rows_missed": missed},
        "seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny databases, one round: a smoke test")
    ap.add_argument("--rounds", type=int, help="interleaved rounds; medians (default 5, quick 1)")
    ap.add_argument("--workloads", metavar="W1,W3,...", help="a subset (default: all)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch recipe")
    ap.add_argument("--no-dali", action="store_true", help="skip NVIDIA DALI's pipelines")
    fresh_memory.add_option(ap)
    args = ap.parse_args(argv)
    if args.prefault < 0:
        ap.error("--prefault must be >= 0")
    cs.PREFAULT_MIB = args.prefault
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    chosen = select(workloads(args.quick), args.workloads)

    t0 = time.perf_counter()
    prepared: dict[DbSpec, Prepared] = {}
    for w in chosen:
        if w.db not in prepared:
            prepared[w.db] = prepare(w.db, args.data_dir)
            warm_page_cache(prepared[w.db])
    t_data = time.perf_counter() - t0
    load0 = os.getloadavg()[0]
    host = cs.AsyncHost()
    runs: list[Run] = []
    try:
        t0 = time.perf_counter()
        for w in chosen:
            runs.append(build(w, prepared[w.db], host, not args.no_torch, not args.no_dali))
            for row in runs[-1].rows:
                if row.contender.skipped is None and not row.contender.forks:
                    row.contender.start()  # a kept-open pipeline's first epoch, untimed
                    settle()
        t_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        probe = (64 if args.quick else 256) << 20
        bandwidth, headroom = measure(runs, args.rounds, probe)
        t_measure = time.perf_counter() - t0
    finally:
        for run in runs:
            for row in run.rows:
                row.contender.close()
        host.close()
        cs.close_shared_envs()
    for run in runs:
        compare_first_batches(run)
        evaluate(run)

    copied = statistics.median(bandwidth)
    v = versions()
    print(
        f"blobpipe workload benchmark{' (--quick: tiny databases)' if args.quick else ''}: "
        f"{args.rounds} interleaved round(s), medians; Loader workers={cs.WORKERS}, "
        f'device="cpu", mode="epoch"'
    )
    if note := fresh_memory.note(args.prefault):
        print(f"fresh memory: {note}")
    print(
        f"machine: {os.cpu_count()} CPU cores, load average {load0:.2f} at start; parallel "
        f"headroom {statistics.median(headroom):.2f}× (sha256 on 2 threads vs 1; 2.00× = two "
        f"idle cores; per round {', '.join(f'{h:.2f}' for h in headroom)})"
    )
    print(
        f"memory: np.copyto, 1 thread: {copied:.2f} GB/s copied = {2 * copied:.2f} GB/s moved "
        f"(read + written; per round {', '.join(f'{b:.2f}' for b in bandwidth)})"
    )
    print("versions: " + ", ".join(f"{k} {val or '(not installed)'}" for k, val in v.items()))
    for p in prepared.values():
        print(
            f"data: {p.path.parent.name}: {p.count:,} records, {p.value_bytes:,.0f} B/record "
            f"({'written' if p.written else 'cached'}, {p.seconds:.1f} s)"
        )
    checked = [(run.workload.name, run.plain_error) for run in runs if run.plain_error is not None]
    if checked:
        print(
            "the plain loop's and the torch recipe's per-record work against blobpipe.Transform "
            "given the same crops and flips (max |Δ|): "
            + ", ".join(
                f"{name} {err:.3g}" + ("" if err <= TRANSFORM_TOLERANCE else " (DIFFERS)")
                for name, err in checked
            )
        )
    print(
        f"time: data {t_data:.1f} s, contenders opened (first epochs untimed) {t_start:.1f} s, "
        f"rounds {t_measure:.1f} s\n"
    )
    right = {2, 3, 4, 5}
    for run in runs:
        print(describe(run))
    print()
    print(
        "one row per workload: each contender's later-epoch · first-epoch ratio to the plain "
        "loop (W5: the memcpy); the A/A control is in the table below:\n"
    )
    print(render(PEERS_HEADER, peers_table(runs), args.markdown, {1, 2, 3, 4, 5, 6}))
    print()
    print(render(HEADER, main_table(runs), args.markdown, right))
    print(
        "\nthe GIL budget of later epochs, per batch (medians): CPU time counted as holding "
        "the GIL (all but the compiled modules' GIL-free sections: an upper bound) and "
        "GIL-free; s = GIL / (GIL + GIL-free) bounds N workers at 1 / (s + (1 - s) / N) "
        "times one thread:\n"
    )
    print(render(GIL_HEADER, gil_table(runs), args.markdown, {2, 3, 4, 5, 6, 7, 8}))
    print()
    print(
        "bytes moved per image against the memory bandwidth of this run "
        f"(ceiling = {2 * copied:.2f} GB/s moved / moved B/img):\n"
    )
    print(
        render(MEMORY_HEADER, memory_table(runs, 2 * copied), args.markdown, {1, 2, 3, 4, 5, 6, 7})
    )
    print(
        "\nfirst-epoch fixed costs, each round in a fresh process (medians): opening "
        "(keys, index, first record) and the first touch of the Loader's ring "
        f"({RING_SLOTS} batch buffers), against the time a first epoch may take to be 1.3× the "
        "plain loop:\n"
    )
    print(render(FIXED_HEADER, fixed_table(runs), args.markdown, {1, 2, 3, 4, 5}))
    doc = json_doc(runs, args, bandwidth, headroom, load0, t_measure)
    missed = doc["summary"]["rows_missed"]
    print(
        f"\n{doc['summary']['rows_checked'] - missed} of {doc['summary']['rows_checked']} "
        f"checked rows PASS, {missed} MISS"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
