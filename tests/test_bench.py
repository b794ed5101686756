"""Smoke tests of the benchmark scripts: they run and print their tables (targets not checked)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_quick(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``bench/script --quick`` with its LMDB cache under ``tmp_path``; must exit 0 (every
    workload's first epochs run in fresh processes, DALI's and torch's imports included:
    on a loaded 2-core machine the workload benchmark's quick run takes well over a minute)."""
    cmd = [sys.executable, str(BENCH / script), "--quick", "--data-dir", str(tmp_path / "data")]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _bench_imports() -> dict[str, set[str]]:
    """Each ``bench/*.py`` module's imports of other bench modules, wherever they stand
    in the file (module level or inside a function)."""
    modules = {p.stem: p for p in BENCH.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
        graph[name] = found & set(modules) - {name}
    return graph


def test_bench_modules_import_each_other_without_a_cycle() -> None:
    graph = _bench_imports()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = " -> ".join([*path[path.index(name) :], name])
            pytest.fail(f"bench modules import each other in a cycle: {cycle}")
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


WORKLOAD_ROWS = (
    "W1 MNIST",
    "W2 CIFAR-10",
    "W3 ImageNet raw, TRAIN",
    "W3-test ImageNet raw, TEST",
    "W4 ImageNet JPEG, TRAIN",
    "W5 pass-through, uint8",
)


@pytest.fixture(scope="module")
def workloads_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One ``bench_workloads.py --quick`` run (its LMDB cache kept for the tests after
    it): the directory and what it printed."""
    tmp_path = tmp_path_factory.mktemp("workloads")
    out = tmp_path / "result.json"
    proc = run_quick("bench_workloads.py", tmp_path, "--json", str(out), "--markdown")
    return tmp_path, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_workloads_quick(workloads_quick: tuple[Path, str]) -> None:
    tmp_path, text = workloads_quick
    out = tmp_path / "result.json"
    assert (
        "| workload | contender | first epoch img/s | ratio | later epochs img/s | ratio "
        "| target | result |"
    ) in text
    assert "| workload | read B/img | written B/img | moved B/img |" in text
    # the README's table: one row per workload, the contenders as columns
    assert (
        "| workload | plain loop img/s | torch DataLoader | DALI CPU (best) | blobpipe for "
        "| blobpipe async for | GIL share · bound 32 workers |"
    ) in text
    for name in WORKLOAD_ROWS:
        row = next(x for x in text.splitlines() if x.startswith(f"| {name} | ") and "×" in x)
        pair = r"[\d.]+× · [\d.]+×"
        gil = r"[\d.]+% · [\d.]+×"
        assert re.search(rf"\| {pair} \| {pair} \| {gil} \|$", row), row  # for, async, GIL
    # the GIL budget of each blobpipe row's later epochs, the blocking row's target
    assert "| workload | contender | wall µs/batch | GIL µs/batch | GIL-free µs/batch |" in text
    for name, target in (("W1", 30), ("W2", 30), ("W3", 3), ("W3-test", 3), ("W4", 3)):
        line = f"| {name} | Loader, blocking for (2 workers) |"
        assert any(x.startswith(line) and x.endswith(f"| ≤ {target}% |") for x in text.splitlines())
    assert "| workload | open ms | ring MB | ring first touch ms | plain first epoch ms |" in text
    for name in WORKLOAD_ROWS:
        assert f"| {name} | plain loop (1 thread) |" in text or name.startswith("W5")
        assert f"| {name} | Loader, async for (2 workers) |" in text
        assert f"| {name} | Loader, blocking for (2 workers) |" in text
        assert f"| {name} | Batches, one thread (no pipeline) |" in text
        control = f"| {name} | Loader, blocking for (2 workers), again (A/A control) |"
        assert control in text
        line = next(x for x in text.splitlines() if x.startswith(control))
        assert "| (A/A control) first " in line and "the blocking row |  |" in line
    assert "| W5 pass-through, uint8 | memcpy (one np.copyto) |" in text
    assert "| W4 ImageNet JPEG, TRAIN | cv2.imdecode only (1 thread) |" in text
    assert "checked rows PASS" in text

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_workloads" and doc["quick"] and doc["rounds"] == 1
    for w in doc["workloads"]:
        rows = {c["key"]: c for c in w["contenders"]}
        for key in ("batches", "blocking", "async"):
            (budget,) = rows[key]["gil_budget"]  # one round: one later pass
            assert budget["batches"] > 0 and budget["cpu_s"] > 0
            assert budget["free_s"] >= 0 and 0 <= budget["serial"] <= 1
        if "plain" in rows:
            assert rows["plain"]["gil_budget"] == []
    assert doc["memcpy"]["copied_gbps_median"] > 0
    runs = {w["name"]: w for w in doc["workloads"]}
    assert list(runs) == ["W1", "W2", "W3", "W3-test", "W4", "W5"]
    targets = {}
    for name, w in runs.items():
        assert w["bytes_per_image"]["moved"] > 0 and w["ceiling_img_s"] > 0
        if name != "W5":  # the plain loop computes what Caffe (blobpipe.Transform) computes
            assert w["per_record_vs_transform_max_abs_diff"] == pytest.approx(0, abs=1e-3)
        rows = {c["key"]: c for c in w["contenders"]}
        for key, row in rows.items():
            if row["skipped"]:
                assert row["first"] is None and row["later"] is None
                continue
            for kind in ("first", "later"):
                assert len(row[kind]["img_s"]) == 1 and row[kind]["median"] > 0
                assert row[kind]["ratio"] > 0
            if name in ("W1", "W3-test", "W5"):  # deterministic: same first batch as the baseline
                assert row["same_first_batch"] is True, (name, key)
        # the A/A control has no target (deterministic workloads check its first batch)
        assert rows["again"]["checks"] == [] and rows["again"]["result"] in (None, "PASS")
        for key in ("async", "blocking"):
            assert rows[key]["result"] in ("PASS", "MISS")
            targets[name, key] = {
                (c["kind"], c["against"]): c["target"] for c in rows[key]["checks"]
            }
        assert ("torch" in rows) == (name != "W5")
        # DALI's pipelines: where they run, they compute what blobpipe.Transform computes
        assert "dali" in rows and ("dali-roi" in rows) <= (name == "W4")
        errors = w["dali_vs_transform_max_abs_diff"]
        ran = {k for k in ("dali", "dali-roi") if k in rows and not rows[k]["skipped"]}
        assert set(errors) == ran
        assert all(e == 0 for e in errors.values()), errors
        if rows["dali"]["skipped"] is None:
            assert ("first", "dali") in targets[name, "blocking"]
    peers = {k: v for k, v in targets["W1", "async"].items() if k[1] in ("dali", "torch")}
    assert set(peers.values()) <= {1.0}
    assert {k: v for k, v in targets["W1", "async"].items() if k not in peers} == {
        ("first", "plain"): 1.3,
        ("later", "plain"): 1.6,
        ("first", "blocking"): 0.95,
        ("later", "blocking"): 0.95,
    }
    w3 = {k: v for k, v in targets["W3", "blocking"].items() if k[1] not in ("dali", "torch")}
    assert w3 == {("first", "plain"): 1.3, ("later", "plain"): 1.5}
    w5 = {k: v for k, v in targets["W5", "blocking"].items() if k[1] != "dali"}
    assert w5 == {("later", "memcpy"): 0.25}
    assert doc["summary"]["rows_checked"] >= 12


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_workloads_again_reuses_the_cache(workloads_quick: tuple[Path, str]) -> None:
    """A second run reuses the cached LMDBs; a subset; the plain-text table."""
    tmp_path, _ = workloads_quick
    again = run_quick("bench_workloads.py", tmp_path, "--workloads", "W1")
    assert "(cached" in again.stdout and "(written" not in again.stdout
    assert "W1 MNIST" in again.stdout and "W2 CIFAR-10" not in again.stdout
    header = again.stdout.splitlines()
    assert any(line.startswith("workload") and "first epoch img/s" in line for line in header)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_workloads_check_exit_status(workloads_quick: tuple[Path, str]) -> None:
    """``--check``: the exit status says whether a row missed."""
    tmp_path, _ = workloads_quick
    cmd = [sys.executable, str(BENCH / "bench_workloads.py"), "--quick", "--check"]
    cmd += ["--data-dir", str(tmp_path / "data"), "--workloads", "W5"]
    checked = subprocess.run(cmd, capture_output=True, text=True, timeout=80, check=False)
    summary = re.search(r"(\d+) of (\d+) checked rows PASS, (\d+) MISS", checked.stdout)
    assert summary is not None, checked.stdout[-4000:] + checked.stderr[-4000:]
    missed = int(summary.group(3))
    assert int(summary.group(1)) + missed == int(summary.group(2))
    assert checked.returncode == (1 if missed else 0), checked.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_pairs_quick(tmp_path: Path) -> None:
    out = tmp_path / "pairs.json"
    proc = run_quick("bench_pairs.py", tmp_path, "--json", str(out), "--markdown")
    text = proc.stdout
    assert "| point | rounds | 2 workers / Batches, later (≥ 1.50×) |" in text
    assert "points resolved (the A/A control's 90% interval within ±5%)" in text
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_pairs" and doc["quick"] and doc["rounds"] == 3
    assert len(doc["points"]) == 2
    for point in doc["points"]:
        assert f"| {point['name']} | 3 |" in text
        for key in ("plain", "batches", "async", "blocking", "again"):
            assert len(point["rates"][key]["later"]) == 3
        assert 0 < point["gil_serial"] <= 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_pairs_workloads_quick(tmp_path: Path) -> None:
    """``--workloads``: the workloads' databases and recipes, the points' contenders (W5's
    baseline is the memcpy: no plain loop, its first-epoch check shown as "—"), and the
    prefault noted."""
    out = tmp_path / "pairs.json"
    proc = run_quick(
        "bench_pairs.py", tmp_path, "--json", str(out), "--markdown",
        "--workloads", "W1,W5", "--prefault", "8",
    )  # fmt: skip
    text = proc.stdout
    assert "blobpipe pairs: 2 workloads, 3 interleaved rounds" in text
    assert "8 MiB prefaulted before each first epoch's clock" in text
    doc = json.loads(out.read_text())
    assert [p["name"] for p in doc["points"]] == ["W1", "W5"] and doc["prefault"] == 8
    w1, w5 = doc["points"]
    assert set(w1["rates"]) == {"plain", "batches", "async", "blocking", "again"}
    assert set(w5["rates"]) == {"memcpy", "batches", "async", "blocking", "again"}
    (line,) = [row for row in text.splitlines() if row.startswith("| W5 | 3 |")]
    assert line.split(" | ")[5] == "—"  # first epoch / plain: no plain loop


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_async_pairs_the_two_forms_in_one_process(tmp_path: Path) -> None:
    """``bench_async.py --quick``: a row a workload, both forms' µs a batch, the ratio and
    the A/A control with their intervals, and item 3's verdict."""
    proc = run_quick("bench_async.py", tmp_path, "--workloads", "W1,W5")
    text = proc.stdout
    assert "async for against for, paired in one process, 3 rounds, later epochs" in text
    for name in ("W1", "W5"):
        (line,) = [row for row in text.splitlines() if row.startswith(f"| {name} |")]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0
        assert re.fullmatch(r"[\d.]+× \([\d.]+–[\d.]+\)", cells[3]), cells[3]
        assert re.fullmatch(r"[\d.]+× \([\d.]+–[\d.]+\)", cells[4]), cells[4]
        assert re.fullmatch(r"(PASS|MISS)( \(unresolved\))?", cells[5]), cells[5]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_sweep_quick(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    png = tmp_path / "sweep.png"
    proc = run_quick(
        "bench_sweep.py", tmp_path, "--json", str(out), "--plot", str(png), "--markdown"
    )
    text = proc.stdout
    header = "| point | record B | epochs | headroom | plain later img/s | async first |"
    assert header in text
    assert "points PASS" in text
    assert "| A/A first | A/A later |" in text
    assert "A/A control (the blocking form against itself, same rounds): first epochs" in text
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_sweep" and doc["quick"] and doc["rounds"] == 1
    kinds = {p["kind"] for p in doc["points"]}
    assert kinds == {"raw", "jpeg"}
    for point in doc["points"]:
        assert f"| {point['name']} |" in text
        # the plain loop computes what Caffe (blobpipe.Transform) computes
        assert point["plain_vs_transform_max_abs_diff"] == pytest.approx(0, abs=1e-3)
        assert point["result"] in ("PASS", "MISS")
        # a later pass times several epochs of a small database (every pass checked
        # to deliver that many epochs' images)
        assert 1 <= point["later_epochs_per_pass"] <= 16
        assert len(point["parallel_headroom_per_round"]) == 1
        for key in ("plain", "async", "blocking", "blocking1", "again"):
            for kind in ("first", "later"):
                sample = point["contenders"][key][kind]
                assert len(sample["img_s"]) == 1 and sample["img_s"][0] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot: matplotlib is not installed" in text
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_bench_sweep_points_by_name() -> None:
    """A point is named as the sweep's table names it: every grid point's name gives the
    point back, and a shape the grid does not hold is a point too."""
    code = (
        "import bench_sweep as bs\n"
        "for p in bs.grid(False):\n"
        "    assert bs.point_from_name(p.name) == p, p.name\n"
        "p = bs.point_from_name('raw 3x80x80 TRAIN, crop 64, mirror, mean file')\n"
        "assert p.name == 'raw 3×80×80 TRAIN, crop 64, mirror, mean file', p.name\n"
        "assert (p.shape, p.recipe.crop, p.recipe.mirror) == ((3, 80, 80), 64, True)\n"
        "assert p.recipe.mean_file is not None\n"
        "for bad in ('raw 3x48 TEST', 'raw 3x48x48 TEST, sharpen', 'tiff 3x8x8 TEST'):\n"
        "    try:\n"
        "        bs.point_from_name(bad)\n"
        "    except ValueError:\n"
        "        continue\n"
        "    raise AssertionError(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_gil_releases_counts_each_sample_s_caller_within_the_window() -> None:
    """``bench/gil_releases.py`` reads ``perf script -F time,ip,sym``: per sample, the
    frame under the probed function, only for samples inside the counted epochs."""
    script = (
        "100.000001: \n\t  24fcf0 PyEval_SaveThread\n\t  2d0325 posix_do_stat.constprop.0\n\n"
        "100.500000: \n\t  24fcf0 PyEval_SaveThread\n\t  1a2b transform_rows\n"
        "\t  99 cfunction_call\n\n"
        "100.600000: \n\t  24fcf0 PyEval_SaveThread\n\t  1a2b transform_rows\n\n"
        "100.700000: \n\t  24fcf0 PyEval_SaveThread\n\t  77 acquire_timed\n\n"
        "101.500000: \n\t  24fcf0 PyEval_SaveThread\n\t  2d0325 _Py_fstat\n"
    )
    code = (
        "import json, sys\n"
        "import gil_releases\n"
        "got = gil_releases.callers_of(sys.stdin.read(), 100.4, 101.0)\n"
        "print(json.dumps(dict(got)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=BENCH,
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout) == {"transform_rows": 2, "acquire_timed": 1}


def test_prefault_touches_fresh_memory_and_says_what_it_did() -> None:
    """``_fresh.prefault`` (the first-epoch benchmarks' ``--prefault``): MiB touched and
    unmapped, its cost a MiB; none asked, none done; the header's note says so."""
    sys.path.insert(0, str(BENCH))
    try:
        import _fresh
    finally:
        sys.path.remove(str(BENCH))
    assert _fresh.prefault(0) == 0.0
    assert _fresh.prefault(4) > 0.0
    assert _fresh.note(16).startswith("16 MiB prefaulted before each first epoch's clock")
    reporting = _fresh.page_reporting()
    assert _fresh.note(0) == ("" if reporting is None else reporting)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_first_quick(tmp_path: Path) -> None:
    """The first-epoch breakdown of the held-out points (tiny databases, one round): a
    row each, both sides' stages, the ring's fresh memory, the ratio and the A/A
    control; the JSON holds every sample."""
    out = tmp_path / "first.json"
    proc = run_quick(
        "bench_first.py", tmp_path, "--json", str(out), "--markdown", "--prefault", "8"
    )
    assert "| point | records | plain open | 1st batch | first | close |" in proc.stdout
    assert "8 MiB prefaulted before each first epoch's clock" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_first" and doc["quick"] and doc["rounds"] == 1
    assert doc["prefault"] == 8
    names = ["raw 3×48×48 TEST, scale", "raw 3×80×80 TRAIN, crop 64, mirror, mean file"]
    assert list(doc["points"]) == names
    for name, samples in doc["points"].items():
        assert f"| {name} |" in proc.stdout
        (loader,) = samples["loader"]
        for stage in ("open", "start", "first_batch", "epoch", "close", "reopen", "later"):
            assert loader[stage] > 0, stage
        assert loader["fresh"] > 0 and loader["images"] == samples["records"][0]["count"]
        assert samples["plain"][0]["later"] > 0 and len(samples["again"]) == 1
        # every process touched its 8 MiB before its clock, and timed it
        assert all(r["prefault"] > 0 for k in ("plain", "loader", "again") for r in samples[k])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_ab_pairs_two_checkouts(tmp_path: Path) -> None:
    """Both sides run in their own processes, the other checkout's blobpipe imported there."""
    root = BENCH.parent
    proc = run_quick("bench_ab.py", tmp_path, str(root), "--pairs", "2", "--workloads", "W1,W3")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| W")]
    assert [r.split("|")[1:3] for r in rows] == [
        [f" {w} ", f" {figure} "] for w in ("W1", "W3") for figure in ("cpu s", "GIL µs a batch")
    ]
    for row in rows:
        assert row.rstrip(" |").endswith("×")  # the median ratio of this side over the other
    gil = [float(r.split("|")[3].split("·")[0]) for r in rows[1::2]]
    assert all(g > 0 for g in gil)  # every batch holds the GIL a while
    proc = run_quick(
        "bench_ab.py", tmp_path, str(root), "--pairs", "2", "--workloads", "W1,W5",
        "--loader", "async", "--control",
    )  # fmt: skip
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| W")]
    assert [r.split("|")[1:3] for r in rows] == [
        [f" {w} ", f" {figure} "]
        for w in ("W1", "W5")
        for figure in ("cpu s", "wall s", "first s", "GIL µs a batch")
    ]
    for row in rows:  # this / other, then the A/A control's median and range
        assert re.search(r"\| [\d.]+× \| [\d.]+× \([\d.]+–[\d.]+\) \|$", row), row
    assert "Loader (async form)" in proc.stdout
    proc = run_quick(
        "bench_ab.py", tmp_path, str(root), "--pairs", "1", "--loader",
        "--point", "raw 3x48x48 TEST, scale",
    )  # fmt: skip
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| raw")]
    assert [r.split("|")[1:3] for r in rows] == [
        [" raw 3×48×48 TEST, scale ", f" {figure} "]
        for figure in ("cpu s", "wall s", "first s", "GIL µs a batch")
    ]
    assert "heap shifted per pair" in proc.stdout
    proc = run_quick("bench_ab.py", tmp_path, str(root), "--pairs", "1", "--workloads", "W1",
                     "--no-heap-pad")  # fmt: skip
    assert "no heap shift" in proc.stdout and "| W1 |" in proc.stdout
    bad = [sys.executable, str(BENCH / "bench_ab.py"), str(tmp_path)]
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "holds no blobpipe/ package" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_ab_in_process_pairs_loaders_of_two_checkouts(tmp_path: Path) -> None:
    """--in-process: the other checkout's package imported beside this one's, three
    Loaders in one process; each row gives µs a batch, this / other and the A/A control,
    each with an interval."""
    root = BENCH.parent
    proc = run_quick(
        "bench_ab.py", tmp_path, str(root), "--in-process", "--workloads", "W1",
        "--point", "raw 3x48x48 TEST, scale",
    )  # fmt: skip
    assert "blobpipe_other" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| (W1|raw) ", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["W1", "raw 3×48×48 TEST, scale"]
    number = r"[\d.]+× \([\d.]+–[\d.]+\)"
    for row in rows:  # µs: this, other, again; then this / other and this / again
        assert re.search(rf"(\| [\d.]+ ){{3}}\| {number}( \*)? \| {number} \|$", row), row
    # a checkout whose row kernel is not built is refused (its small batches would go
    # another way, and the pairing would read that as the change)
    shutil.copytree(root / "blobpipe", tmp_path / "bare" / "blobpipe",
                    ignore=shutil.ignore_patterns("_rowkernel*.so", "__pycache__"))  # fmt: skip
    bad = [sys.executable, str(BENCH / "bench_ab.py"), str(tmp_path / "bare"), "--in-process"]
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "row kernel is not built" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_kernel_ab_pairs_two_kernels_in_one_process(tmp_path: Path) -> None:
    """Both builds of the row kernel loaded side by side, their outputs compared first; a
    checkout without a built kernel is refused."""
    root = BENCH.parent
    proc = run_quick("bench_kernel_ab.py", tmp_path, str(root), "--recipes", "W1,NHWC")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert [r.split("|")[1].strip() for r in rows] == [
        "1x28x28 TEST scale (W1)",
        "3x32x32 TRAIN crop 28 mirror mean file NHWC",
        "3x256x256 TRAIN crop 227 mirror mean file NHWC",
        "3x256x256 TRAIN crop 227 mirror uint8 NHWC",
    ]
    for row in rows:  # ns an image each side, then this / other: median (range)
        assert re.search(r"\| [\d,]+ \| [\d,]+ \| [\d.]+× \([\d.]+–[\d.]+\) \|$", row), row
    bad = [sys.executable, str(BENCH / "bench_kernel_ab.py"), str(tmp_path)]
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "build_ext --inplace" in proc.stderr


def test_bench_planners_reads_a_miss_past_the_bound_only_under_a_real_bound() -> None:
    sys.path.insert(0, str(BENCH))
    import bench_planners as bp

    assert bp.read_target(1.6, 2.0) == "PASS"
    assert bp.read_target(1.6, None) == "PASS"
    assert bp.read_target(1.3, 2.0) == "MISS"
    assert bp.read_target(1.3, 1.4) == "MISS, past the bound"
    assert bp.read_target(1.43, 1.32) == "MISS, no bound"  # the replay slower: no bound
    assert bp.read_target(1.6, 1.5) == "PASS, no bound"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_cold_python_times_planning_after_each_kind_of_traffic(tmp_path: Path) -> None:
    """One row per kind of work between two plans, nothing first (its ratio 1.00×), each
    with µs a batch and its ratio to nothing."""
    proc = run_quick("bench_cold_python.py", tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")][2:]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == ["nothing", "read the records", "copy the output", "fill the batch"]
    assert rows[0].endswith("| 1.00× |")
    for row in rows:
        assert re.fullmatch(r"\| [a-z ]+ \| [\d.]+ \| [\d.]+× \|", row), row


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_planners_pairs_the_two_planners_in_one_process(tmp_path: Path) -> None:
    """Batches alone, the consumer planning, the fillers planning, the consumer's rows
    alone (its kernel calls replayed) and those rows into one chunk's cached buffers, on a
    workload and a point, each row with its five times and four ratios (the last the
    bound; "—" for it and the replays' times where the consumer planned no batch), the
    A/A control's median and 90% interval, and item 2's target read against it."""
    proc = run_quick(
        "bench_planners.py", tmp_path, "--workloads", "W1", "--point", "raw 3x32x32 TEST, scale"
    )
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| case")]
    rows = [row for row in rows if not row.startswith("| ---")]
    assert [r.split("|")[1].strip() for r in rows] == ["W1", "raw 3×32×32 TEST, scale"]
    for row in rows:
        assert re.search(
            r"(\| [\d.]+ ){3}(\| ([\d.]+|—) ){2}(\| [\d.]+× ){3}\| ([\d.]+×|—) "
            r"\| [\d.]+× \([\d.]+–[\d.]+\) "
            r"\| (PASS|MISS)(, past the bound|, no bound)?( \(unresolved\))? \|$",
            row,
        ), row


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_chunk_bytes_pairs_the_consumers_chunk_limits_in_one_process(
    tmp_path: Path,
) -> None:
    """The current chunk limits against others on one Loader, a row a case with both
    times, the ratio and the A/A control's, each with its interval; the limits are
    the module's again afterwards (the run is in a subprocess: its own)."""
    proc = run_quick(
        "bench_chunk_bytes.py", tmp_path, "--workloads", "W2", "--point",
        "raw 3x32x32 TEST, scale", "--against", "8,4",
    )  # fmt: skip
    assert "other 8 MiB, over 4 MiB alone" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| (W2|raw) ", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["W2", "raw 3×32×32 TEST, scale"]
    for row in rows:
        assert re.search(
            r"(\| [\d.]+ ){2}\| [\d.]+× \([\d.]+–[\d.]+\)( \*)? \| [\d.]+× \([\d.]+–[\d.]+\) \|$",
            row,
        ), row


def _has_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


@pytest.mark.timeout(60)
@pytest.mark.skipif(_has_cupy(), reason="CuPy is installed: the no-GPU path is not taken")
def test_bench_gpu_without_gpu() -> None:
    script = str(BENCH / "bench_gpu.py")
    strict = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=50, check=False
    )
    assert strict.returncode == 1
    assert strict.stdout.startswith("skipped: no GPU (CuPy is not installed")
    lenient = subprocess.run(
        [sys.executable, script, "--allow-skip"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert lenient.returncode == 0
    assert lenient.stdout.startswith("skipped: no GPU")


# The slice of CuPy bench_gpu.py uses, on NumPy: checks the script's flow (calls, arithmetic,
# tables) before it meets a real GPU, where device time is scarce. Not a model of CUDA.
_FAKE_CUPY = """
import ctypes, time, types
import numpy as np

__version__ = "fake"
float32, uint8 = np.float32, np.uint8


class _Array(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def empty(n, dtype):
    return np.empty(n, dtype).view(_Array)


def zeros(n, dtype):
    return np.zeros(n, dtype).view(_Array)


def ones(n, dtype):
    return np.ones(n, dtype).view(_Array)


class _Stream:
    def __init__(self, non_blocking=False):
        assert non_blocking
        self.ptr = 1

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _Event:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _Device:
    def synchronize(self):
        pass


def _memcpy_async(dst, src, nbytes, kind, stream):
    assert kind == 1 and isinstance(stream, int)
    ctypes.memmove(dst, src, nbytes)


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    getDeviceProperties=lambda i: {"name": b"Fake GPU"},
    memcpyAsync=_memcpy_async,
    memcpyHostToDevice=1,
)
cuda = types.SimpleNamespace(
    runtime=runtime,
    Stream=_Stream,
    Event=_Event,
    Device=_Device,
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
)


class RawKernel:
    def __init__(self, code, name):
        assert "__global__ void " + name in code

    def __call__(self, grid, block, args):
        x, cycles, sink = args
        assert x.dtype == np.float32 and isinstance(cycles, np.int64)
        end = time.perf_counter() + int(cycles) * 1e-9
        while time.perf_counter() < end:
            pass
"""

_RUN_FAKE = """
import faulthandler
import sys
import bench_gpu
import blobpipe
from blobpipe._backends import EmulatedBackend


BACKEND = EmulatedBackend(delay=0.0005)


def make_loader(db, crop, workers, device_transform):
    return blobpipe.Loader(
        db.path, batch_size=64, device=BACKEND,
        transform=blobpipe.Transform(crop_size=crop, mirror=True, mean_file=db.mean_file),
        phase="train", shuffle=True, workers=workers, prefetch=4, mode="wrap",
        device_transform=device_transform,
    )


bench_gpu.make_loader = make_loader
bench_gpu.make_backend = lambda: BACKEND
# a hang shows every thread's stack in the test's failure, not only a timeout
faulthandler.dump_traceback_later(70, exit=True)
sys.exit(bench_gpu.main(sys.argv[1:]))
"""


@pytest.mark.timeout(90)
def test_bench_gpu_flow_on_fake_cupy(tmp_path: Path) -> None:
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(_FAKE_CUPY)
    (tmp_path / "cupyx").mkdir()
    (tmp_path / "cupyx" / "__init__.py").write_text(
        "import numpy as np\n\n\ndef empty_pinned(shape, dtype=float):\n"
        "    return np.empty(shape, dtype)\n"
    )
    (tmp_path / "run_fake.py").write_text(_RUN_FAKE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(BENCH), str(BENCH.parent)]),
    }
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "run_fake.py"),
            "--quick",
            "--steps",
            "20",
            "--seconds",
            "0.2",
            "--workers",
            "2",
            "--data-dir",
            str(tmp_path / "data"),
            "--json",
            str(out),
            "--link-gbps",
            "63",
        ],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
        env=env,
    )
    assert out.exists(), f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    doc = json.loads(out.read_text())
    # exit 1 exactly when a target is missed (a fake device's timing decides which)
    assert proc.returncode == (0 if doc["passed"] else 1), proc.stderr[-4000:]
    missed = [t for t in doc["targets"] if not t["passed"]]
    assert ("target missed" in proc.stderr) == bool(missed)
    assert [t["target"][:5] for t in doc["targets"]] == ["H2D f"] * 6 + ["starv"]
    link = [t for t in doc["targets"] if "PCIe link" in t["target"]]
    assert len(link) == 3 and doc["link_gbps"] == 63
    pairs = zip(link, doc["bandwidth"], strict=True)
    assert all(t["measured"] == r["pool_gbps"] / 63 for t, r in pairs)
    assert "against the PCIe link (63 GB/s per direction)" in proc.stdout
    for header in (
        "| size | pinned GB/s | pageable GB/s | blobpipe pool GB/s | pool / pinned |",
        "| workers | transfer | img/s | bus GB/s | of pinned peak |",
        "| workers | wall s | vs synthetic | starvation (wait_time) |",
    ):
        assert header in proc.stdout
    assert doc["pinned_peak_gbps"] > 0
    assert all(r["pool_gbps"] > 0 for r in doc["bandwidth"])
    assert doc["workload"]["crop"] == 80
    assert len(doc["loader_throughput"]) == 2
    assert doc["training"][0]["wall_s"] > 0


@pytest.mark.timeout(120)
def test_bench_workers_quick(tmp_path: Path) -> None:
    """Host throughput by worker count, W3 and W4 (tiny): a row each, in the table and
    the JSON, the speed-up over the first count."""
    out = tmp_path / "workers.json"
    proc = run_quick(
        "bench_workers.py", tmp_path, "--workers", "1,2", "--seconds", "0.2", "--json", str(out)
    )
    assert "| workload | workers | img/s | img/s per worker | vs 1 worker |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["workers"]) for r in rows] == [
        ("W3", 1),
        ("W3", 2),
        ("W4", 1),
        ("W4", 2),
    ]
    assert all(r["img_per_s"] > 0 for r in rows) and rows[0]["speedup"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_inputs_quick(tmp_path: Path) -> None:
    """LevelDB, ImageData and HDF5Data against their plain loops: every row printed
    (each contender's batches were checked equal to its plain loop's)."""
    text = run_quick("bench_inputs.py", tmp_path).stdout
    rows = (
        "LevelDB | plyvel loop",
        "LevelDB | Loader x2",
        "ImageData | imread loop",
        "ImageData | Loader x2",
        "HDF5Data | h5py slicing",
        "HDF5Data | Loader x2",
    )
    for row in rows:
        assert f"| {row} |" in text, text


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_cold_quick(tmp_path: Path) -> None:
    """Cold against warm first epochs (a tiny W3): every row, the ratios against the 0.90
    target and the IO floor, the A/A control, the JSON."""
    out = tmp_path / "cold.json"
    proc = run_quick("bench_cold.py", tmp_path, "--rounds", "1", "--json", str(out))
    for row in ("warm", "warm again (A/A control)", "cold", "read the file once, cold (IO floor)"):
        assert f"\n{row} " in proc.stdout, proc.stdout
    assert "cold / warm (rate), per round:" in proc.stdout and "target ≥ 0.90×" in proc.stdout
    assert "cold / max(warm, IO floor)" in proc.stdout and "A/A control:" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_cold" and doc["rounds"] == 1
    assert all(r[0]["seconds"] > 0 for r in doc["rows"].values())
    assert doc["rows"]["warm"][0]["images"] == 192
